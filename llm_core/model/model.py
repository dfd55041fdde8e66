"""The MiMo-V2 hybrid-SWA MoE model: one implementation, driven by ModelConfig.

Module and parameter names follow the Hugging Face checkpoint layout
(``model.layers.N.self_attn.q_proj.weight``, ``model.mtp.layers.N.*``) so
weights load by name. Every forward is over a flat batch of tokens from any
number of requests; where their K/V live is the attention backend's business.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_core.model.attention import AttentionBackend
from llm_core.model.config import AttentionSpec, LayerType, ModelConfig
from llm_core.model.layers import (
    DenseMLP,
    RMSNorm,
    SparseMoE,
    apply_partial_rotary,
    rotary_cos_sin,
)

RotaryTables = dict[LayerType, tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: AttentionSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.value_scale = config.attention_value_scale
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, spec.num_heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * spec.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.v_head_dim, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads)) if spec.has_sinks else None
        # KV-cache scales of an FP8 cache (stored = K / k_scale): the checkpoint's, else 1.0.
        self.register_buffer("k_scale", torch.ones(()), persistent=False)
        self.register_buffer("v_scale", torch.ones(()), persistent=False)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        spec, t = self.spec, x.shape[0]
        q = self.q_proj(x).view(t, spec.num_heads, spec.head_dim)
        k = self.k_proj(x).view(t, spec.num_kv_heads, spec.head_dim)
        v = self.v_proj(x).view(t, spec.num_kv_heads, spec.v_head_dim) * self.value_scale
        q = apply_partial_rotary(q, *cos_sin)
        k = apply_partial_rotary(k, *cos_sin)
        out = backend.attend(self.layer_idx, q, k, v, spec, self.sinks)
        return self.o_proj(out.reshape(t, spec.num_heads * spec.v_head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type: LayerType = config.layer_types[layer_idx]
        self.self_attn = Attention(config, config.attention(layer_idx), layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp: nn.Module = SparseMoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary[self.layer_type], backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """One multi-token-prediction block: predicts token t+2 from the main
    model's final (normed) hidden state at t and the embedding of token t+1."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, config.sliding_attention, layer_idx)
        self.pre_mlp_layernorm = RMSNorm(h, eps)
        self.mlp = DenseMLP(h, config.intermediate_size)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(
        self,
        token_embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(token_embeds), self.hnorm(prev_hidden)), dim=-1))
        cos_sin = rotary_cos_sin(positions, self.self_attn.spec, x.dtype)
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, backend)
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return self.final_layernorm(x)


class MTPStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # KV slots of MTP layers are numbered after the main layers.
        self.layers = nn.ModuleList(
            MTPLayer(config, config.num_hidden_layers + j) for j in range(config.num_mtp_layers)
        )


class MiMoV2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            # nn.Embedding's own init, done here: on the meta device (a checkpoint's
            # load) its normal_ would import torch._dynamo, a second of every start.
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_mtp_layers:
            self.mtp = MTPStack(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [T, hidden] for a flat batch of tokens."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        # Only the types some layer has: an absent type's spec is never validated.
        rotary: RotaryTables = {
            t: rotary_cos_sin(positions, self.config.attention_for(t), x.dtype)
            for t in set(self.config.layer_types)
        }
        for layer in self.layers:
            x = layer(x, rotary, backend)
        return self.norm(x)


class MiMoV2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MiMoV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states; ``inputs_embeds`` (e.g. with multimodal rows)
        replaces the token embedding lookup of ``input_ids``."""
        return self.model(input_ids, positions, backend, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        depth: int,
        next_token_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden state of MTP layer ``depth`` (feed to ``compute_logits``)."""
        if depth >= self.config.num_mtp_layers:
            raise ValueError(f"model has {self.config.num_mtp_layers} MTP layers, asked for {depth}")
        embeds = self.model.embed_tokens(next_token_ids)
        return self.model.mtp.layers[depth](embeds, prev_hidden, positions, backend)
