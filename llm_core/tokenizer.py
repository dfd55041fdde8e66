"""Text ↔ token ids through a checkpoint's ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        self._tok = _HFTokenizer.from_file(str(path))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(path) if path.exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise KeyError(f"the tokenizer has no token {token!r}")
        return int(found)
