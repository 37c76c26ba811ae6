"""Text -> fixed-length ids, as the package's ``text`` contract says; SentencePiece only, no transformers.

Default (vmoe: big_vision ``tokenize`` as configured for LiT/SigLIP in vmoe): ASCII-only lowercasing,
SentencePiece encode (no sampling, no BOS), EOS appended; longer than ``max_len``: the first
``max_len - 1`` ids then EOS ("sticky EOS"); shorter: right-padded with ``pad_id`` (vmoe pads with
the EOS id 1, not 0).

Switches for transformers' ``SiglipTokenizer`` (written by the SigLIP converter), in its order:

* ``word_start``: the text is prefixed with the word-start mark U+2581 (existing marks become
  spaces) and every piece is encoded after the sentinel text ``word_start`` (``"<unk>"``), whose
  own pieces are dropped, so the first word is encoded as a word start whatever the model's
  ``add_dummy_prefix``;
* ``special_tokens``: ``[{"text", "id", "lstrip", "rstrip"}]``, matched verbatim (leftmost,
  longest first) before anything else is done to the text; ``lstrip``/``rstrip`` strip the
  whitespace at the neighbouring text's facing end;
* per piece of text between special tokens: ``lowercase`` (``"ascii"``, ``"unicode"`` =
  ``str.lower``, ``"none"``), ``strip_punctuation`` (ASCII punctuation removed),
  ``collapse_whitespace`` (runs of whitespace become one space, both ends stripped);
* ``eos_if_absent``: the EOS is not appended to ids that already end with it.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

_ASCII_LOWER = str.maketrans({c: c.lower() for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"})
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
_WHITESPACE = re.compile(r"\s+")
WORD_START = "\u2581"  # SentencePiece's word-start mark


class Tokenizer:
    def __init__(self, model_file: str | Path | bytes, max_len: int = 16, eos_id: int = 1, pad_id: int = 1, *,
                 lowercase: str = "ascii", strip_punctuation: bool = False, collapse_whitespace: bool = False,
                 word_start: str | None = None, special_tokens: list[dict[str, Any]] | None = None,
                 eos_if_absent: bool = False) -> None:
        """
        Args:
            model_file: a SentencePiece model file, or its bytes (as carried in ONNX metadata).
            max_len: ids per text, EOS included.
            eos_id: appended to every text.
            pad_id: right padding.
            lowercase: 'ascii' (vmoe), 'unicode' (``str.lower``) or 'none'.
            strip_punctuation: remove ASCII punctuation (``string.punctuation``).
            collapse_whitespace: runs of whitespace -> one space, ends stripped.
            word_start: sentinel text for word-start encoding (see the module docstring); None: plain encode.
            special_tokens: texts matched verbatim before normalisation, each ``{"text", "id", "lstrip", "rstrip"}``.
            eos_if_absent: do not append the EOS to ids that already end with it.
        """
        if lowercase not in ("ascii", "unicode", "none"):
            raise ValueError(f"text contract: lowercase {lowercase!r} is not one of 'ascii', 'unicode', 'none'")
        if isinstance(model_file, bytes):
            self.sp = spm.SentencePieceProcessor(model_proto=model_file)
        else:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.max_len, self.eos_id, self.pad_id = max_len, eos_id, pad_id
        self.lowercase, self.strip_punctuation, self.collapse_whitespace = lowercase, strip_punctuation, collapse_whitespace
        self.word_start, self.eos_if_absent = word_start, eos_if_absent
        self.special = {str(t["text"]): t for t in special_tokens or []}
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")")
            if self.special else None
        )
        self._sentinel_len = len(self.sp.encode(word_start, out_type=str)) if word_start is not None else 0

    @classmethod
    def from_contract(cls, model_file: str | Path | bytes, text: dict) -> "Tokenizer":
        return cls(model_file, text.get("max_len", 16), text.get("eos_id", 1), text.get("pad_id", 1),
                   lowercase=text.get("lowercase", "ascii"), strip_punctuation=bool(text.get("strip_punctuation", False)),
                   collapse_whitespace=bool(text.get("collapse_whitespace", False)), word_start=text.get("word_start"),
                   special_tokens=text.get("special_tokens"), eos_if_absent=bool(text.get("eos_if_absent", False)))

    # ------------------------------------------------------------------ text -> pieces

    def _normalize(self, text: str) -> str:
        if self.lowercase == "ascii":
            text = text.translate(_ASCII_LOWER)
        elif self.lowercase == "unicode":
            text = text.lower()
        if self.strip_punctuation:
            text = text.translate(_NO_PUNCTUATION)
        if self.collapse_whitespace:
            text = _WHITESPACE.sub(" ", text).strip()
        return text

    def _split(self, text: str) -> list[tuple[str, bool]]:
        """``(chunk, is_special)`` in order; whitespace next to a stripping special token removed."""
        if self._special_re is None:
            return [(text, False)]
        parts = self._special_re.split(text)  # odd indices are the special tokens
        for i in range(1, len(parts), 2):
            tok = self.special[parts[i]]
            if tok.get("rstrip") and i + 1 < len(parts):
                parts[i + 1] = parts[i + 1].lstrip()
            if tok.get("lstrip"):
                parts[i - 1] = parts[i - 1].rstrip()
        return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]

    def _pieces(self, text: str) -> list[tuple[str, int, bool]]:
        """``(piece, id, is_special)`` of a text, before EOS and padding (pieces named in word-start mode only)."""
        if self.word_start is not None:
            text = WORD_START + text.replace(WORD_START, " ")
        out: list[tuple[str, int, bool]] = []
        for chunk, special in self._split(text):
            if special:
                out.append((chunk, int(self.special[chunk]["id"]), True))
                continue
            chunk = self._normalize(chunk)
            if self.word_start is None:
                out.extend(("", i, False) for i in self.sp.encode(chunk))
            else:
                pieces = self.sp.encode(self.word_start + chunk, out_type=str)
                pieces = pieces[self._sentinel_len:] if len(pieces) >= self._sentinel_len else pieces
                out.extend((p, self.sp.piece_to_id(p), False) for p in pieces)
        if self.word_start is not None and len(out) > 1 and out[0][0] == WORD_START and not out[0][2] and out[1][2]:
            out = out[1:]  # a lone word-start mark before a special token is dropped
        return out

    def ids(self, text: str) -> list[int]:
        ids = [i for _, i, _ in self._pieces(text)]
        if len(ids) >= self.max_len:
            ids = ids[: self.max_len - 1]  # sticky EOS: room for it at the end
        if not (self.eos_if_absent and ids and ids[-1] == self.eos_id):
            ids.append(self.eos_id)
        return ids + [self.pad_id] * (self.max_len - len(ids))

    def __call__(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), max_len)`` int64 ids."""
        return np.array([self.ids(t) for t in texts], dtype=np.int64).reshape(len(texts), self.max_len)

    def count(self, text: str) -> int:
        """Tokens the text uses (before padding), for OpenAI-style usage."""
        pieces = self._pieces(text)
        ends_with_eos = self.eos_if_absent and pieces and pieces[-1][1] == self.eos_id
        return min(len(pieces) + (0 if ends_with_eos else 1), self.max_len)
