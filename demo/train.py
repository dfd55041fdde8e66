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
import math
import re
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from torch import nn
from tqdm import tqdm

from demo.dialogue import (
    ADDED_TOKENS,
    DEMO_CHAT_TEMPLATE,
    THINK_CLOSE,
    Conversation,
    Mode,
    conversation,
)
from demo.world import (
    COLORS,
    DIRECTIONS,
    SHAPES,
    TASKS,
    Sample,
    make_sample,
    make_scene,
)
from encoders.audio import AudioEncoder, AudioInput
from encoders.multimodal_checkpoint import (
    add_encoders,
    init_encoder_weights,
    load_encoders,
)
from encoders.presets import (
    DEMO_AUDIO,
    DEMO_PREPROCESS,
    DEMO_PREPROCESSOR_CONFIG,
    DEMO_VISION,
)
from encoders.vision import VisionEncoder, VisionInput
from llm_core.chat import (
    MEDIA_PLACEHOLDERS,
    MULTIMODAL_SPECIAL_TOKENS,
    ChatTemplate,
    expand_placeholders,
)
from llm_core.checkpoint import SPECIAL_TOKENS, random_model
from llm_core.config import AttentionSpec, ModelConfig
from llm_core.model import MiMoV2ForCausalLM
from llm_core.tokenizer import Tokenizer
from llm_core.weights import load_model, save_model
from media import audio_features, preprocess_images, preprocess_video

__all__ = ["DEMO_CHAT_TEMPLATE", "DemoModel", "TrainConfig", "demo_llm_config", "finetune_config", "train_demo"]

HOP = 160


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch_size: int = 32
    max_steps: int = 3600
    max_minutes: float = 38.0
    lr: float = 1e-3
    warmup_steps: int = 60
    weight_decay: float = 0.01
    mtp_loss_weight: float = 0.3
    mtp_examples: int = 12  # examples per batch the MTP chain is trained on (longest answers first)
    # A part of an answer this long or shorter weighs one per token; a longer part
    # weighs this much in all (see _token_weights).
    answer_tokens_weighed: int = 5
    # Stop early once every task's answers (teacher-forced, fresh samples) are this accurate.
    target_accuracy: float = 0.995
    accuracy_window: int = 400  # samples per task the running accuracy covers
    log_every: int = 10
    # Once every task is drawn (the last phase; all along when fine-tuning): the share
    # of the other tasks' examples asked in thinking mode, and with the tool listed.
    thinking_share: float = 0.3
    tools_share: float = 0.15
    # On top of the full mix, this share of examples are tool round trips (half of
    # them in thinking mode): reading a number back from the tool's result is the
    # skill the mix gives the fewest examples of (a second fine-tune sets it).
    round_trip_share: float = 0.0
    # Fine-tuning keeps what the encoders learnt: the new skills are the LLM's only
    # (the tool questions are about the file, reasoning is text), and frozen towers
    # skip their backward pass, over half a step's time.
    freeze_encoders: bool = False


def finetune_config(**overrides: object) -> TrainConfig:
    """The settings of ``train-demo --init``: from a trained checkpoint, a gentler
    learning rate, frozen encoders, and a budget of minutes rather than hours."""
    # Half batches, twice the steps: the new skills are mostly fixed texts, learnt per
    # step. Their telling tokens (the property asked for, the digits of a result) sit
    # in 10-30-token answers, so each answer token weighs one, as a one-word answer
    # does: by now the templated tokens cost next to nothing. Drafts matter less than
    # answers: the MTP chain runs on fewer examples.
    base = {"batch_size": 16, "max_steps": 1500, "max_minutes": 18.0, "lr": 5e-4, "warmup_steps": 50,
            "freeze_encoders": True, "target_accuracy": 1.0, "answer_tokens_weighed": 32, "mtp_examples": 6}
    return TrainConfig(**{**base, **overrides})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Tokenizer and model shapes
# ---------------------------------------------------------------------------------------


_EARLIER_TASKS = tuple(t for t in TASKS if t != "video_info")  # the language the BPE was first trained on
DIALOGUE_MERGES = 100  # BPE merges for the words of tools and reasoning (each a row in embed and head)


