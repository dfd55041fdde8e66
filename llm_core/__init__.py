"""Hybrid-SWA MoE LLM core: model, KV management, scheduling, generation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from llm_core.llm import LLM, RequestOutput
    from llm_core.loading.weights import CheckpointError
    from llm_core.model.config import AttentionSpec, ConfigError, ModelConfig
    from llm_core.model.multimodal import MultimodalSpan
    from llm_core.sample.params import SamplingParams

# Where each public name lives. They are loaded on first use: a process that needs
# only the torch-free parts (the router, a command's parser) never imports torch.
_EXPORTS = {
    "LLM": "llm_core.llm",
    "RequestOutput": "llm_core.llm",
    "CheckpointError": "llm_core.loading.weights",
    "AttentionSpec": "llm_core.model.config",
    "ConfigError": "llm_core.model.config",
    "ModelConfig": "llm_core.model.config",
    "MultimodalSpan": "llm_core.model.multimodal",
    "SamplingParams": "llm_core.sample.params",
}

__all__ = [
    "AttentionSpec",
    "CheckpointError",
    "ConfigError",
    "LLM",
    "ModelConfig",
    "MultimodalSpan",
    "RequestOutput",
    "SamplingParams",
]


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
