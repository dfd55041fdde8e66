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

from llm_core.config import ModelConfig
from llm_core.layers import RMSNorm, RoutedExperts, TopKRouter
from llm_core.model import MiMoV2ForCausalLM
from llm_core.weights import save_model

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
    out_dir: str | Path, config: ModelConfig, seed: int = 0, special_tokens: Sequence[str] = SPECIAL_TOKENS
) -> Path:
    out = Path(out_dir)
    model = random_model(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    if config.vocab_size >= 256 + len(special_tokens):
        train_byte_level_tokenizer(config.vocab_size, seed, special_tokens).save(str(out / "tokenizer.json"))
    return out