def _corpus(seed: int) -> list[str]:
    """The questions and answers of the tasks without the tool, and the role names."""
    rng = np.random.default_rng(seed)
    # Only the words matter: scenes are drawn (as samples would be) but never rendered.
    tasks = _EARLIER_TASKS
    texts = [f"{q} {a}" for _, q, a in (make_scene(rng, tasks[i % len(tasks)]) for i in range(1800))]
    texts += [" ".join((*COLORS, *SHAPES, *DIRECTIONS, "high", "low", "1", "2", "3", "4", "5"))]
    texts += ["user\n", "assistant\n", "system\n"] * 50
    return texts


def _dialogue_texts(seed: int) -> list[str]:
    """Prompts and answers of every task in every way of asking, media left out: the
    words the tool block, calls, results, replies and reasonings are made of."""
    rng = np.random.default_rng(seed + 11)
    template = ChatTemplate(DEMO_CHAT_TEMPLATE)
    texts: list[str] = []
    for i in range(200):
        task = TASKS[i % len(TASKS)]
        scene, question, answer = make_scene(rng, task)
        sample = Sample(task, question, answer, scene.media, None, None, None, scene)
        modes = [*TOOL_EXCHANGES] if task == "video_info" else [Mode(tools=True)]
        for mode in modes:
            for thinking in (False, True):
                conv = conversation(sample, Mode(mode.tools, thinking, mode.tool_result))
                user = {"role": "user", "content": question}
                # What the model writes weighs more than the prompt: the fewer tokens an
                # answer has, the fewer it must get exactly right.
                texts += [template.render([user, *conv.follow_up], **conv.variables), *[conv.output] * 8]
    return texts


def build_tokenizer(seed: int) -> HFTokenizer:
    """Byte-level BPE over the demo language (its words become single tokens), grown
    for tools and thinking as a checkpoint from before them is when fine-tuned."""
    return with_dialogue_vocabulary(base_tokenizer(seed), seed)


def base_tokenizer(seed: int) -> HFTokenizer:
    """Byte-level BPE over the earlier tasks' language: its words become single tokens."""
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


def with_dialogue_vocabulary(tokenizer: HFTokenizer, seed: int = 0) -> HFTokenizer:
    """The tokenizer grown for tools and thinking, unless it already is: BPE merges
    for their words, then the markers as single tokens. The new ids come after the
    old ones and no merge applies to the earlier tasks' words, so their texts keep
    their token ids (and a checkpoint trained on them its embedding rows)."""
    if all(tokenizer.token_to_id(t) is not None for t in ADDED_TOKENS):
        return tokenizer
    grown = extend_merges(tokenizer, _dialogue_texts(seed), keep=_corpus(seed), max_new=DIALOGUE_MERGES)
    vocab = grown.get_vocab(with_added_tokens=True)
    grown.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS if t not in vocab])
    return grown


def _word_counts(tokenizer: HFTokenizer, texts: Sequence[str]) -> Counter[str]:
    """Pre-tokenized words (byte-level form) of ``texts``, special and marker tokens cut out."""
    markers = [*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS, *ADDED_TOKENS]
    split = re.compile("|".join(re.escape(m) for m in markers))
    counts: Counter[str] = Counter()
    for text in texts:
        for chunk in split.split(text):
            counts.update(word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(chunk))
    return counts


def extend_merges(tokenizer: HFTokenizer, texts: Sequence[str], keep: Sequence[str], max_new: int) -> HFTokenizer:
    """A copy of ``tokenizer`` with up to ``max_new`` BPE merges appended, learnt as
    BPE learns them (the most frequent adjacent pair of ``texts``' tokens first).

    Appended merges apply only after every earlier one, to the tokens those leave;
    a pair found next to each other in a word of ``keep`` is never merged, so the
    texts of ``keep`` keep their tokens. Nor is a pair with a digit: numbers stay a
    token per digit, which the model copies from a tool result to its answer."""
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    counts = _word_counts(tokenizer, texts)
    words = {w: [t.value for t in tokenizer.model.tokenize(w)] for w in counts}
    kept = {w: [t.value for t in tokenizer.model.tokenize(w)] for w in _word_counts(tokenizer, keep)}
    forbidden = {pair for tokens in kept.values() for pair in itertools.pairwise(tokens)}
    next_id = max(*vocab.values(), *(t["id"] for t in data["added_tokens"])) + 1
    for _ in range(max_new):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, tokens in words.items():
            for pair in itertools.pairwise(tokens):
                if pair not in forbidden and not any(c.isdigit() for c in "".join(pair)):
                    pairs[pair] += counts[word]
        if not pairs:
            break
        # The most frequent pair; ties in a fixed order, so the vocabulary is a function of the texts.
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append([a, b])
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
        words = {w: _merge(tokens, a, b) for w, tokens in words.items()}
    return HFTokenizer.from_str(json.dumps(data))


