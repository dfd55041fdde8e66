"""Write a random-weight checkpoint in Hugging Face layout (config.json,
safetensors, tokenizer.json), for tests and for `make serve` before a trained
model exists."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import Fp8Scheme, never_quantized, quantize_blockwise, read_block
from llm_core.model.fp8_linear import published_fp8_scheme
from llm_core.model.layers import RMSNorm, RoutedExperts, TopKRouter
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.loading.weights import FLOAT32_SUFFIXES, save_model, save_tensors

# Random checkpoints are for small shapes; the big presets are for capacity math.
MAX_RANDOM_PARAMS = 500_000_000
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
_WORDS = (
    "the a of to and in is it that for on with as was at by be this from or have not are "
    "but what all were when we there can your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way "
    "find use may water long little very after words called just where most know window "
    "attention model token cache video image audio sound shape circle square red blue green"
).split()


def random_model(config: ModelConfig, seed: int = 0) -> MiMoV2ForCausalLM:
    """Our model with seeded random weights scaled to give peaky, varied logits."""
    if config.num_parameters() > MAX_RANDOM_PARAMS:
        raise ValueError(
            f"a random checkpoint of {config.num_parameters():,} parameters is too large to write "
            f"(limit {MAX_RANDOM_PARAMS:,}); big presets are shapes for capacity math"
        )
    generator = torch.Generator().manual_seed(seed)
    model = MiMoV2ForCausalLM(config)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, nn.Linear):
            _normal(module.weight, 1.0 / math.sqrt(module.in_features), generator)
            if module.bias is not None:
                _normal(module.bias, 0.02, generator)
        elif isinstance(module, nn.Embedding):
            _normal(module.weight, 1.0, generator)
        elif isinstance(module, TopKRouter):
            _normal(module.weight, 1.0 / math.sqrt(config.hidden_size), generator)
            _normal(module.e_score_correction_bias, 0.1, generator)
        elif isinstance(module, RoutedExperts):
            _normal(module.gate_up_proj, 1.0 / math.sqrt(config.hidden_size), generator)
            _normal(module.down_proj, 1.0 / math.sqrt(config.moe_intermediate_size), generator)
    for name, param in model.named_parameters():
        if name.endswith("self_attn.sinks"):
            _normal(param, 1.0, generator)
    # A sharper head turns random hidden states into confident, varied tokens.
    model.lm_head.weight.data.mul_(4.0)
    return model.eval()


def _normal(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def train_byte_level_tokenizer(
    vocab_size: int, seed: int = 0, special_tokens: Sequence[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """A byte-level BPE tokenizer filling exactly ``vocab_size`` ids; the special
    tokens take the first ids."""
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(4000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_random_checkpoint(
    out_dir: str | Path, config: ModelConfig, seed: int = 0, special_tokens: Sequence[str] = SPECIAL_TOKENS,
    fp8_block: tuple[int, int] | None = None, fused_qkv: bool = False,
) -> Path:
    """Random weights in Hugging Face layout. ``fp8_block``: as the published
    MiMo-V2 checkpoints are (``hub_fp8_tensors``), quantized in blocks of that
    size; ``fused_qkv``: with MiMo-V2.5's fused ``qkv_proj``."""
    out = Path(out_dir)
    model = random_model(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_dict()
    if fp8_block is None:
        if fused_qkv:
            raise ValueError("a fused qkv_proj is written with FP8 weights (fp8_block) only, as MiMo-V2.5 ships it")
        save_model(model, out)
    else:
        read_block(list(fp8_block))
        tensors, scheme = hub_fp8_tensors(model, fp8_block, fused_qkv)
        save_tensors(tensors, out)
        hf_config |= {"quantization_config": scheme.to_hf_dict(), "torch_dtype": "bfloat16"}
        if fused_qkv:
            hf_config["attention_projection_layout"] = "fused_qkv"
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    if config.vocab_size >= 256 + len(special_tokens):
        train_byte_level_tokenizer(config.vocab_size, seed, special_tokens).save(str(out / "tokenizer.json"))
    return out


def hub_fp8_tensors(model: MiMoV2ForCausalLM, block: tuple[int, int], fused_qkv: bool = False
                    ) -> tuple[dict[str, torch.Tensor], Fp8Scheme]:
    """The model's tensors as Xiaomi publishes MiMo-V2 checkpoints: each large
    matrix float8_e4m3fn with a float32 ``weight_scale_inv`` per ``block``
    tile; experts one per expert (``mlp.experts.E.{gate,up,down}_proj``);
    ``self_attn.o_proj`` kept BF16 and listed in ``ignored_layers``; the router
    and its correction bias float32; sinks as ``attention_sink_bias``;
    everything else BF16. ``fused_qkv``: q, k and v as one ``qkv_proj`` in
    ``num_key_value_heads`` chunks ``[q_c | k_c | v_c]``, each quantized on its
    own (MiMo-V2.5's layout)."""
    config = model.config
    chunks = config.full_attention.num_kv_heads
    scheme = published_fp8_scheme(config, block)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        module = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and tensor.dim() == 2 and not never_quantized(name)
        if quantized and not scheme.lists_unconverted(module):
            out[name], out[f"{module}.weight_scale_inv"] = quantize_blockwise(tensor, block)
            return
        out[name] = tensor.to(torch.float32 if name.endswith(FLOAT32_SUFFIXES) else torch.bfloat16)

    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                put(f"{prefix}{e}.gate_proj.weight", tensor[e, :half])
                put(f"{prefix}{e}.up_proj.weight", tensor[e, half:])
                put(f"{prefix}{e}.down_proj.weight", state[f"{prefix}down_proj"][e])
        elif name.endswith("mlp.experts.down_proj"):
            continue
        elif name.endswith("self_attn.sinks"):
            put(name.removesuffix("sinks") + "attention_sink_bias", tensor)
        elif fused_qkv and name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue
        elif fused_qkv and name.endswith("self_attn.q_proj.weight"):
            attention = name.removesuffix(".q_proj.weight")
            parts = [p.chunk(chunks) for p in (tensor, state[f"{attention}.k_proj.weight"],
                                                state[f"{attention}.v_proj.weight"])]
            quantized = [quantize_blockwise(torch.cat([part[c] for part in parts]), block) for c in range(chunks)]
            out[f"{attention}.qkv_proj.weight"] = torch.cat([q for q, _ in quantized])
            out[f"{attention}.qkv_proj.weight_scale_inv"] = torch.cat([s for _, s in quantized])
        else:
            put(name, tensor)
    return out, scheme
