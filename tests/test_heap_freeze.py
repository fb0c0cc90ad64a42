"""freeze_heap: what is alive is left out of full collections, what is made after is still
collected; the codec's warm-up runs every coding path it names (a subprocess each: a freeze is
for the whole process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_freeze_heap_leaves_out_what_lives_and_collects_what_comes_after():
    out = _run("""
        import gc, weakref
        from sparkv.runtime.heap import freeze_heap

        class Node:
            pass

        held = [Node() for _ in range(20000)]
        frozen = freeze_heap()
        assert frozen >= len(held), frozen
        assert len(gc.get_objects(generation=2)) < frozen
        a, b = Node(), Node()                       # a cycle made after the freeze
        a.other, b.other = b, a
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        print(dead() is None, len(held))
    """)
    assert out == "True 20000", out


def test_warm_up_round_trips_every_level_it_names():
    out = _run("""
        from sparkv.codec.warm import warm_up
        from sparkv.codec import huffman
        import numba

        warm_up(("raw", "q8", "q5"))
        kernels = [f for f in vars(huffman).values() if isinstance(f, numba.core.registry.CPUDispatcher)]
        print(sum(bool(f.signatures) for f in kernels) > 0)
    """)
    assert out == "True", out


def test_warm_up_refuses_an_unknown_level():
    out = _run("""
        from sparkv.codec.warm import warm_up
        try:
            warm_up(("q99",))
        except Exception as e:
            print(type(e).__name__)
    """)
    assert out in ("CodecError", "ValueError", "KeyError", "SparkvError"), out


def test_settle_freezes_only_in_a_commands_own_process():
    """A test (or a library user) calling the CLI's main inside its own process keeps its
    collector whole; the command's own process (``main()`` with no arguments) settles."""
    out = _run("""
        from sparkv.runtime import heap

        first = heap.settle()
        heap.own_process()
        print(first, heap.settle() > 0)
    """)
    assert out == "0 True", out


def test_settle_runs_the_kernel_families_it_is_given():
    """An edge command settles with the codec's kernels alone; a device service with every
    family (its first switch from flash otherwise loaded the dense fill's: 0.47-0.56 s against
    0.15 s, docs/device-service.md)."""
    out = _run("""
        from sparkv.kernels import FAMILIES
        from sparkv.runtime import heap

        heap.own_process()
        heap.settle()
        import sparkv.device.dequant as dq
        before = len(dq._records_into.signatures)
        heap.settle(tuple(FAMILIES))
        print(before, len(dq._records_into.signatures) > 0)
    """)
    assert out == "0 True", out


def test_a_freed_working_memory_is_reused_not_mapped_again():
    """keep_freed_memory: a working memory's layers (3.2 MB tensors) freed and made again come
    back in pages already faulted in (few new page faults), whatever the process freed before
    (a subprocess: the heap's thresholds are the whole process's)."""
    out = _run("""
        import resource, torch
        from sparkv.runtime.heap import keep_freed_memory

        assert keep_freed_memory()
        def make():
            return [torch.zeros(3 * 4160 * 64 * 4 // 4) for _ in range(60)]   # 60 x 3.2 MB
        w = make()
        del w
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        w = make()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    pages = 60 * 3 * 4160 * 64 * 4 // 4096
    assert int(out) < pages // 4, (out, pages)           # fresh pages: ~all 46,800