def _merge(tokens: list[str], a: str, b: str) -> list[str]:
    out: list[str] = []
    for token in tokens:
        if out and out[-1] == a and token == b:
            out[-1] = a + b
        else:
            out.append(token)
    return out


def demo_llm_config(vocab_size: int, eos_id: int) -> ModelConfig:
    """MiMo-V2-Flash's layout in miniature: full and sliding (W=32, sinks) layers,
    a dense first MLP then MoE, three MTP layers (MiMo-V2-Flash's count). The dense
    MLPs (the first layer's and each MTP layer's) are 256 wide, which keeps the
    float32 checkpoint under 20 MiB with three MTP layers."""
    full = AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=64, v_head_dim=64, rope_theta=5_000_000.0,
                         partial_rotary_factor=0.5, sliding_window=None, has_sinks=False)
    sliding = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, rope_theta=10_000.0,
                            partial_rotary_factor=0.5, sliding_window=33, has_sinks=True)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=DEMO_VISION.out_hidden_size,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=("full", "sliding", "sliding", "full"),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        full_attention=full,
        sliding_attention=sliding,
        moe_intermediate_size=192,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        num_mtp_layers=3,
        eos_token_ids=(eos_id,),
        pad_token_id=0,
    )


# ---------------------------------------------------------------------------------------
# Examples: chat-formatted token ids + encoder inputs, exactly as served
# ---------------------------------------------------------------------------------------


