"""Chat prompts: the model's chat template, and media placeholders expanded to
the length of their embeddings.

A checkpoint's ``tokenizer_config.json`` (or ``chat_template.jinja``) carries a
Jinja template, rendered in a sandbox like transformers' ``apply_chat_template``.
A media part renders as one placeholder token (``<|image_pad|>``, ...); after
tokenising, each placeholder becomes as many copies as its embedding has rows,
and the engine feeds the embedding rows at those positions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm_core.multimodal import MultimodalSpan
from llm_core.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "MEDIA_PLACEHOLDERS",
    "MULTIMODAL_SPECIAL_TOKENS",
    "ChatPrompt",
    "ChatTemplate",
    "MediaPart",
    "build_chat_prompt",
]

MEDIA_PLACEHOLDERS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "audio": "<|audio_pad|>"}
MULTIMODAL_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)

# ChatML with Qwen2-VL-style media markers; used when a checkpoint has no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}{{ '\\n' }}"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part.type == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (a client error) or the template is broken."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``,
        else the default ChatML template."""
        root = Path(model_dir)
        jinja = root / "chat_template.jinja"
        if jinja.exists():
            return cls(jinja.read_text())
        config = root / "tokenizer_config.json"
        if config.exists():
            template = json.loads(config.read_text()).get("chat_template")
            if isinstance(template, str) and template:
                return cls(template)
        return cls(DEFAULT_CHAT_TEMPLATE)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.source).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc


@dataclass(frozen=True)
class MediaPart:
    """A media content part once encoded: its kind, embedding rows and content key."""

    kind: str  # "image" | "video" | "audio"
    embeddings: torch.Tensor  # [rows, hidden]
    key: bytes


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    spans: list[MultimodalSpan]


def build_chat_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    media: Sequence[MediaPart],
    placeholder_ids: Mapping[str, int],
) -> ChatPrompt:
    """Render, tokenise, and expand placeholders.

    ``messages`` use OpenAI roles; content is a string or a list of parts
    ``{"type": "text", "text": ...}`` / ``{"type": "image"|"video"|"audio"}``,
    the media parts in the same order as ``media``.
    """
    ids = tokenizer.encode(template.render(messages))
    kind_of_id = {placeholder_ids[k]: k for k in placeholder_ids}
    out: list[int] = []
    spans: list[MultimodalSpan] = []
    queue = list(media)
    for token in ids:
        kind = kind_of_id.get(token)
        if kind is None:
            out.append(token)
            continue
        if not queue:
            raise ChatTemplateError(f"the prompt has more {kind} placeholders than media parts")
        part = queue.pop(0)
        if part.kind != kind:
            raise ChatTemplateError(f"placeholder for {kind} met a {part.kind} part: the template reorders media")
        rows = int(part.embeddings.shape[0])
        spans.append(MultimodalSpan(len(out), part.embeddings, part.key))
        out.extend([token] * rows)
    if queue:
        raise ChatTemplateError(
            f"the chat template placed {len(media) - len(queue)} of {len(media)} media parts; "
            "it needs a placeholder for each"
        )
    return ChatPrompt(out, spans)
