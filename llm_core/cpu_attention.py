"""Decode attention on the CPU through a small C++ kernel (``csrc/``).

The torch decode path gathers every request's keys into a [B, keys, heads,
dim] copy and reads it again: three passes over the KV memory a step reads,
and most of a CPU decode step. The kernel reads K/V in place through the page
table, once. It is compiled on first use (``torch.utils.cpp_extension``,
cached by torch under ``~/.cache/torch_extensions``) and registered as a
custom op, so a compiled forward calls it as one opaque node. Where it cannot
be built (no compiler), ``load`` returns None and the torch path is used.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from llm_core.paged_attention import attention_output

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


@cache
def load() -> ModuleType | None:
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="swallow_paged_decode_attention",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path
        log.warning("the C++ decode attention kernel did not build (%s); using the torch path", exc)
        return None


@torch.library.custom_op("swallow::paged_decode_attention_cpu", mutates_args=())
def _paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    kernel = load()
    assert kernel is not None, "resolve the decode attention with available() first"
    return kernel.paged_decode_attention(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, sliding_window,
                                         sinks, kv_scales)


_paged_decode_attention_cpu.register_fake(attention_output)


def available() -> bool:
    return load() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_decode_attention_torch`` on CPU tensors (FP8 pools included)."""
    if not torch.compiler.is_compiling():  # eager: skip the custom-op dispatch, tens of us a call
        return load().paged_decode_attention(q, k_cache, v_cache, pages, page_size, kv_len, q_pos,  # type: ignore[union-attr]
                                             sliding_window or 0, sinks, kv_scales)
    return torch.ops.swallow.paged_decode_attention_cpu(q, k_cache, v_cache, pages, page_size, kv_len, q_pos,
                                                        sliding_window or 0, sinks, kv_scales)


if __name__ == "__main__":  # `python -m llm_core.cpu_attention`: build ahead of the first engine
    print("C++ CPU decode attention:", "built" if available() else "unavailable (the torch path is used)")
