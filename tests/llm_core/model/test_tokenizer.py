"""Decoding keeps the markup the output parsers read, even when a checkpoint
declares it special; other special tokens are skipped."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from llm_core.model.tokenizer import Tokenizer


def _tokenizer(tmp_path: Path) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({"hi": 0, "there": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"])
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    return Tokenizer(path)


def test_markup_survives_skipping_special_tokens(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    ids = tok.encode("<think> hi </think> there <tool_call> hi </tool_call> <|im_end|>")
    text = tok.decode(ids)
    assert "<think>" in text and "</tool_call>" in text and "<|im_end|>" not in text
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)
    stream = tok.stream_decoder()
    streamed = "".join(stream.push(t) for t in ids) + stream.flush()
    assert streamed.split() == text.split()
