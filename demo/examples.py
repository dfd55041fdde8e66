"""Training examples: a world sample asked in one way (``demo.dialogue.Mode``) as
chat-formatted token ids with the encoder inputs of its media, built exactly as the
server builds a request (``media.preprocess_*``, ``media.audio_features``, the demo's
chat template), and the label of the running accuracy each example counts in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from demo.dialogue import DEMO_CHAT_TEMPLATE, THINK_CLOSE, Conversation, Mode, conversation
from demo.world import Sample
from encoders.audio import AudioEncoder, AudioInput
from encoders.presets import DEMO_AUDIO, DEMO_PREPROCESS
from encoders.vision import VisionEncoder, VisionInput
from llm_core.model.chat import MEDIA_PLACEHOLDERS, ChatTemplate, expand_placeholders
from llm_core.model.tokenizer import Tokenizer
from media import audio_features, preprocess_images, preprocess_video

HOP = 160


@dataclass
class Example:
    task: str  # what the meter scores it as (see ``meter_label``)
    ids: list[int]  # prompt + answer + <|im_end|>, placeholders expanded
    answer_start: int  # first answer position
    media: list[tuple[str, VisionInput | AudioInput, int]]  # (encoder kind, input, first position)
    # Where the answer's parts start: the answer itself, and after a reasoning its
    # words past </think>. Each part is weighed as a whole answer is (see
    # ``demo.train._loss``).
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
