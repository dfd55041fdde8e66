"""``swallow train-demo``: train the demo model end to end on the synthetic world.

Everything trains together from random weights: the Qwen2.5-VL-style vision
tower, the Whisper-style audio tower, their projectors, and this project's
MiMo-V2 LLM (hybrid full/sliding attention with a 32-token window, sinks, MoE,
one MTP layer trained on the next-next token). Inputs go through exactly the
preprocessing the server uses (``media.preprocess_*``, ``media.audio_features``)
and the model's chat template, so the trained checkpoint answers through the
normal serving path.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import nn
from tqdm import tqdm

from api.demo.world import COLORS, DIRECTIONS, SHAPES, TASKS, Sample, make_sample
from encoders.audio import AudioEncoder, AudioInput
from encoders.multimodal_checkpoint import add_encoders, init_encoder_weights
from encoders.presets import DEMO_AUDIO, DEMO_PREPROCESS, DEMO_PREPROCESSOR_CONFIG, DEMO_VISION
from encoders.vision import VisionEncoder, VisionInput
from llm_core.attention import softmax_with_sinks
from llm_core.chat import (
    DEFAULT_CHAT_TEMPLATE,
    MEDIA_PLACEHOLDERS,
    MULTIMODAL_SPECIAL_TOKENS,
    ChatTemplate,
    expand_placeholders,
)
from llm_core.checkpoint import SPECIAL_TOKENS, random_model
from llm_core.config import AttentionSpec, ModelConfig
from llm_core.model import MiMoV2ForCausalLM
from llm_core.tokenizer import Tokenizer
from llm_core.weights import save_model
from media import audio_features, preprocess_images, preprocess_video

__all__ = ["DemoModel", "TrainConfig", "demo_llm_config", "train_demo"]

HOP = 160


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch_size: int = 32
    max_steps: int = 3200
    max_minutes: float = 38.0
    lr: float = 1e-3
    warmup_steps: int = 60
    weight_decay: float = 0.01
    mtp_loss_weight: float = 0.3
    # Stop early once every task's answers (teacher-forced, fresh samples) are this accurate.
    target_accuracy: float = 0.995
    accuracy_window: int = 400  # samples per task the running accuracy covers
    log_every: int = 10


# ---------------------------------------------------------------------------------------
# Tokenizer and model shapes
# ---------------------------------------------------------------------------------------


def _corpus(seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = [f"{s.question} {s.answer}" for s in (make_sample(rng, TASKS[i % len(TASKS)]) for i in range(1800))]
    texts += [" ".join((*COLORS, *SHAPES, *DIRECTIONS, "high", "low", "1", "2", "3", "4", "5"))]
    texts += ["user\n", "assistant\n", "system\n"] * 50
    return texts


def build_tokenizer(seed: int) -> HFTokenizer:
    """Byte-level BPE over the demo language: its words become single tokens."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        special_tokens=[*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    return tokenizer


def demo_llm_config(vocab_size: int, eos_id: int) -> ModelConfig:
    """MiMo-V2-Flash's layout in miniature: full and sliding (W=32, sinks) layers,
    a dense first MLP then MoE, one MTP layer."""
    full = AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=64, v_head_dim=64, rope_theta=5_000_000.0,
                         partial_rotary_factor=0.5, sliding_window=None, has_sinks=False)
    sliding = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, rope_theta=10_000.0,
                            partial_rotary_factor=0.5, sliding_window=33, has_sinks=True)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=DEMO_VISION.out_hidden_size,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=("full", "sliding", "sliding", "full"),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        full_attention=full,
        sliding_attention=sliding,
        moe_intermediate_size=192,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        num_mtp_layers=1,
        eos_token_ids=(eos_id,),
        pad_token_id=0,
    )


# ---------------------------------------------------------------------------------------
# Examples: chat-formatted token ids + encoder inputs, exactly as served
# ---------------------------------------------------------------------------------------


@dataclass
class Example:
    task: str
    ids: list[int]  # prompt + answer + <|im_end|>, placeholders expanded
    answer_start: int  # first answer position
    media: list[tuple[str, VisionInput | AudioInput, int]]  # (encoder kind, input, first position)


def chat_messages(sample: Sample, media_first: bool) -> list[dict]:
    """The user turn the server builds: media parts (a video's sound track right after
    it) and the question, in either order."""
    parts: list[dict] = [{"type": kind} for kind in sample.media]
    text = {"type": "text", "text": sample.question}
    return [{"role": "user", "content": [*parts, text] if media_first else [text, *parts]}]


