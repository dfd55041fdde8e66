"""Model configuration for the MiMo-V2 (hybrid SWA MoE) architecture.

One frozen dataclass describes every model of the family. It is read from a
Hugging Face ``config.json`` in either of the two spellings in the wild:

* the ``transformers`` one (``model_type: mimo_v2_flash``, ``layer_types``,
  ``mlp_layer_types``, per-layer-type ``rope_parameters``, ``sliding_window``
  counting the query itself), and
* the original hub one (``model_type: mimo_v2``, ``hybrid_layer_pattern``,
  ``moe_layer_freq``, ``swa_*`` head fields, ``sliding_window_size`` counting
  only the previous tokens, ``add_*_attention_sink_bias``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["full", "sliding"]
MlpType = Literal["dense", "sparse"]

TRANSFORMERS_MODEL_TYPE = "mimo_v2_flash"
HUB_MODEL_TYPES = ("mimo_v2", "mimo_v2_flash_hub")
# transformers' class default when a config.json omits the field.
TRANSFORMERS_DEFAULT_VALUE_SCALE = 0.707


class ConfigError(ValueError):
    """A config.json that does not describe a model this engine can run."""


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and behaviour of the attention of one layer type."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Number of keys a query sees, itself included (transformers' convention);
    # None for full attention.
    sliding_window: int | None
    has_sinks: bool

    @property
    def rope_dim(self) -> int:
        """The d of the rotary frequencies theta^(-2i/d): head_dim times the
        factor, truncated as the reference does (192 * 0.334 -> 64)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_dim(self) -> int:
        """Leading q/k channels that rotate: two per frequency i in [0, d) step 2.

        An odd d therefore rotates d + 1 channels (16 * 0.334 -> d = 5 -> 6),
        exactly as transformers does; d <= 0 rotates none.
        """
        return 2 * len(range(0, self.rope_dim, 2))

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V stored per token and layer; times dtype size for bytes."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerType, ...]
    mlp_layer_types: tuple[MlpType, ...]
    full_attention: AttentionSpec
    sliding_attention: AttentionSpec
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    attention_value_scale: float = 1.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------- queries
    @property
    def window_size(self) -> int:
        """W: how many previous tokens an SWA query sees (128 in MiMo-V2)."""
        window = self.sliding_attention.sliding_window
        return 0 if window is None else window - 1

    def attention(self, layer_idx: int) -> AttentionSpec:
        return self.attention_for(self.layer_types[layer_idx])

    def attention_for(self, layer_type: LayerType) -> AttentionSpec:
        return self.sliding_attention if layer_type == "sliding" else self.full_attention

    @property
    def used_layer_types(self) -> tuple[LayerType, ...]:
        """Layer types some layer runs (MTP layers attend like SWA layers).

        Only these must describe a runnable attention: transformers builds no
        module for an absent type, so e.g. an all-full model may have heads
        that do not divide the doubled SWA KV-head count.
        """
        return _used_layer_types(self.layer_types, self.num_mtp_layers)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full")

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding")

    def num_parameters(self) -> int:
        """Parameter count of the main model plus its MTP layers."""
        h = self.hidden_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_hidden_layers):
            total += self._attention_params(self.attention(i)) + 2 * h
            if self.mlp_layer_types[i] == "sparse":
                e, m = self.n_routed_experts, self.moe_intermediate_size
                total += e * 3 * h * m + e * h + e
            else:
                total += 3 * h * self.intermediate_size
        mtp_layer = (
            2 * h * h + 5 * h + self._attention_params(self.sliding_attention)
            + 3 * h * self.intermediate_size
        )
        return total + self.num_mtp_layers * mtp_layer

    def _attention_params(self, spec: AttentionSpec) -> int:
        h = self.hidden_size
        q = spec.num_heads * spec.head_dim
        k = spec.num_kv_heads * spec.head_dim
        v = spec.num_kv_heads * spec.v_head_dim
        o = spec.num_heads * spec.v_head_dim
        bias = (q + k + v) if self.attention_bias else 0
        return h * (q + k + v) + o * h + bias + (spec.num_heads if spec.has_sinks else 0)

    # -------------------------------------------------------------- validation
    def _validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ConfigError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types "
                f"({len(self.mlp_layer_types)}) must both have num_hidden_layers={n} entries"
            )
        if bad := set(self.layer_types) - {"full", "sliding"}:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if bad := set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(f"unknown mlp layer types {sorted(bad)}")
        for name in self.used_layer_types:
            _validate_attention(name, self.attention_for(name))
        if "sliding" in self.used_layer_types and not self.sliding_attention.sliding_window:
            raise ConfigError("sliding (and MTP) layers need a sliding window size")
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts % self.n_group:
                raise ConfigError("n_routed_experts must be divisible by n_group")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError("num_experts_per_tok must be in [1, n_routed_experts]")
            if self.topk_group > self.n_group:
                raise ConfigError("topk_group must not exceed n_group")

    # ------------------------------------------------------------ construction
    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json at {path}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _parse_hf_config(data)

    def with_mtp_layers(self, num_mtp_layers: int) -> ModelConfig:
        return dataclasses.replace(self, num_mtp_layers=num_mtp_layers)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the transformers spelling, plus the explicit hub
        fields transformers cannot express (SWA head counts, sink flags)."""
        full, swa = self.full_attention, self.sliding_attention
        rope = {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": full.rope_theta,
                "partial_rotary_factor": full.partial_rotary_factor,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": swa.rope_theta,
                "partial_rotary_factor": swa.partial_rotary_factor,
            },
        }
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        return {
            "architectures": ["MiMoV2FlashForCausalLM"],
            "model_type": TRANSFORMERS_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": full.num_heads,
            "num_key_value_heads": full.num_kv_heads,
            "head_dim": full.head_dim,
            "v_head_dim": full.v_head_dim,
            "swa_num_attention_heads": swa.num_heads,
            "swa_num_key_value_heads": swa.num_kv_heads,
            "swa_head_dim": swa.head_dim,
            "swa_v_head_dim": swa.v_head_dim,
            "add_full_attention_sink_bias": full.has_sinks,
            "add_swa_attention_sink_bias": swa.has_sinks,
            "sliding_window": swa.sliding_window,
            "layer_types": [f"{t}_attention" for t in self.layer_types],
            "mlp_layer_types": list(self.mlp_layer_types),
            "rope_parameters": rope,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_value_scale": self.attention_value_scale,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }


def _used_layer_types(layer_types: tuple[LayerType, ...], num_mtp_layers: int) -> tuple[LayerType, ...]:
    used = set(layer_types) | ({"sliding"} if num_mtp_layers else set())
    return tuple(t for t in ("full", "sliding") if t in used)  # type: ignore[misc]


def _validate_attention(name: str, spec: AttentionSpec) -> None:
    if spec.num_heads % spec.num_kv_heads:
        raise ConfigError(
            f"{name} attention: {spec.num_heads} heads not divisible by "
            f"{spec.num_kv_heads} KV heads"
        )
    # transformers fails on these too: a negative factor in torch.arange, a
    # rotation wider than the head in a shape mismatch (head_dim 1 alone
    # "runs", by broadcasting q and k to two channels, which is no rotary).
    if spec.partial_rotary_factor < 0:
        raise ConfigError(
            f"{name} attention: partial_rotary_factor {spec.partial_rotary_factor} is negative"
        )
    if spec.rotary_dim > spec.head_dim:
        raise ConfigError(
            f"{name} attention: head_dim {spec.head_dim} x partial_rotary_factor "
            f"{spec.partial_rotary_factor} gives rotary dim {spec.rope_dim}, which rotates "
            f"{spec.rotary_dim} channels (whole pairs), more than the head has"
        )


# ---------------------------------------------------------------- hub parsing
def _get(data: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if data.get(name) is not None:
            return data[name]
    return default


def _require_int(data: dict[str, Any], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json needs a positive integer '{name}' (got {value!r})")
    return value


def _parse_layer_types(data: dict[str, Any], n: int) -> tuple[LayerType, ...]:
    if (types := data.get("layer_types")) is not None:
        mapping = {"full_attention": "full", "sliding_attention": "sliding"}
        try:
            return tuple(mapping[t] for t in types)  # type: ignore[misc]
        except KeyError as exc:
            raise ConfigError(f"unknown layer type {exc.args[0]!r} in layer_types") from exc
    if (pattern := data.get("hybrid_layer_pattern")) is not None:
        if any(p not in (0, 1) for p in pattern):
            raise ConfigError("hybrid_layer_pattern entries must be 0 (full) or 1 (sliding)")
        return tuple("sliding" if p else "full" for p in pattern)
    # transformers' default: full attention at layer 0 and every 6th layer.
    return tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(n))


def _parse_mlp_types(data: dict[str, Any], n: int) -> tuple[MlpType, ...]:
    if (types := data.get("mlp_layer_types")) is not None:
        return tuple(types)
    freq = data.get("moe_layer_freq")
    if isinstance(freq, list):
        return tuple("sparse" if f else "dense" for f in freq)
    if isinstance(freq, int) and freq > 0:
        first_dense = int(data.get("first_k_dense_replace") or 0)
        return tuple(
            "sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(n)
        )
    return ("dense",) + ("sparse",) * (n - 1)


_ROPE_TYPE_KEYS = ("full_attention", "sliding_attention")


def _rope_by_type(data: dict[str, Any], used: tuple[LayerType, ...]) -> dict[LayerType, tuple[float, float]]:
    """(theta, partial_rotary_factor) per layer type."""
    found = {t: _rope_for(data, t) for t in ("full", "sliding")}
    if missing := [t for t in used if found[t] is None]:
        raise ConfigError(f"rope_parameters has no entry for the {missing[0]}_attention layers")
    # A type no layer runs may be left out; its spec only needs valid values.
    fallback = next(v for v in found.values() if v is not None)
    return {t: v or fallback for t, v in found.items()}  # type: ignore[misc]


def _rope_for(data: dict[str, Any], layer_type: LayerType) -> tuple[float, float] | None:
    """(theta, partial_rotary_factor) for one layer type; None where per-type
    rope_parameters leave the type out."""
    params = data.get("rope_parameters")
    key = f"{layer_type}_attention"
    if isinstance(params, dict) and any(k in params for k in _ROPE_TYPE_KEYS):
        params = params.get(key)
        if params is None:
            return None
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported (only 'default')")
        if params.get("rope_theta") is None:
            raise ConfigError(f"rope_parameters for {key} have no rope_theta")
        # transformers' own default when a per-type entry omits the factor.
        return float(params["rope_theta"]), float(params.get("partial_rotary_factor", 0.334))
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (
        None,
        "default",
    ):
        raise ConfigError(f"rope scaling {scaling!r} is not supported")
    full_theta = float(_get(data, "rope_theta", default=10000.0))
    theta = full_theta
    if layer_type == "sliding":
        theta = float(_get(data, "swa_rope_theta", default=full_theta))
    return theta, float(_get(data, "partial_rotary_factor", default=1.0))


def _parse_hf_config(data: dict[str, Any]) -> ModelConfig:
    model_type = data.get("model_type")
    if model_type != TRANSFORMERS_MODEL_TYPE and model_type not in HUB_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}: this engine runs the MiMo-V2 "
            f"architecture ('{TRANSFORMERS_MODEL_TYPE}' or 'mimo_v2')"
        )
    if _get(data, "hidden_act", default="silu") != "silu":
        raise ConfigError("only hidden_act='silu' is supported")
    if _get(data, "n_shared_experts", default=0):
        raise ConfigError("shared experts are not part of the MiMo-V2 architecture")
    if _get(data, "scoring_func", default="sigmoid") != "sigmoid":
        raise ConfigError("only the sigmoid router (scoring_func='sigmoid') is supported")

    n = _require_int(data, "num_hidden_layers")
    hidden = _require_int(data, "hidden_size")
    heads = _require_int(data, "num_attention_heads")
    kv_heads = int(_get(data, "num_key_value_heads", default=heads))
    head_dim = int(_get(data, "head_dim", default=hidden // heads))
    v_head_dim = int(_get(data, "v_head_dim", default=head_dim))

    # The hub spelling counts previous tokens only; transformers counts the query too.
    if data.get("sliding_window_size") is not None:
        sliding_window = int(data["sliding_window_size"]) + 1
    else:
        sliding_window = int(_get(data, "sliding_window", default=0)) or None

    explicit_sinks = "add_swa_attention_sink_bias" in data or "add_full_attention_sink_bias" in data
    full_sinks = bool(data.get("add_full_attention_sink_bias", False))
    swa_sinks = bool(data.get("add_swa_attention_sink_bias", False)) if explicit_sinks else True

    layer_types = _parse_layer_types(data, n)
    num_mtp_layers = int(_get(data, "num_nextn_predict_layers", "num_mtp_layers", default=0))
    rope = _rope_by_type(data, _used_layer_types(layer_types, num_mtp_layers))
    full_theta, full_factor = rope["full"]
    swa_theta, swa_factor = rope["sliding"]
    swa_head_dim = int(_get(data, "swa_head_dim", default=head_dim))
    full = AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        rope_theta=full_theta,
        partial_rotary_factor=full_factor,
        sliding_window=None,
        has_sinks=full_sinks,
    )
    sliding = AttentionSpec(
        num_heads=int(_get(data, "swa_num_attention_heads", default=heads)),
        # transformers doubles the KV heads of SWA layers; the hub says it outright.
        num_kv_heads=int(_get(data, "swa_num_key_value_heads", default=2 * kv_heads)),
        head_dim=swa_head_dim,
        v_head_dim=int(_get(data, "swa_v_head_dim", default=v_head_dim)),
        rope_theta=swa_theta,
        partial_rotary_factor=swa_factor,
        sliding_window=sliding_window,
        has_sinks=swa_sinks,
    )

    if "attention_value_scale" in data:
        # null means "no scale" (the hub's spelling); 0.0 is a scale like any other.
        value_scale = 1.0 if data["attention_value_scale"] is None else float(data["attention_value_scale"])
    else:
        value_scale = TRANSFORMERS_DEFAULT_VALUE_SCALE if model_type == TRANSFORMERS_MODEL_TYPE else 1.0

    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    experts = int(_get(data, "n_routed_experts", "num_local_experts", default=0))
    return ModelConfig(
        vocab_size=_require_int(data, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require_int(data, "intermediate_size"),
        num_hidden_layers=n,
        layer_types=layer_types,
        mlp_layer_types=_parse_mlp_types(data, n),
        full_attention=full,
        sliding_attention=sliding,
        moe_intermediate_size=int(_get(data, "moe_intermediate_size", default=0)),
        n_routed_experts=experts,
        num_experts_per_tok=int(_get(data, "num_experts_per_tok", default=1)),
        n_group=int(_get(data, "n_group", default=1)),
        topk_group=int(_get(data, "topk_group", default=1)),
        norm_topk_prob=bool(_get(data, "norm_topk_prob", default=True)),
        routed_scaling_factor=float(_get(data, "routed_scaling_factor", default=1.0)),
        rms_norm_eps=float(_get(data, "rms_norm_eps", "layernorm_epsilon", default=1e-5)),
        attention_value_scale=value_scale,
        attention_bias=bool(_get(data, "attention_bias", default=False)),
        tie_word_embeddings=bool(_get(data, "tie_word_embeddings", default=False)),
        max_position_embeddings=int(_get(data, "max_position_embeddings", default=131072)),
        num_mtp_layers=num_mtp_layers,
        bos_token_id=data.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=data.get("pad_token_id"),
    )
