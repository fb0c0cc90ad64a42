"""``sparkv model``: convert a model (first use) and describe it, with its measured quality table
(the table lives here, in the predictor, above the runtime that loads the model)."""

from __future__ import annotations

import argparse

from sparkv.layout import DEFAULT_CHUNK_TOKENS
from sparkv.cliflags import add_device_args


def register(sub: "argparse._SubParsersAction") -> None:
    m = sub.add_parser("model", help="convert (first use) and describe a model")
    m.add_argument("--model", default=None, help="local HF checkpoint (default: bundled SmolLM2)")
    m.add_argument("--tokens", type=int, default=4096, help="context length for the geometry")
    m.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="T of the printed geometry (default: the local prefill's T, "
                        f"{DEFAULT_CHUNK_TOKENS}; a server's context has its own, in its manifest)")
    add_device_args(m)
    m.set_defaults(func=_model)


def _model(args: argparse.Namespace) -> int:
    from sparkv.layout import ChunkGeometry
    from sparkv.predictor.dtypes import load_model_in_dtype

    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    g = ChunkGeometry.from_config(lm.config, args.tokens, args.chunk_tokens)
    n_params = sum(p.numel() for p in lm.model.parameters())
    print(f"model        {lm.name} ({lm.config.model_type}, {n_params / 1e6:.1f} M parameters)")
    print(f"fingerprint  {lm.fingerprint}")
    print(f"device       {lm.device}, {str(lm.dtype).replace('torch.', '')}")
    _print_dtype(lm)
    print(f"layers       {g.num_layers}, KV heads {g.num_kv_heads}, head_dim {g.head_dim}")
    print(f"context      {args.tokens} tokens -> {g.num_token_chunks} token chunks x "
          f"{g.num_layers} layers x {g.num_groups} groups = {g.num_chunks} KV chunks")
    _print_quality(lm.fingerprint)
    return 0


def _print_dtype(lm: object) -> None:
    """The compute dtype's reason and the CPU's bfloat16 hardware (docs/dtypes.md)."""
    from sparkv.runtime.device import BF16_CPU_FLAGS, cpu_bf16_flags

    choice = getattr(lm, "extra", {}).get("dtype_choice")
    if choice is not None:
        print(f"dtype        {choice.name} (--dtype {choice.requested}: {choice.reason})")
    flags = cpu_bf16_flags()
    print(f"cpu bf16     {', '.join(flags) if flags else 'none'} (of {', '.join(BF16_CPU_FLAGS)})")


def _print_quality(fingerprint: str) -> None:
    """The model's quality table: where it is and every entry's verdict (docs/quality.md)."""
    from sparkv.predictor.quality import (bundled_quality_table_path, describe_table,
                                          quality_table_path, usable_table)

    table = usable_table(fingerprint, check_codec=False)
    if table is None:
        print("quality      no table (defaults: floor q5, backend auto; docs/quality.md)")
        return
    own = quality_table_path(fingerprint)
    where = own if own.is_file() else bundled_quality_table_path(fingerprint)
    codec = "" if table.matches_codec() else " (another codec: levels ignored)"
    print(f"quality      {where}{codec}")
    for line in describe_table(table):
        print(f"  {line}")
