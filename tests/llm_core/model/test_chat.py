"""Chat templates and placeholder expansion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_core.model.chat import (
    DEFAULT_CHAT_TEMPLATE,
    MEDIA_PLACEHOLDERS,
    MULTIMODAL_SPECIAL_TOKENS,
    ChatTemplate,
    ChatTemplateError,
    build_chat_prompt,
)
from llm_core.loading.checkpoint import SPECIAL_TOKENS, train_byte_level_tokenizer
from llm_core.model.multimodal import MediaEmbedding, SpanRef
from llm_core.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_byte_level_tokenizer(400, 0, [*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS]).save(str(path))
    return Tokenizer(path)


def _ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {kind: tokenizer.token_to_id(tok) for kind, tok in MEDIA_PLACEHOLDERS.items()}


def test_default_template_renders_chatml_with_media_markers() -> None:
    text = ChatTemplate(DEFAULT_CHAT_TEMPLATE).render([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"}, {"type": "audio"}]},
    ])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nlook: <|vision_start|><|image_pad|><|vision_end|>"
        "<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_placeholders_expand_to_embedding_rows(tokenizer: Tokenizer) -> None:
    image, video = torch.randn(5, 8), torch.randn(3, 8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]}]
    media = [MediaEmbedding("image", b"i" * 32, 5, image), MediaEmbedding("video", b"v" * 32, 3, video)]
    prompt = build_chat_prompt(ChatTemplate(DEFAULT_CHAT_TEMPLATE), tokenizer, messages, media, _ids(tokenizer))
    ids = _ids(tokenizer)
    assert [s.length for s in prompt.spans] == [5, 3]
    for span, kind in zip(prompt.spans, ("image", "video")):
        assert prompt.token_ids[span.offset : span.end] == [ids[kind]] * span.length
        assert prompt.token_ids[span.offset - 1] == tokenizer.token_to_id("<|vision_start|>")
        assert prompt.token_ids[span.end] == tokenizer.token_to_id("<|vision_end|>")
    assert torch.equal(prompt.spans[1].embeddings, video) and prompt.spans[0].key == b"i" * 32
    # Text around the media is tokenised as usual.
    assert tokenizer.decode(prompt.token_ids) == "user\nand\nassistant\n"
    assert [m.key for m in prompt.media] == [b"i" * 32, b"v" * 32]


def test_media_without_rows_become_span_refs(tokenizer: Tokenizer) -> None:
    # The stack's API process knows only each item's key and row count.
    messages = [{"role": "user", "content": [{"type": "audio"}]}]
    prompt = build_chat_prompt(ChatTemplate(DEFAULT_CHAT_TEMPLATE), tokenizer, messages,
                               [MediaEmbedding("audio", b"a" * 32, 4, cached=True)], _ids(tokenizer))
    (span,) = prompt.spans
    assert isinstance(span, SpanRef) and span.length == 4 and span.key == b"a" * 32
    assert prompt.token_ids[span.offset : span.end] == [_ids(tokenizer)["audio"]] * 4


def test_media_embedding_rows_must_match_its_tensor() -> None:
    with pytest.raises(ValueError, match="3 rows was given a tensor of shape \\(2, 4\\)"):
        MediaEmbedding("image", b"k", 3, torch.zeros(2, 4))


def test_media_and_placeholders_must_agree(tokenizer: Tokenizer) -> None:
    template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    one_image = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(ChatTemplateError, match="more image placeholders"):
        build_chat_prompt(template, tokenizer, one_image, [], _ids(tokenizer))
    with pytest.raises(ChatTemplateError, match="placed 0 of 1"):
        build_chat_prompt(template, tokenizer, [{"role": "user", "content": "hi"}],
                          [MediaEmbedding("image", b"k", 2, torch.zeros(2, 4))], _ids(tokenizer))
    with pytest.raises(ChatTemplateError, match="met a audio part"):
        build_chat_prompt(template, tokenizer, one_image, [MediaEmbedding("audio", b"k", 2, torch.zeros(2, 4))],
                          _ids(tokenizer))


def test_template_from_model_dir(tmp_path: Path) -> None:
    assert ChatTemplate.from_model_dir(tmp_path).source == DEFAULT_CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}!"}))
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "hey"}]) == "hey!"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "a"}] * 3) == "[3]"


def test_broken_or_unsafe_templates_are_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")  # at load time, not on the first request
    # Sandboxed: no reaching into Python internals from a checkpoint's template.
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