def encoder_inputs(sample: Sample) -> list[tuple[str, VisionInput | AudioInput]]:
    out: list[tuple[str, VisionInput | AudioInput]] = []
    for kind in sample.media:
        if kind == "image":
            batch = preprocess_images([torch.from_numpy(sample.image).permute(2, 0, 1).contiguous()], DEMO_PREPROCESS)
        elif kind == "video":
            batch = preprocess_video(torch.from_numpy(sample.frames), DEMO_PREPROCESS)
        else:
            wave = torch.from_numpy(sample.audio)
            features = audio_features(wave, n_mels=DEMO_AUDIO.num_mel_bins)
            frames = min(math.ceil(wave.numel() / HOP), features.shape[0] * features.shape[-1])
            out.append(("audio", AudioInput(features, frames)))
            continue
        out.append(("vision", VisionInput(batch.pixel_values, tuple(int(x) for x in batch.grid_thw[0].tolist()))))
    return out


class DemoModel(nn.Module):
    """The three trained parts, and the training-time forward over a packed batch."""

    def __init__(self, llm: MiMoV2ForCausalLM, vision: VisionEncoder, audio: AudioEncoder) -> None:
        super().__init__()
        self.llm, self.vision, self.audio = llm, vision, audio

    def media_rows(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder outputs of every media item, and the flat positions they go to."""
        rows: list[torch.Tensor] = []
        positions: list[int] = []
        offset = 0
        per_kind: dict[str, list[tuple[VisionInput | AudioInput, int]]] = defaultdict(list)
        for ex in examples:
            for kind, item, start in ex.media:
                per_kind[kind].append((item, offset + start))
            offset += len(ex.ids)
        for kind, entries in per_kind.items():
            encoder = self.vision if kind == "vision" else self.audio
            outputs = encoder.forward_items([item for item, _ in entries])
            for (_, start), out in zip(entries, outputs):
                rows.append(out)
                positions.extend(range(start, start + out.shape[0]))
        return torch.cat(rows), torch.tensor(positions, dtype=torch.long)

    def forward(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(final hidden states, input embeddings, flat token ids) of the packed batch."""
        ids = torch.tensor([t for ex in examples for t in ex.ids], dtype=torch.long)
        lengths = [len(ex.ids) for ex in examples]
        positions = torch.cat([torch.arange(n) for n in lengths])
        embeds = self.llm.model.embed_tokens(ids)
        rows, where = self.media_rows(examples)
        embeds = embeds.index_copy(0, where, rows.to(embeds.dtype))
        backend = PackedCausalAttention(lengths)
        hidden = self.llm.model(ids, positions, backend, inputs_embeds=embeds)
        return hidden, embeds, ids

    def mtp_hidden(self, hidden: torch.Tensor, embeds: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """MTP layer output at every position t, fed hidden[t] and the embedding of t+1."""
        positions = torch.cat([torch.arange(n) for n in lengths])
        nxt = torch.cat([torch.cat((e[1:], torch.zeros_like(e[:1]))) for e in embeds.split(list(lengths))])
        layer = self.llm.model.mtp.layers[0]
        return layer(nxt, hidden, positions, PackedCausalAttention(lengths))


class PackedCausalAttention:
    """Attention backend for training: each packed sequence attends causally (and
    within the window on sliding layers) to itself; nothing is cached.

    Tiny per-sequence kernels would dominate step time, so sequences of similar
    length are padded into a few [B, L] groups, a few batched matmuls each.
    """

    def __init__(self, lengths: Sequence[int], group_size: int = 8) -> None:
        self.lengths = list(lengths)
        by_length = sorted(range(len(self.lengths)), key=self.lengths.__getitem__)
        self.groups = [_PaddedGroup([self.lengths[i] for i in by_length[g : g + group_size]])
                       for g in range(0, len(by_length), group_size)]
        # Rows of the packed input in group order, and the inverse permutation.
        starts = np.cumsum([0, *self.lengths[:-1]])
        order = torch.cat([torch.arange(starts[i], starts[i] + self.lengths[i]) for i in by_length])
        self.order, self.restore = order, torch.argsort(order)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor:
        sizes = [g.total for g in self.groups]
        parts = zip(q[self.order].split(sizes), k[self.order].split(sizes), v[self.order].split(sizes), self.groups)
        out = torch.cat([g.attend(qg, kg, vg, spec.sliding_window, sinks) for qg, kg, vg, g in parts])
        return out[self.restore]


class _PaddedGroup:
    """Sequences padded to one [B, L] batch. A padding query sees every key so its
    softmax stays finite; its output is dropped."""

    def __init__(self, lengths: Sequence[int]) -> None:
        width = max(lengths)
        steps = torch.arange(width)
        self.total = sum(lengths)
        self.valid = steps[None, :] < torch.tensor(lengths)[:, None]  # [B, L]
        self.offsets = steps[:, None] - steps[None, :]  # q_pos - k_pos, [L, L]
        self._masks: dict[int | None, torch.Tensor] = {}

    def visible(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L, L]: which keys each query sees."""
        if window not in self._masks:
            seen = self.offsets >= 0
            if window is not None:
                seen &= self.offsets < window
            seen = (seen[None] & self.valid[:, None, :]) | ~self.valid[:, :, None]
            self._masks[window] = seen[:, None, None]
        return self._masks[window]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[total, H, D] -> [B, L, H, D], zeros after each sequence."""
        return x.new_zeros(*self.valid.shape, *x.shape[1:]).masked_scatter(self.valid[..., None, None], x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
        hq, d = q.shape[1:]
        hkv = k.shape[1]
        group = hq // hkv
        batch, width = self.valid.shape
        qg = self.pad(q).view(batch, width, hkv, group, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, L, D]
        kh = self.pad(k).permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
        vh = self.pad(v).permute(0, 2, 1, 3)[:, :, None]
        scores = torch.matmul(qg, kh.transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~self.visible(window), float("-inf"))
        sink_logits = None if sinks is None else sinks.view(1, hkv, group, 1, 1)
        out = torch.matmul(softmax_with_sinks(scores, sink_logits), vh)  # [B, Hkv, G, L, Dv]
        return out.permute(0, 3, 1, 2, 4).reshape(batch, width, hq, -1)[self.valid]


class ExampleBuilder:
    def __init__(self, tokenizer: Tokenizer, vision: VisionEncoder, audio: AudioEncoder) -> None:
        self.tokenizer = tokenizer
        self.template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
        self.placeholder_ids = {kind: tokenizer.token_to_id(tok) for kind, tok in MEDIA_PLACEHOLDERS.items()}
        self.end = tokenizer.token_to_id("<|im_end|>")
        self.vision, self.audio = vision, audio

    def build(self, sample: Sample, rng: np.random.Generator) -> Example:
        messages = chat_messages(sample, media_first=bool(rng.random() < 0.5))
        prompt = self.tokenizer.encode(self.template.render(messages))
        inputs = encoder_inputs(sample)
        rows = [self.vision.num_tokens(item) if kind == "vision" else self.audio.num_tokens(item)
                for kind, item in inputs]
        ids, offsets = expand_placeholders(prompt, list(zip(sample.media, rows)), self.placeholder_ids)
        media = [(kind, item, offset) for (kind, item), offset in zip(inputs, offsets)]
        answer_start = len(ids)
        ids += self.tokenizer.encode(sample.answer) + [self.end]
        return Example(sample.task, ids, answer_start, media)


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


def _init_encoder(module: nn.Module, seed: int) -> None:
    init_encoder_weights(module, torch.Generator().manual_seed(seed))


def _init_llm(config: ModelConfig, seed: int) -> MiMoV2ForCausalLM:
    model = random_model(config, seed)
    with torch.no_grad():
        model.lm_head.weight.div_(4.0)  # random_model sharpens the head for noise demos; train from calm logits
        model.model.embed_tokens.weight.mul_(0.1)
    return model.train()


@dataclass
class _Meter:
    window: int
    correct: dict[str, deque[bool]] = field(default_factory=dict)

    def add(self, task: str, ok: bool) -> None:
        self.correct.setdefault(task, deque(maxlen=self.window)).append(ok)

    def accuracy(self) -> dict[str, float]:
        return {t: sum(d) / len(d) for t, d in sorted(self.correct.items()) if d}

    def converged(self, target: float) -> bool:
        accs = self.accuracy()
        full = all(len(self.correct.get(t, ())) >= self.window for t in TASKS)
        return full and min(accs.values()) >= target


def _loss(model: DemoModel, examples: list[Example], cfg: TrainConfig, meter: _Meter) -> tuple[torch.Tensor, dict]:
    hidden, embeds, ids = model(examples)
    lengths = [len(ex.ids) for ex in examples]
    starts = np.cumsum([0, *lengths[:-1]])
    # Next-token targets on the answer (and its end token) only.
    pred_pos = torch.tensor([s + p - 1 for ex, s in zip(examples, starts) for p in range(ex.answer_start, len(ex.ids))])
    targets = ids[pred_pos + 1]
    logits = model.llm.compute_logits(hidden[pred_pos])
    # Each example weighs the same whatever its answer's length: a one-word answer's
    # word is the signal, not drowned by long templated descriptions.
    weights = torch.tensor([1.0 / (len(ex.ids) - ex.answer_start) for ex in examples
                            for _ in range(ex.answer_start, len(ex.ids))]) / len(examples)
    loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum()
    # Teacher-forced exact match per example, for the convergence meter.
    hits = (logits.argmax(-1) == targets).tolist()
    i = 0
    for ex in examples:
        n = len(ex.ids) - ex.answer_start
        meter.add(ex.task, all(hits[i : i + n]))
        i += n
    # MTP: from hidden[t] and token t+1, predict token t+2, for every answer token t+2.
    mtp_pos = torch.tensor([s + p - 2 for ex, s in zip(examples, starts)
                            for p in range(max(ex.answer_start, 2), len(ex.ids))])
    mtp_hidden = model.mtp_hidden(hidden, embeds, lengths)
    mtp_logits = model.llm.compute_logits(mtp_hidden[mtp_pos])
    mtp_loss = F.cross_entropy(mtp_logits, ids[mtp_pos + 2])
    return loss + cfg.mtp_loss_weight * mtp_loss, {"loss": loss.item(), "mtp": mtp_loss.item()}


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


_IMAGE_TASKS = ("image_color", "image_shape")
_VISION_TASKS = (*_IMAGE_TASKS, "video_direction", "video_color", "video_blink", "describe")


def task_pool(step: int, max_steps: int) -> tuple[str, ...]:
    """A curriculum: still images first (the vision path must learn to reach the
    LLM before it can carry motion), then videos, then everything."""
    if step < 0.1 * max_steps:
        return _IMAGE_TASKS
    if step < 0.25 * max_steps:
        return _VISION_TASKS
    return TASKS


# How often each task is drawn, relative to the others in the pool. The hard skills
# get more examples: a square from a circle in a 56 px picture (four merged tokens),
# and the shape word inside the long describe answer, where one token of ~20 carries
# it. Pictures are short sequences, so extra picture examples are cheap.
TASK_WEIGHTS: dict[str, float] = {
    "image_shape": 4.0,
    "describe": 2.0,
    "video_audio_beeps": 1.5,
    "audio_beeps": 1.25,
}


def _task_probabilities(pool: Sequence[str]) -> np.ndarray:
    weights = np.array([TASK_WEIGHTS.get(task, 1.0) for task in pool])
    return weights / weights.sum()


def _batches(builder: ExampleBuilder, cfg: TrainConfig) -> Iterator[list[Example]]:
    rng = np.random.default_rng(cfg.seed + 7)
    step = 0
    while True:
        pool = task_pool(step, cfg.max_steps)
        tasks = rng.choice(len(pool), size=cfg.batch_size, p=_task_probabilities(pool))
        samples = [make_sample(rng, pool[int(t)]) for t in tasks]
        yield [builder.build(s, rng) for s in samples]
        step += 1


def train_demo(out_dir: str | Path, cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict:
    """Train and write the checkpoint to ``out_dir``; returns a summary."""
    torch.manual_seed(cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_tokenizer = build_tokenizer(cfg.seed)
    hf_tokenizer.save(str(out / "tokenizer.json"))
    tokenizer = Tokenizer(out / "tokenizer.json")
    config = demo_llm_config(hf_tokenizer.get_vocab_size(), tokenizer.token_to_id("<|im_end|>"))
    vision, audio = VisionEncoder(DEMO_VISION), AudioEncoder(DEMO_AUDIO)
    _init_encoder(vision, cfg.seed + 1)
    _init_encoder(audio, cfg.seed + 2)
    model = DemoModel(_init_llm(config, cfg.seed), vision.train(), audio.train())
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98),
    )
    builder = ExampleBuilder(tokenizer, vision, audio)
    meter = _Meter(cfg.accuracy_window)
    started = time.monotonic()
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc="train-demo", unit="step")
    step, stats = 0, {}
    for step, examples in enumerate(_batches(builder, cfg)):
        if step >= cfg.max_steps or (time.monotonic() - started) / 60 > cfg.max_minutes:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg)
        loss, stats = _loss(model, examples, cfg, meter)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.update(1)
        if step % cfg.log_every == 0:
            accs = meter.accuracy()
            bar.set_postfix(loss=f"{stats['loss']:.3f}", mtp=f"{stats['mtp']:.3f}",
                            worst=f"{min(accs.values(), default=0):.2f}")
        if progress and step % (cfg.log_every * 10) == 0:
            minutes = (time.monotonic() - started) / 60
            bar.write(f"step {step} ({minutes:.1f} min) loss {stats['loss']:.4f} mtp {stats['mtp']:.4f} "
                      + " ".join(f"{t}={a:.2f}" for t, a in meter.accuracy().items()))
        if meter.converged(cfg.target_accuracy):
            break
    bar.close()
    model.eval()
    save_model(model.llm, out)
    import json

    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    add_encoders(out, vision, audio, DEMO_PREPROCESSOR_CONFIG)
    minutes = (time.monotonic() - started) / 60
    return {"steps": step, "minutes": round(minutes, 2), "train_accuracy": meter.accuracy(), **stats}
