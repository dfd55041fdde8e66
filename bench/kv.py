"""`swallow bench kv`: how many decode-phase requests of a context fit a KV
budget, hybrid SWA pools against full attention, through the real allocator
(``llm_core.kv.kv_capacity``), for model shapes that need not fit here."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="mimo-v2-flash", help="model shape")
    parser.add_argument("--context", type=int, default=131072, help="tokens per request")
    parser.add_argument("--kv-budget-gib", type=float, default=8192.0, help="KV memory budget")
    parser.add_argument("--page-size", type=int, default=16, help="full-pool page size")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"],
                        help="what the pools store (auto: bf16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from llm_core.engine_config import resolve_kv_dtype
    from llm_core.kv.kv_capacity import GIB, kv_capacity
    from llm_core.model.presets import get_preset

    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, torch.bfloat16)
    return kv_capacity(get_preset(args.preset), args.context, int(args.kv_budget_gib * GIB),
                       page_size=args.page_size, dtype=kv_dtype)