@dataclass
class Example:
    task: str  # what the meter scores it as (see ``meter_label``)
    ids: list[int]  # prompt + answer + <|im_end|>, placeholders expanded
    answer_start: int  # first answer position
    media: list[tuple[str, VisionInput | AudioInput, int]]  # (encoder kind, input, first position)
    # Where the answer's parts start: the answer itself, and after a reasoning its
    # words past </think>. Each part is weighed as a whole answer is (see _loss).
    parts: tuple[int, ...] = ()

    @property
    def part_starts(self) -> tuple[int, ...]:
        return self.parts or (self.answer_start,)


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
            # A frozen encoder (fine-tuning) keeps no graph: nothing flows back into it.
            trains = any(p.requires_grad for p in encoder.parameters())
            with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
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

    def mtp_hidden(self, hidden: torch.Tensor, embeds: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Every MTP layer's output at every position t, chained as the engine runs them
        (MiMo / DeepSeek-V3): layer j is fed the previous depth's output at t (depth 0:
        the main model's final normed hidden[t]) and the embedding of token t+j+1
        (zeros past the end), attends over its own outputs at positions <= t and
        predicts token t+j+2."""
        lengths = list(lengths)
        positions = torch.cat([torch.arange(n) for n in lengths])
        backend = PackedCausalAttention(lengths)
        per_sequence = embeds.split(lengths)
        outputs: list[torch.Tensor] = []
        prev = hidden
        for j, layer in enumerate(self.llm.model.mtp.layers):
            shift = j + 1
            nxt = torch.cat([torch.cat((e[shift:], e.new_zeros(min(shift, e.shape[0]), e.shape[1])))
                             for e in per_sequence])
            prev = layer(nxt, prev, positions, backend)
            outputs.append(prev)
        return outputs


class PackedCausalAttention:
    """Attention backend for training: each packed sequence attends causally (and
    within the window on sliding layers) to itself; nothing is cached.

    Tiny per-sequence kernels would dominate step time, so sequences of similar
    length are padded into a few [B, L] groups, a few batched matmuls each. Rows move
    between the packed and the padded layouts by one gather each way (``index_select``:
    its backward is a scatter-add, far cheaper than fancy indexing's).
    """

    def __init__(self, lengths: Sequence[int], group_size: int = 8) -> None:
        self.lengths = list(lengths)
        by_length = sorted(range(len(self.lengths)), key=self.lengths.__getitem__)
        starts = np.cumsum([0, *self.lengths[:-1]])
        self.groups: list[_PaddedGroup] = []
        slot_of_row = torch.empty(sum(self.lengths), dtype=torch.long)
        offset = 0
        for g in range(0, len(by_length), group_size):
            members = by_length[g : g + group_size]
            group = _PaddedGroup([self.lengths[i] for i in members], [int(starts[i]) for i in members])
            slot_of_row[group.rows] = offset + group.slots
            offset += group.valid.numel()
            self.groups.append(group)
        self.slot_of_row = slot_of_row  # packed row -> its slot in the groups' padded outputs

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([g.attend(q, k, v, spec.sliding_window, sinks) for g in self.groups])
        return out.index_select(0, self.slot_of_row)


class _PaddedGroup:
    """Sequences padded to one [B, L] batch. A padding slot holds a copy of some real
    row; a padding query sees every key so its softmax stays finite, and its output
    is dropped; no real query sees a padding key."""

    def __init__(self, lengths: Sequence[int], starts: Sequence[int]) -> None:
        width = max(lengths)
        steps = torch.arange(width)
        self.valid = steps[None, :] < torch.tensor(lengths)[:, None]  # [B, L]
        # Packed row of every slot (padding: the sequence's first row), row-major.
        rows = torch.tensor(starts)[:, None] + torch.where(self.valid, steps[None, :], 0)
        self.gather = rows.reshape(-1)
        self.slots = torch.nonzero(self.valid.reshape(-1)).squeeze(1)  # slots of real rows
        self.rows = self.gather[self.slots]  # ... and their packed rows
        self.offsets = steps[:, None] - steps[None, :]  # q_pos - k_pos, [L, L]
        self._bias: dict[int | None, torch.Tensor] = {}

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, L, L]: 0 where a query sees a key, -inf where it does not."""
        if window not in self._bias:
            seen = self.offsets >= 0
            if window is not None:
                seen &= self.offsets < window
            seen = (seen[None] & self.valid[:, None, :]) | ~self.valid[:, :, None]
            self._bias[window] = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))[:, None, None]
        return self._bias[window].to(dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """Padded outputs [B * L, Hq, Dv] of the group's slots."""
        hq, d = q.shape[1:]
        hkv, dv = k.shape[1], v.shape[2]
        group = hq // hkv
        batch, width = self.valid.shape
        # [B, Hkv, G * L, D]: a kv head's query heads stacked along the rows, no broadcast.
        qg = (q.index_select(0, self.gather) * d**-0.5).view(batch, width, hkv, group, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, hkv, group * width, d)
        kh = k.index_select(0, self.gather).view(batch, width, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vh = v.index_select(0, self.gather).view(batch, width, hkv, dv).transpose(1, 2)
        scores = torch.matmul(qg, kh.transpose(-1, -2)).view(batch, hkv, group, width, width)
        scores = scores + self.bias(window, scores.dtype)
        if sinks is not None:
            # A sink logit joins the denominator only: one more key, with a zero value.
            sink_col = sinks.to(scores.dtype).view(1, hkv, group, 1, 1).expand(batch, hkv, group, width, 1)
            scores = torch.cat((scores, sink_col), dim=-1)
            vh = torch.cat((vh, vh.new_zeros(batch, hkv, 1, dv)), dim=2)
        probs = torch.softmax(scores, dim=-1).view(batch, hkv, group * width, -1)
        out = torch.matmul(probs, vh).view(batch, hkv, group, width, dv)  # [B, Hkv, G, L, Dv]
        return out.permute(0, 3, 1, 2, 4).reshape(batch * width, hq, dv)


PLAIN = Mode()  # asked as before: no tools, no thinking


def meter_label(task: str, mode: Mode) -> str:
    """The running accuracy an example counts in: the plain tasks each on their own,
    the new skills as a few groups."""
    if task == "video_info":
        return mode.label(task).removesuffix("+think")
    if mode.thinking:
        return "thinking"
    return "tools_listed" if mode.tools else task


class ExampleBuilder:
    def __init__(self, tokenizer: Tokenizer, vision: VisionEncoder, audio: AudioEncoder) -> None:
        self.tokenizer = tokenizer
        self.template = ChatTemplate(DEMO_CHAT_TEMPLATE)
        self.placeholder_ids = {kind: tokenizer.token_to_id(tok) for kind, tok in MEDIA_PLACEHOLDERS.items()}
        self.end = tokenizer.token_to_id("<|im_end|>")
        self.think_close = tokenizer.token_to_id(THINK_CLOSE.strip())
        self.vision, self.audio = vision, audio

    def build(self, sample: Sample, rng: np.random.Generator, mode: Mode = PLAIN) -> Example:
        messages = chat_messages(sample, media_first=bool(rng.random() < 0.5))
        # Clients send a call's arguments back spaced as json.dumps writes them, or compact.
        conv = conversation(sample, mode, compact=mode.tool_result and bool(rng.random() < 0.25))
        prompt = self.tokenizer.encode(self.template.render([*messages, *conv.follow_up], **conv.variables))
        inputs = encoder_inputs(sample)
        rows = [self.vision.num_tokens(item) if kind == "vision" else self.audio.num_tokens(item)
                for kind, item in inputs]
        ids, offsets = expand_placeholders(prompt, list(zip(sample.media, rows)), self.placeholder_ids)
        media = [(kind, item, offset) for (kind, item), offset in zip(inputs, offsets)]
        answer_start = len(ids)
        ids += self.tokenizer.encode(conv.output) + [self.end]
        return Example(meter_label(sample.task, mode), ids, answer_start, media, self._parts(ids, answer_start, conv))

    def _parts(self, ids: list[int], answer_start: int, conv: Conversation) -> tuple[int, ...]:
        if conv.reasoning is None:
            return (answer_start,)
        # </think> is one token (an added token, so the text around it tokenizes alone).
        return answer_start, ids.index(self.think_close, answer_start) + 1


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


class _Clock:
    """How far training is, in [0, 1]: the larger of the steps done and the wall-clock
    minutes used, each as a fraction of its budget. On an idle machine the step count
    leads and a run is a function of its seed alone; when the (shared) cores are slow,
    the clock leads, so the run still covers the whole curriculum and anneals its
    learning rate before ``max_minutes`` stops it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.started = cfg, time.monotonic()

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def progress(self, step: int, offset: int = 0) -> float:
        by_steps = (step - offset) / max(1, self.cfg.max_steps - offset)
        return min(1.0, max(by_steps, self.minutes() / self.cfg.max_minutes))


def _lr(step: int, cfg: TrainConfig, clock: _Clock) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = clock.progress(step, offset=cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


_IMAGE_TASKS = ("image_color", "image_shape", "audio_pitch")
_VISION_TASKS = (*_IMAGE_TASKS, "video_direction", "video_color", "video_blink", "describe")


def task_pool(progress: float) -> tuple[str, ...]:
    """A curriculum over training progress in [0, 1]: still images first (the vision
    path must learn to reach the LLM before it can carry motion), then videos, then
    everything. High-or-low beeps (short clips, few examples) come along from the
    start; the other sounds (longer, and only ever dilute the vision phases) wait
    for the last phase: drawn from the start, direction was not learnt in 1300 steps."""
    if progress < 0.08:
        return _IMAGE_TASKS
    if progress < 0.3:
        return _VISION_TASKS
    return TASKS


# How often each task is drawn in the last phase (all tasks), relative to the others.
# The hard skills get more examples: a square from a circle in a 56-84 px picture
# (four to nine merged tokens), the shape word inside the long describe answer (a
# moving shape, two frames per temporal patch: nearly every describe answer served
# wrong names the wrong shape, most of them moving sideways), and counting beeps and
# blinks. Colours are learnt within the first phases and need few examples after.
# Pictures are short sequences, so extra picture examples are cheap.
TASK_WEIGHTS: dict[str, float] = {
    "image_shape": 4.0,
    "describe": 5.0,
    "video_audio_beeps": 1.5,
    "audio_beeps": 1.75,
    "video_blink": 1.25,
    "image_color": 0.5,
    "video_color": 0.5,
    # Three exchanges (the call, the answer from the result, no tool listed), the
    # reply copying numbers from the result.
    "video_info": 5.0,
}
# How a video_info question is asked: the tool listed and not called yet, its result
# in, or no tool listed (the model must then never call one).
TOOL_EXCHANGES: dict[Mode, float] = {
    Mode(tools=True): 0.4,
    Mode(tools=True, tool_result=True): 0.45,
    Mode(): 0.15,
}
# Before the last phase: colours carry the first signal through the vision path,
# pitch needs few examples (drawn only from the last phase, one run never told high
# from low), and motion weighs more: with frames of every size and aspect ratio
# (grids of 2x2 to 4x2 merged tokens) direction is learnt suddenly after a few
# thousand examples, and only once that happens can "describe" be learnt; diluted
# in the full mix it had not happened after 1400 steps.
EARLY_WEIGHTS: dict[str, float] = {
    "image_color": 1.0, "video_color": 1.0, "audio_pitch": 0.3, "video_direction": 4.0, "describe": 3.5,
}


def _task_probabilities(pool: Sequence[str]) -> np.ndarray:
    early = EARLY_WEIGHTS if pool != TASKS else {}
    weights = np.array([early.get(task, TASK_WEIGHTS.get(task, 1.0)) for task in pool])
    return weights / weights.sum()


def draw_mode(task: str, rng: np.random.Generator, cfg: TrainConfig, thinking: bool) -> Mode:
    """How a sample of the full mix is asked: the other tasks with the tool listed
    now and then (and the same answer), the file questions in one of the exchanges."""
    if task == "video_info":
        modes = list(TOOL_EXCHANGES)
        weights = np.array(list(TOOL_EXCHANGES.values()))
        mode = modes[int(rng.choice(len(modes), p=weights / weights.sum()))]
        return Mode(mode.tools, thinking, mode.tool_result)
    return Mode(tools=bool(rng.random() < cfg.tools_share), thinking=thinking)


def mix_labels() -> tuple[str, ...]:
    """Every meter label the full mix produces."""
    plain = tuple(t for t in TASKS if t != "video_info")
    tool = tuple(dict.fromkeys(meter_label("video_info", m) for m in TOOL_EXCHANGES))
    return (*plain, "thinking", "tools_listed", *tool)


def _batches(builder: ExampleBuilder, cfg: TrainConfig, clock: _Clock, curriculum: bool) -> Iterator[list[Example]]:
    """Batches of fresh samples: along the curriculum from scratch, the full mix
    (every task, every way of asking) when fine-tuning."""
    rng = np.random.default_rng(cfg.seed + 7)
    step = 0
    while True:
        pool = task_pool(clock.progress(step)) if curriculum else TASKS
        # Thinking and tools wait for the last phase: the early phases teach perception.
        draws = [_draw(rng, pool, cfg, full_mix=pool == TASKS) for _ in range(cfg.batch_size)]
        yield [builder.build(make_sample(rng, task), rng, mode) for task, mode in draws]
        step += 1


def _draw(rng: np.random.Generator, pool: Sequence[str], cfg: TrainConfig, full_mix: bool) -> tuple[str, Mode]:
    """One example's task and way of asking. A thinking example's task is drawn
    uniformly: each kind of question has its own reasoning to learn, however rarely
    its answers need practice."""
    if full_mix and cfg.round_trip_share and rng.random() < cfg.round_trip_share:
        return "video_info", Mode(tools=True, thinking=bool(rng.random() < 0.5), tool_result=True)
    if full_mix and rng.random() < cfg.thinking_share:
        task = pool[int(rng.integers(len(pool)))]
        return task, draw_mode(task, rng, cfg, thinking=True)
    task = pool[int(rng.choice(len(pool), p=_task_probabilities(pool)))]
    return task, draw_mode(task, rng, cfg, thinking=False) if full_mix else PLAIN


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
    clock = _Clock(cfg)
    labels = mix_labels()
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc="train-demo", unit="step")
    step, stats = 0, {}
    for step, examples in enumerate(_batches(builder, cfg, clock, curriculum=init is None)):
        if step >= cfg.max_steps or clock.minutes() > cfg.max_minutes:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg, clock)
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
