"""Tokenizers: byte-level BPE trained on the data with HF `tokenizers`, or a saved tokenizer.json.

Byte-level BPE maps any UTF-8 text to ids and back losslessly; the end-of-document
token `<|endoftext|>` separates documents in the token stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from paratron.errors import DataError

EOD_TOKEN = "<|endoftext|>"
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer:
    """Text <-> token ids, plus the id that ends a document."""

    def __init__(self, hf: HFTokenizer, source: str = "") -> None:
        self.hf = hf
        self.source = source
        self.eod_id = self._find_eod()

    def _find_eod(self) -> int:
        for token in _EOD_CANDIDATES:
            token_id = self.hf.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(f"{self.source or 'tokenizer'}: has no end-of-document token "
                        f"(one of {', '.join(_EOD_CANDIDATES)}); add one to the tokenizer")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def save(self, path: Path) -> None:
        """Write tokenizer.json (callers write into temporary paths that they rename)."""
        self.hf.save(str(path))

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        try:
            return cls(HFTokenizer.from_file(str(path)), str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{path}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE (GPT-2 style) on `texts` with `vocab_size` entries, EOD included."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return Tokenizer(hf, "trained byte-level BPE")
