"""Hybrid-SWA MoE LLM core: model, KV management, scheduling, generation."""

from llm_core.model.config import AttentionSpec, ConfigError, ModelConfig
from llm_core.llm import LLM, RequestOutput
from llm_core.model.multimodal import MultimodalSpan
from llm_core.sample.sampling import SamplingParams
from llm_core.loading.weights import CheckpointError

__all__ = [
    "LLM",
    "AttentionSpec",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "MultimodalSpan",
    "RequestOutput",
    "SamplingParams",
]
