"""Hybrid-SWA MoE LLM core: model, KV management, scheduling, generation."""

from llm_core.config import AttentionSpec, ConfigError, ModelConfig
from llm_core.llm import LLM, RequestOutput
from llm_core.multimodal import MultimodalSpan
from llm_core.sampling import SamplingParams
from llm_core.weights import CheckpointError

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
