"""The top-level Python API (docs/python-api.md): every name of ``sparkv.__all__`` resolves, lazily
(``import sparkv`` loads neither torch nor the server), and every API that generates returns the
one shape ``text``, ``tokens``, ``stats`` (:class:`sparkv.generation.Generation`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparkv
from sparkv.generation import COMMON_STATS, Generation

ROOT = Path(__file__).resolve().parent.parent


def test_import_sparkv_is_cheap_and_changes_no_environment():
    code = ("import json, os, sys; env = dict(os.environ); import sparkv; print(json.dumps(["
            "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', "
            "'fastapi') or m.startswith('sparkv.')), dict(os.environ) == env]))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[], True]


def test_every_top_level_name_resolves_to_its_part():
    from sparkv.device.service import ContextService
    from sparkv.edge.session import EdgeSession
    from sparkv.presses import SnapKVPress
    from sparkv.runtime.model import load_model

    for name in sparkv.__all__:
        assert getattr(sparkv, name) is not None, name
    assert sparkv.EdgeSession is EdgeSession and sparkv.ContextService is ContextService
    assert sparkv.load_model is load_model and sparkv.SnapKVPress is SnapKVPress
    from sparkv.decode import generate
    assert sparkv.generate is generate
    assert set(sparkv.__all__) <= set(dir(sparkv))


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        sparkv.NoSuchThing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'NoSuchPress'"):
        sparkv.NoSuchPress  # noqa: B018
    with pytest.raises(ImportError):
        exec("from sparkv import NoSuchThing", {})


def _check_shape(result: object, tokens: list[int]) -> dict:
    assert isinstance(result, Generation)
    assert result.tokens == tokens and isinstance(result.text, str)
    stats = result.stats
    assert set(COMMON_STATS) <= set(stats) and stats["new_tokens"] == len(tokens)
    assert stats["ttft_s"] >= 0
    json.dumps(stats, default=str)       # plain data
    return stats


def test_greedy_and_decode_results_share_the_shape(tiny_llama, tmp_path):
    from sparkv.runtime import greedy_generate, reference_prefill

    torch.manual_seed(3)
    n = 48
    ids = torch.randint(0, 128, (n,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    greedy = greedy_generate(tiny_llama, layers, n, [1, 2], max_new_tokens=6, stop_at_eos=False)
    stats = _check_shape(greedy, greedy.tokens)
    assert stats["ttft_s"] == greedy.first_token_s and stats["total_s"] == greedy.total_s
    result = sparkv.generate(tiny_llama, layers, n, [1, 2], 6, kv_policy="dynakv", budget=1.0,
                             stop_at_eos=False, flash_dir=tmp_path)
    stats = _check_shape(result, greedy.tokens)        # the same tokens: a budget holding all
    assert stats["decode"]["policy"] == "dynakv"
    gen, dstats = result                                # the old tuple still unpacks
    assert gen is result.generation and dstats is result.decode_stats
    assert gen.tokens == result.tokens


def test_the_context_services_call_has_the_shape(smollm2, tmp_path):
    svc = sparkv.ContextService(smollm2, 64 << 20, tmp_path / "svc")
    cid = svc.new_context("You answer in one word.")
    res = svc.call(cid, "Say hi.", max_new_tokens=3)
    stats = _check_shape(res, res.tokens)
    assert stats["ttft_s"] == res.first_token_s and stats["switch_s"] == res.switch_s
    assert "text" not in stats and "tokens" not in stats


def test_an_ask_result_has_the_shape():
    from sparkv.edge.answer import AskResult, Breakdown

    res = AskResult("Paris", [5, 6], Breakdown("local", 0.25, chunks_computed=3), None, None,
                    None, context_tokens=100)
    stats = _check_shape(res, [5, 6])
    assert res.text == "Paris" and not hasattr(res, "answer")
    assert stats["ttft_s"] == 0.25 and stats["strategy"] == "local"
    assert stats["context_tokens"] == 100 and stats["chunks_computed"] == 3


def test_the_http_replies_have_the_shape_and_no_old_keys():
    from sparkv.device.calls import CallResult
    from sparkv.device.client import DeviceClient
    from sparkv.device.schemas import CallReply, DoneEvent
    from sparkv.edge.answer import AskResult, Breakdown
    from sparkv.edge.shaper import LinkShaper

    assert sparkv.DeviceClient is DeviceClient and sparkv.LinkShaper is LinkShaper
    wire = CallResult("0123456789abcdef", "Hi.", [7, 8], 0.002, first_token_s=0.1,
                      context_tokens=30).to_dict()
    assert set(wire) == {"context_id", "text", "tokens", "stats"}
    reply = CallReply.model_validate(json.loads(json.dumps(wire)))
    stats = _check_shape(reply, [7, 8])
    assert stats["switch_s"] == 0.002 and stats["context_tokens"] == 30
    assert not {"switch_ms", "first_token_ms", "total_ms"} & set(stats)
    ask = AskResult("Paris", [5, 6], Breakdown("stream", 0.5), None, None, None,
                    context_tokens=40)
    done = DoneEvent.model_validate({"type": "done", "id": "a1", "text": ask.text,
                                     "tokens": ask.tokens, "stats": ask.stats, "kept_id": None,
                                     "started": 1, "queued_s": 0.0, "first_token_s": 0.6,
                                     "total_s": 0.7})
    assert _check_shape(done, [5, 6])["strategy"] == "stream"
