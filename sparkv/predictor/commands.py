"""``sparkv profile``: time real layer steps on this device (and optionally train the MLP on them).

    sparkv profile --out samples.json [--quick] [--threads 1] [--train model.json]

Writes the samples as JSON (or CSV for a ``.csv`` path); ``--train`` also fits the
:class:`~sparkv.predictor.model.LatencyModel` on them and saves it (default path:
:func:`default_model_path`). See docs/predictor.md.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sparkv.errors import SparkvError

if TYPE_CHECKING:
    from sparkv.predictor.profiler import ProfileConfig


def default_model_path(model_fingerprint: str, device: object = "cpu",
                       dtype: object = None) -> Path:
    """``<sparkv cache>/predictor/<model fingerprint>.json`` for the CPU in float32,
    ``...-cuda.json`` for a GPU, ``...-bfloat16.json`` (``...-cuda-bfloat16.json``, ``-mixed``,
    ...) for another compute configuration (``dtype``: a dtype or a configuration's name,
    :func:`sparkv.predictor.device.compute_name`): profiles of different devices and
    configurations are kept apart (docs/dtypes.md)."""
    from sparkv.predictor.device import DEFAULT_PROFILE_DTYPE, dtype_name
    from sparkv.runtime.model import cache_dir

    kind = getattr(device, "type", str(device)).split(":")[0]
    suffix = "" if kind == "cpu" else f"-{kind}"
    name = dtype_name(dtype)
    suffix += "" if name == DEFAULT_PROFILE_DTYPE else f"-{name}"
    return cache_dir() / "predictor" / f"{model_fingerprint}{suffix}.json"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("profile", help="profile real layer steps on this device (predictor data)")
    p.add_argument("--out", required=True, help="samples file (.json, or .csv)")
    p.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    p.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    p.add_argument("--tokens", type=int, default=None, help="context tokens per profiled run")
    p.add_argument("--chunk-sizes", type=_ints, default=None, help="e.g. 256,512,1024")
    p.add_argument("--cdf", type=_floats, default=None,
                   help="block-sparse cdf thresholds, e.g. 0.8,0.9,0.95,0.98")
    p.add_argument("--no-dense", action="store_true", help="skip the dense backend")
    p.add_argument("--loads", type=_floats, default=None,
                   help="induced load levels in CPU cores' worth of busy work, e.g. 0,1,2")
    p.add_argument("--layers", type=int, default=None, help="profile layers 0..N-1")
    p.add_argument("--repeats", type=int, default=None, help="contexts per combination")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while profiling (recorded; default 1)")
    p.add_argument("--device", default="cpu", help="torch device of the steps: cpu, cuda[:N], "
                                                    "auto (profiles are kept per device)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, "
                                                   "bfloat16")
    p.add_argument("--train", nargs="?", const="", default=None, metavar="MODEL_JSON",
                   help="also train the latency model and save it (default path: the sparkv "
                        "cache, predictor/<model fingerprint>.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> ProfileConfig:
    from sparkv.predictor.profiler import ProfileConfig

    cfg = ProfileConfig.quick() if args.quick else ProfileConfig()
    overrides = {"context_tokens": args.tokens, "chunk_sizes": args.chunk_sizes,
                 "cdf_thresholds": args.cdf, "loads": args.loads, "layers": args.layers,
                 "repeats": args.repeats, "threads": args.threads}
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    if args.no_dense:
        cfg.dense = False
    return cfg


def run(args: argparse.Namespace) -> int:
    from sparkv.predictor.profiler import Profiler, save_samples
    from sparkv.predictor.dtypes import load_model_in_dtype

    if args.threads < 1:
        raise SparkvError("--threads must be >= 1")
    cfg = build_config(args)
    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    try:
        profiler = Profiler(lm, cfg, progress=not args.no_progress)
    except ValueError as exc:
        raise SparkvError(str(exc)) from exc
    samples = profiler.run()
    meta = profiler.metadata()
    path = save_samples(args.out, samples, meta)
    att = [s for s in samples if s.kind == "attention"]
    print(f"wrote {len(samples)} samples ({len(att)} attention steps, "
          f"{len(samples) - len(att)} projection-only) in {profiler.elapsed_s:.0f} s to {path}")
    if args.train is not None:
        from sparkv.predictor.device import compute_name
        from sparkv.predictor.model import LatencyModel
        from sparkv.predictor.roofline import ModelArch, Roofline

        roof = Roofline.measure(ModelArch.from_model(lm), args.device, cfg.threads,
                                dtype=lm.dtype)
        model = LatencyModel().fit(samples, meta, roof)
        out = Path(args.train) if args.train else default_model_path(lm.fingerprint,
                                                                       lm.device,
                                                                       compute_name(lm))
        model.save(out)
        mape = model.info.get("test_mape_attention")
        print(f"trained the latency model on {model.info['train']} samples "
              f"(held-out MAPE {mape:.1f}%) -> {os.fspath(out)}")
    return 0
