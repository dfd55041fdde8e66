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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm_core.model.multimodal import MediaEmbedding, MultimodalSpan, SpanRef
from llm_core.model.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "MEDIA_PLACEHOLDERS",
    "MULTIMODAL_SPECIAL_TOKENS",
    "ChatPrompt",
    "ChatTemplate",
    "build_chat_prompt",
    "expand_placeholders",
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
    # Compiled once: parsing the Jinja source costs milliseconds, far more than rendering.
    _compiled: Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            object.__setattr__(self, "_compiled", env.from_string(self.source))
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc

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

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text. ``variables`` reach the template as Hugging Face
        templates expect them: ``tools`` (OpenAI tool definitions),
        ``enable_thinking`` and whatever else a template reads."""
        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **variables)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    spans: list[MultimodalSpan | SpanRef]  # SpanRef for media given without their rows
    # What it was built from: the server reports from these how many the embedding cache had.
    media: list[MediaEmbedding] = field(default_factory=list)


def build_chat_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    media: Sequence[MediaEmbedding],
    placeholder_ids: Mapping[str, int],
    variables: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """Render, tokenise, and expand placeholders.

    ``messages`` use OpenAI roles; content is a string or a list of parts
    ``{"type": "text", "text": ...}`` / ``{"type": "image"|"video"|"audio"}``,
    the media parts in the same order as ``media``. ``variables``: what else the
    template reads (``tools``, ``enable_thinking``).
    """
    ids = tokenizer.encode(template.render(messages, **(variables or {})))
    out, offsets = expand_placeholders(ids, [(m.kind, m.rows) for m in media], placeholder_ids)
    return ChatPrompt(out, [m.span(offset) for offset, m in zip(offsets, media)], list(media))


def expand_placeholders(
    token_ids: Sequence[int], media: Sequence[tuple[str, int]], placeholder_ids: Mapping[str, int]
) -> tuple[list[int], list[int]]:
    """Repeat each media placeholder token once per row of its item's embedding.

    ``media`` is (kind, rows) per item, in prompt order. Returns the expanded ids
    and the offset of each item's first row.
    """
    kind_of_id = {token: kind for kind, token in placeholder_ids.items()}
    out: list[int] = []
    offsets: list[int] = []
    for token in token_ids:
        kind = kind_of_id.get(token)
        if kind is None:
            out.append(token)
            continue
        if len(offsets) == len(media):
            raise ChatTemplateError(f"the prompt has more {kind} placeholders than media parts")
        expected, rows = media[len(offsets)]
        if expected != kind:
            raise ChatTemplateError(f"placeholder for {kind} met a {expected} part: the template reorders media")
        offsets.append(len(out))
        out.extend([token] * rows)
    if len(offsets) < len(media):
        raise ChatTemplateError(
            f"the chat template placed {len(offsets)} of {len(media)} media parts; it needs a placeholder for each"
        )
    return out, offsets
