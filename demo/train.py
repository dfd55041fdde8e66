"""``swallow train-demo``: train the demo model end to end on the synthetic world.

From scratch (the default), everything trains together from random weights: the
Qwen2.5-VL-style vision tower, the Whisper-style audio tower, their projectors, and
this project's MiMo-V2 LLM (hybrid full/sliding attention with a 32-token window,
sinks, MoE, three chained MTP layers, layer j trained on token t+j+2). Inputs go
through exactly the preprocessing the server uses (``media.preprocess_*``,
``media.audio_features``) and the demo's chat template (``demo.dialogue``), so
the trained checkpoint answers through the normal serving path.

``init`` fine-tunes a trained checkpoint instead: the full mix of tasks and ways of
asking (thinking, the tool listed, the tool's round trip) from the first step, the
encoders frozen, so new skills are learnt while the old ones keep being practised.

On cores shared with other work, run with ``OMP_WAIT_POLICY=PASSIVE`` in the
environment (it is read when torch loads): OpenMP workers that spin wait out a
whole scheduler slice for a descheduled peer at every op, which made fine-tuning
steps ~15x slower here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from torch import nn
from tqdm import tqdm

from demo.curriculum import TrainingClock, batches, learning_rate, mix_labels
from demo.dialogue import DEMO_CHAT_TEMPLATE
from demo.examples import Example, ExampleBuilder
from demo.model import DemoModel, demo_llm_config
from demo.train_config import TrainConfig
from demo.vocabulary import build_tokenizer, with_dialogue_vocabulary
from encoders.audio import AudioEncoder
from encoders.multimodal_checkpoint import (
    add_encoders,
    init_encoder_weights,
    load_encoders,
)
from encoders.presets import (
    DEMO_AUDIO,
    DEMO_PREPROCESSOR_CONFIG,
    DEMO_VISION,
)
from encoders.vision import VisionEncoder
from llm_core.loading.checkpoint import random_model
from llm_core.model.config import ModelConfig
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.model.tokenizer import Tokenizer
from llm_core.loading.weights import load_model, save_model

__all__ = ["train_demo"]


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

    def converged(self, target: float, labels: Sequence[str]) -> bool:
        """Every one of ``labels`` seen a whole window of times, and each accurate enough."""
        full = all(len(self.correct.get(t, ())) >= self.window for t in labels)
        return full and min(self.accuracy().values()) >= target


def _token_weights(ex: Example, weighed: int) -> list[float]:
    bounds = [*ex.part_starts, len(ex.ids)]
    weights: list[float] = []
    for start, end in itertools.pairwise(bounds):
        weights += [1.0 / max(1.0, (end - start) / weighed)] * (end - start)
    return weights


def _loss(model: DemoModel, examples: list[Example], cfg: TrainConfig, meter: _Meter) -> tuple[torch.Tensor, dict]:
    hidden, embeds, ids = model(examples)
    lengths = [len(ex.ids) for ex in examples]
    starts = np.cumsum([0, *lengths[:-1]])
    # Next-token targets on the answer (and its end token) only.
    pred_pos = torch.tensor([s + p - 1 for ex, s in zip(examples, starts) for p in range(ex.answer_start, len(ex.ids))])
    targets = ids[pred_pos + 1]
    logits = model.llm.compute_logits(hidden[pred_pos])
    # A one-word answer's word is the signal, not to be drowned by long templated
    # descriptions: an answer's tokens share a weight of 1, or of their count up to
    # cfg.answer_tokens_weighed. The templated tokens of a description are soon predicted
    # with ~zero loss, so its few telling words (colour, shape, direction) then carry
    # about as much weight each as a one-word answer.
    # A thinking answer's reasoning and its answer proper are weighed as two answers:
    # the one word that matters must not weigh less for a reasoning before it.
    weights = torch.tensor([w for ex in examples for w in _token_weights(ex, cfg.answer_tokens_weighed)])
    weights = weights / len(examples)
    loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum()
    # Teacher-forced exact match per example, for the convergence meter.
    hits = (logits.argmax(-1) == targets).tolist()
    i = 0
    for ex in examples:
        n = len(ex.ids) - ex.answer_start
        meter.add(ex.task, all(hits[i : i + n]))
        i += n
    # MTP depth j: from its input at t (chained from hidden[t]) and token t+j+1, predict
    # token t+j+2, for every answer token t+j+2. The depths' mean weighs mtp_loss_weight.
    # The chain runs over the cfg.mtp_examples examples with the longest answers (the
    # descriptions, where drafts pay, then the batch's first others): a third of the
    # MTP compute, which otherwise costs a third of the step.
    stats = {"loss": loss.item()}
    chosen = sorted(sorted(range(len(examples)), key=lambda i: -(len(examples[i].ids) - examples[i].answer_start))
                    [: cfg.mtp_examples])
    rows = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in chosen])
    sub = [examples[i] for i in chosen]
    sub_lengths = [lengths[i] for i in chosen]
    sub_starts = np.cumsum([0, *sub_lengths[:-1]])
    sub_ids = ids[rows]
    mtp_losses = []
    for j, mtp_hidden in enumerate(model.mtp_hidden(hidden[rows], embeds[rows], sub_lengths)):
        ahead = j + 2
        mtp_pos = torch.tensor([s + p - ahead for ex, s in zip(sub, sub_starts)
                                for p in range(max(ex.answer_start, ahead), len(ex.ids))])
        mtp_logits = model.llm.compute_logits(mtp_hidden[mtp_pos])
        mtp_losses.append(F.cross_entropy(mtp_logits, sub_ids[mtp_pos + ahead]))
        stats[f"mtp{j}"] = mtp_losses[-1].item()
    mtp_loss = torch.stack(mtp_losses).mean()
    stats["mtp"] = mtp_loss.item()
    return loss + cfg.mtp_loss_weight * mtp_loss, stats


@dataclass(frozen=True)
class _Start:
    """What training starts from: the tokenizer, and the model with its LLM config."""

    tokenizer: HFTokenizer
    config: ModelConfig
    model: DemoModel


def _from_scratch(cfg: TrainConfig) -> _Start:
    hf_tokenizer = build_tokenizer(cfg.seed)
    config = demo_llm_config(hf_tokenizer.get_vocab_size(), hf_tokenizer.token_to_id("<|im_end|>"))
    vision, audio = VisionEncoder(DEMO_VISION), AudioEncoder(DEMO_AUDIO)
    _init_encoder(vision, cfg.seed + 1)
    _init_encoder(audio, cfg.seed + 2)
    return _Start(hf_tokenizer, config, DemoModel(_init_llm(config, cfg.seed), vision.train(), audio.train()))


def _from_checkpoint(init: Path, cfg: TrainConfig) -> _Start:
    """A trained demo checkpoint, its tokenizer grown for the dialogue skills (and the
    LLM given rows for the new tokens) if it was trained before them."""
    old_tokenizer = HFTokenizer.from_file(str(init / "tokenizer.json"))
    hf_tokenizer = with_dialogue_vocabulary(HFTokenizer.from_str(old_tokenizer.to_str()), cfg.seed)
    llm = _grow_vocab(load_model(init), _token_sources(old_tokenizer, hf_tokenizer), cfg.seed)
    encoders = load_encoders(init)
    vision, audio = encoders["vision"], encoders["audio"]
    assert isinstance(vision, VisionEncoder) and isinstance(audio, AudioEncoder)
    for encoder in (vision, audio):
        encoder.requires_grad_(not cfg.freeze_encoders).train(not cfg.freeze_encoders)
    return _Start(hf_tokenizer, llm.config, DemoModel(llm.train(), vision, audio))


def _token_sources(old: HFTokenizer, new: HFTokenizer) -> list[list[int]]:
    """For each token ``new`` has past ``old``'s vocabulary, the old tokens its text
    was made of."""
    start = old.get_vocab_size()
    return [old.encode(new.decode([i], skip_special_tokens=False)).ids for i in range(start, new.get_vocab_size())]


def _grow_vocab(llm: MiMoV2ForCausalLM, sources: Sequence[Sequence[int]], seed: int) -> MiMoV2ForCausalLM:
    """A trainable copy of ``llm`` with a row for each new token (``sources``: the old
    tokens it is made of). A new token's embedding and output rows start at the mean
    of its pieces' -- "Ġframe" means what "Ġf r a m e" meant -- plus a little noise,
    so no two new tokens start alike."""
    if not sources:  # already grown: fine-tuned before
        return llm.requires_grad_(True)
    old = llm.config.vocab_size
    config = dataclasses.replace(llm.config, vocab_size=old + len(sources))
    state = llm.state_dict()
    generator = torch.Generator().manual_seed(seed + 3)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = state[name]
        means = torch.stack([rows[list(pieces)].mean(0) if pieces else rows.mean(0) for pieces in sources])
        noise = torch.randn(means.shape, generator=generator) * rows.std(0) * 0.1
        state[name] = torch.cat((rows, means + noise))
    grown = MiMoV2ForCausalLM(config)
    grown.load_state_dict(state)
    return grown.requires_grad_(True)


def train_demo(out_dir: str | Path, cfg: TrainConfig = TrainConfig(), progress: bool = True,
               init: str | Path | None = None) -> dict:
    """Train and write the checkpoint to ``out_dir``; returns a summary. ``init``: a
    trained demo checkpoint to fine-tune (see ``finetune_config``) on the full mix;
    without it, everything trains from random weights along the curriculum."""
    torch.manual_seed(cfg.seed)
    # Everything is read before anything is written: ``out_dir`` may be ``init``.
    start = _from_scratch(cfg) if init is None else _from_checkpoint(Path(init), cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start.tokenizer.save(str(out / "tokenizer.json"))
    tokenizer = Tokenizer(out / "tokenizer.json")
    model, config = start.model, start.config
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98),
    )
    builder = ExampleBuilder(tokenizer, model.vision, model.audio)
    meter = _Meter(cfg.accuracy_window)
    clock = TrainingClock(cfg)
    labels = mix_labels()
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc="train-demo", unit="step")
    step, stats = 0, {}
    for step, examples in enumerate(batches(builder, cfg, clock, curriculum=init is None)):
        if step >= cfg.max_steps or clock.minutes() > cfg.max_minutes:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg, clock)
        loss, stats = _loss(model, examples, cfg, meter)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        bar.update(1)
        if step % cfg.log_every == 0:
            accs = meter.accuracy()
            bar.set_postfix(loss=f"{stats['loss']:.3f}", mtp=f"{stats['mtp']:.3f}",
                            worst=f"{min(accs.values(), default=0):.2f}")
        if progress and step % (cfg.log_every * 10) == 0:
            minutes = clock.minutes()
            depths = " ".join(f"{stats[f'mtp{j}']:.4f}" for j in range(config.num_mtp_layers))
            bar.write(f"step {step} ({minutes:.1f} min) loss {stats['loss']:.4f} mtp {depths} "
                      + " ".join(f"{t}={a:.2f}" for t, a in meter.accuracy().items()))
        if meter.converged(cfg.target_accuracy, labels):
            break
    bar.close()
    model.eval()
    save_model(model.llm, out)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    add_encoders(out, model.vision, model.audio, DEMO_PREPROCESSOR_CONFIG, chat_template=DEMO_CHAT_TEMPLATE)
    minutes = clock.minutes()
    return {"steps": step, "minutes": round(minutes, 2), "init": None if init is None else str(init),
            "train_accuracy": meter.accuracy(), **stats}
