"""The grammar compiler and matcher (llguidance over the checkpoint's
tokenizer): broken grammars refused with the library's reason, masks,
consumption and rollback, and markup tokens that are text to a grammar."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_core.sample.grammar import GrammarCompiler, GrammarSpec, allows

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"
VOCAB = json.loads((DEMO / "config.json").read_text())["vocab_size"]


def test_compiler_refuses_broken_grammars_with_the_reason() -> None:
    compiler = GrammarCompiler.from_file(DEMO / "tokenizer.json", VOCAB, (4,))
    with pytest.raises(ValueError, match="objekt"):
        compiler.matcher(GrammarSpec("json_schema", '{"type": "objekt"}'))
    with pytest.raises(ValueError, match="not JSON"):
        compiler.matcher(GrammarSpec("json_schema", "{"))
    with pytest.raises(ValueError, match="regex"):
        compiler.matcher(GrammarSpec("regex", "(["))
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml", "a: 1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source"):
        GrammarSpec("lark", "")


def test_matcher_masks_consumes_and_rolls_back() -> None:
    compiler = GrammarCompiler.from_file(DEMO / "tokenizer.json", VOCAB, (4,))
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode('{"a": 5}').ids
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    matcher = compiler.matcher(GrammarSpec("json_schema", json.dumps(schema)))
    row = np.zeros(compiler.words, np.int32)
    matcher.fill_mask(row)
    assert allows(row, ids[0]) and not allows(row, 4)  # an empty output is not an object
    for token in ids:
        matcher.fill_mask(row)
        assert allows(row, token) and matcher.consume(token)
    matcher.fill_mask(row)
    assert allows(row, 4) and matcher.consume(4) and matcher.stopped
    matcher.rollback(len(ids))  # the end token took no place of its own
    matcher.fill_mask(row)
    assert allows(row, ids[0]) and not matcher.stopped


def test_markup_tokens_that_are_not_special_match_the_grammars_text() -> None:
    """<tool_call> is one added token, not special (as in Qwen's and MiMo's
    tokenizers): a tool call's grammar, written as text, must let it through, and
    its spelling letter by letter too; a special token never."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    marker, end = hf.token_to_id("<tool_call>"), hf.token_to_id("<|im_end|>")
    compiler = GrammarCompiler.from_file(DEMO / "tokenizer.json", hf.get_vocab_size(), (end,))
    spec = GrammarSpec("lark", 'start: "<tool_call>" /[a-z]+/ "</tool_call>"')
    row = np.zeros(compiler.words, dtype=np.int32)
    matcher = compiler.matcher(spec)
    matcher.fill_mask(row)
    assert allows(row, marker) and not allows(row, end)
    assert matcher.consume(marker)
    assert all(matcher.consume(t) for t in hf.encode("abc", add_special_tokens=False).ids)
    assert matcher.consume(hf.token_to_id("</tool_call>")) and not matcher.error
    spelled = compiler.matcher(spec)
    spelling = [hf.token_to_id("<"), *hf.encode("tool_call>ab", add_special_tokens=False).ids]
    assert all(spelled.consume(t) for t in spelling)
