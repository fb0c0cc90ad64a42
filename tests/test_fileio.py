"""The one flash backend (sparkv.fileio) and its three users: atomic writes that leave no
partial file, checksummed reads with a clear error, honest reads at any alignment."""

from __future__ import annotations

import json
import os

import pytest

from sparkv.cache import FlashError, FlashTier
from sparkv.decode.store import PAGE, IOStats, PageFile
from sparkv.device.flashio import ServiceFlash
from sparkv.device.journal import Journal
from sparkv import fileio
from sparkv.fileio import (ChecksumError, FlashIO, atomic_write, checksum, delete,
                           io_alignment, page_size, verify)

ALIGNMENTS = [4096, 16384]


def _entries(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ---- sizes ---------------------------------------------------------------------------------------
def test_sizes_are_read_at_run_time(tmp_path):
    assert page_size() == os.sysconf("SC_PAGE_SIZE")
    a = io_alignment(tmp_path)
    assert a >= 512 and a & (a - 1) == 0
    assert FlashIO(tmp_path).align == a
    with pytest.raises(ValueError):
        FlashIO(tmp_path, align=3000)


# ---- atomic writes -------------------------------------------------------------------------------
@pytest.mark.parametrize("step", ["write", "fsync", "replace"])
def test_a_failed_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch, step):
    target = tmp_path / "f.bin"
    atomic_write(target, b"old contents")
    real = {"write": os.write, "fsync": os.fsync, "replace": os.replace}[step]

    def broken(*args):
        if step == "write":             # half the bytes land, then the disk is full
            real(args[0], bytes(args[1])[:5])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, step, broken)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, b"new contents that never land")
    monkeypatch.setattr(os, step, real)
    assert target.read_bytes() == b"old contents"
    assert _entries(tmp_path) == ["f.bin"]          # no temp file left


def test_a_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    def broken(fd, data):
        raise OSError(5, "I/O error")
    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(FlashError, match="cannot write"):
        FlashTier(tmp_path).write("a.skvc", b"x" * 100)
    assert _entries(tmp_path) == []


def test_atomic_write_temp_files_are_hidden_and_unique(tmp_path, monkeypatch):
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        real(src, dst)
    monkeypatch.setattr(os, "replace", spy)
    atomic_write(tmp_path / "a", b"1")
    atomic_write(tmp_path / "a", b"2")
    assert len(set(seen)) == 2
    assert all(n.startswith(".a.") and n.endswith(".tmp") for n in seen)
    assert (tmp_path / "a").read_bytes() == b"2"


def test_users_keep_their_files_and_formats(tmp_path):
    """The journal and the service's tier write the same files as before (read back by name)."""
    j = Journal(tmp_path / "journal", "float32")
    j.write("ctx1", {"tokens": [1, 2, 3]})
    doc = json.loads((tmp_path / "journal" / "ctx1.json").read_text())
    assert doc["tokens"] == [1, 2, 3] and doc["compute"] == "float32"
    assert [r["id"] for r in j.records()] == ["ctx1"]
    j.remove("ctx1")
    j.remove("ctx1")                                # twice: no error
    assert j.records() == []
    tier = ServiceFlash(tmp_path / "tier")
    with tier.batch():
        refs = [tier.write(f"{i}.skvt", bytes([i]) * 5000) for i in range(3)]
    assert tier.syncs == 1 and tier.writes == 3
    assert [tier.read(r) for r in refs] == [bytes([i]) * 5000 for i in range(3)]
    assert [p.name for p in tier.files()] == ["0.skvt", "1.skvt", "2.skvt"]
    assert delete(refs[0].path) and not delete(refs[0].path)


# ---- checksums -----------------------------------------------------------------------------------
def test_checksum_mismatch_raises_the_clear_error():
    data = os.urandom(1000)
    verify(data, checksum(data), "x")
    with pytest.raises(ChecksumError, match="page 7 fails its checksum"):
        verify(data[:-1] + bytes([data[-1] ^ 1]), checksum(data), "page 7")
    assert issubclass(ChecksumError, FlashError)


