"""vmoe's text tokenisation (big_vision ``tokenize`` as configured for LiT/SigLIP in vmoe):

ASCII-only lowercasing, SentencePiece encode (no sampling, no BOS), EOS appended; longer than
``max_len``: the first ``max_len - 1`` ids then EOS ("sticky EOS"); shorter: right-padded with
``pad_id`` (vmoe pads with the EOS id 1, not 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_ASCII_LOWER = str.maketrans({c: c.lower() for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"})


class Tokenizer:
    def __init__(self, model_file: str | Path | bytes, max_len: int = 16, eos_id: int = 1, pad_id: int = 1) -> None:
        """
        Args:
            model_file: a SentencePiece model file, or its bytes (as carried in ONNX metadata).
            max_len: ids per text, EOS included.
            eos_id: appended to every text.
            pad_id: right padding.
        """
        import sentencepiece as spm

        if isinstance(model_file, bytes):
            self.sp = spm.SentencePieceProcessor(model_proto=model_file)
        else:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.max_len, self.eos_id, self.pad_id = max_len, eos_id, pad_id

    @classmethod
    def from_contract(cls, model_file: str | Path | bytes, text: dict) -> "Tokenizer":
        return cls(model_file, text.get("max_len", 16), text.get("eos_id", 1), text.get("pad_id", 1))

    def ids(self, text: str) -> list[int]:
        ids = list(self.sp.encode(text.translate(_ASCII_LOWER))) + [self.eos_id]
        if len(ids) >= self.max_len:
            return ids[: self.max_len - 1] + [self.eos_id]
        return ids + [self.pad_id] * (self.max_len - len(ids))

    def __call__(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), max_len)`` int64 ids."""
        return np.array([self.ids(t) for t in texts], dtype=np.int64).reshape(len(texts), self.max_len)

    def count(self, text: str) -> int:
        """Tokens the text uses (before padding), for OpenAI-style usage."""
        return min(len(self.sp.encode(text.translate(_ASCII_LOWER))) + 1, self.max_len)