# ---- reads at any alignment ----------------------------------------------------------------------
@pytest.mark.parametrize("align", ALIGNMENTS)
@pytest.mark.parametrize("direct", [True, False])
def test_whole_file_reads_at_an_alignment(tmp_path, align, direct):
    io = FlashIO(tmp_path, direct=direct, align=align)
    took = None
    for size in (0, 1, 4095, 4096, 4097, align - 1, align, align + 1, 3 * align + 5, 200_000):
        blob = os.urandom(size)
        atomic_write(tmp_path / "f", blob)
        assert io.read_file(tmp_path / "f") == blob, size
        took = io.direct if took is None else took
    assert io.direct == took                         # no read was refused: they stayed direct
    tier = FlashTier(tmp_path / "tier", direct=direct, align=align)
    ref = tier.write("c.skvc", b"abc" * 7000)
    assert tier.read(ref) == b"abc" * 7000
    with pytest.raises(FlashError, match="missing"):
        tier.read(tmp_path / "tier" / "nope")


@pytest.mark.parametrize("align", ALIGNMENTS)
@pytest.mark.parametrize("direct", [True, False])
def test_a_read_view_holds_what_a_read_gives_and_reuses_its_buffer(tmp_path, align, direct):
    """A loader's run read as a view of the read's own buffer (no copy): the same bytes as
    ``read_range`` at any offset and length (the end of the file included), read-only, and the
    buffer kept for the next read, not a new mapping each time."""
    io = FlashIO(tmp_path, direct=direct, align=align)
    blob = os.urandom(2 * 2**20 + 12345)
    atomic_write(tmp_path / "f", blob)
    for off, n in [(0, len(blob)), (1, 10), (4095, 2 * 2**20), (5000, 20000), (len(blob) - 3, 100),
                   (len(blob) + 10, 5), (0, 0)]:
        with io.read_view(tmp_path / "f", off, n) as view:
            assert bytes(view) == blob[off:off + n] == io.read_range(tmp_path / "f", off, n)
            assert view.readonly
    made = []
    real = fileio.mmap.mmap
    monkey = pytest.MonkeyPatch()
    monkey.setattr(fileio.mmap, "mmap", lambda *a, **k: made.append(1) or real(*a, **k))
    try:
        for _ in range(3):
            with io.read_view(tmp_path / "f", 7, 2**20) as view:
                assert bytes(view[:5]) == blob[7:12]
    finally:
        monkey.undo()
    assert not made                                  # the kept buffer, three times over


def test_a_read_view_left_by_an_error_does_not_give_back_a_buffer_still_viewed(tmp_path):
    """An exception inside the block (its frames may still hold an array of the buffer) is the
    one raised, and that buffer is not handed to the next read: the array keeps its bytes."""
    import numpy as np
    io = FlashIO(tmp_path)
    a, b = os.urandom(100_000), os.urandom(100_000)
    atomic_write(tmp_path / "a", a)
    atomic_write(tmp_path / "b", b)
    held = []
    with pytest.raises(KeyError, match="mid-read"):
        with io.read_view(tmp_path / "a", 0, len(a)) as view:
            held.append(np.frombuffer(view, dtype=np.uint8))
            raise KeyError("mid-read")
    for _ in range(fileio._KEEP_COUNT + 1):          # every kept buffer used again
        with io.read_view(tmp_path / "b", 0, len(b)) as view:
            assert bytes(view) == b
    assert held[0].tobytes() == a


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_positioned_reads_and_writes_at_an_alignment(tmp_path, align):
    io = FlashIO(tmp_path, align=align)
    with io.open(tmp_path / "f", create=True) as f:
        used_direct = f.dfd >= 0
        blob = os.urandom(8 * 4096)
        f.pwrite(0, blob[:align])                    # aligned: O_DIRECT where allowed
        for off in range(align, len(blob), 4096):    # 4 KiB pieces: buffered under 16 KiB
            f.pwrite(off, blob[off:off + 4096])
        for off, n in [(0, len(blob)), (1, 10), (4095, 2), (4096, 4096), (5000, 20000),
                       (len(blob) - 3, 100), (len(blob) + 10, 5)]:
            assert f.pread(off, n) == blob[off:off + n], (off, n)
        assert io.direct == used_direct              # nothing refused: reads stayed direct


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_page_file_at_an_alignment(tmp_path, align):
    f = PageFile(tmp_path / "f", IOStats(), align=align)
    pages = {p: os.urandom(PAGE) for p in (5, 0, 9, 1, 2, 3)}
    for p, data in pages.items():
        f.write(p, data, "append")
    for p, data in pages.items():
        assert f.read(p, 1) == data
    assert f.read(0, 4) == pages[0] + pages[1] + pages[2] + pages[3]
    assert f.read(4, 2) == bytes(PAGE) + pages[5]
    f.close()
