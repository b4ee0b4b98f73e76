"""Tokenizers, as Megatron-LM names them (--tokenizer-type):

    ByteLevelBPE          byte-level BPE trained on the data with HF `tokenizers` (--vocab-size)
    HuggingFaceTokenizer  an existing tokenizer.json (--tokenizer-model FILE or a folder holding one)
    GPT2BPETokenizer      GPT-2's vocab.json + merges.txt (--vocab-file, --merge-file); chosen when
                          these are given without --tokenizer-type, as Megatron's pretrain_gpt.py
    GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer
                          a SentencePiece or tiktoken file (--tokenizer-model), see file_tokenizers.py
    NullTokenizer         the text already is token ids separated by spaces (--vocab-size); the
                          end-of-document id is vocab_size, as in Megatron

Byte-level BPE maps any UTF-8 text to ids and back losslessly. Documents end with the
end-of-document token; padding, where needed, uses the pad token if there is one, else
end-of-document.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from paratron.data.file_tokenizers import SentencePieceTokenizer, TikTokenizer
from paratron.errors import DataError

if TYPE_CHECKING:
    from paratron.config.schema import DataConfig

EOD_TOKEN = "<|endoftext|>"
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer:
    """Text <-> token ids, plus the id that ends a document and the one that pads."""

    def __init__(self, hf: HFTokenizer, source: str = "") -> None:
        self.hf = hf
        self.source = source
        self.eod_id = self._find_eod()
        pads = [self.hf.token_to_id(t) for t in _PAD_CANDIDATES]
        self.pad_id = next((p for p in pads if p is not None), self.eod_id)

    def _find_eod(self) -> int:
        for token in _EOD_CANDIDATES:
            token_id = self.hf.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(
            f"{self.source or 'tokenizer'}: has no end-of-document token "
            f"(one of {', '.join(_EOD_CANDIDATES)}); add one to the tokenizer"
        )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once, on all cores (`encode_batch_fast` skips the character offsets)."""
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def save(self, path: Path) -> None:
        """Write tokenizer.json (callers write into temporary paths that they rename); a tokenizer
        read from a folder brings that folder's chat template files along."""
        self.hf.save(str(path))
        if self.source and Path(path).name == "tokenizer.json":
            copy_template_files(Path(self.source).parent, Path(path).parent)

    def spec(self) -> dict:
        """Everything needed to rebuild this tokenizer in another process."""
        return {"type": "hf", "json": self.hf.to_str(), "source": self.source}

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: no such file; give a tokenizer.json or a folder holding one")
        try:
            return cls(HFTokenizer.from_file(str(path)), str(path))
        except DataError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{path}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None

    @classmethod
    def from_gpt2_files(cls, vocab_file: str | Path, merge_file: str | Path) -> Tokenizer:
        """GPT-2's byte-level BPE from its vocab.json and merges.txt."""
        vocab_file, merge_file = Path(vocab_file).expanduser(), Path(merge_file).expanduser()
        files = ((vocab_file, "--vocab-file", "vocab.json"), (merge_file, "--merge-file", "merges.txt"))
        for path, file_flag, name in files:
            if not path.is_file():
                raise DataError(f"{file_flag} {path}: no such file; GPT2BPETokenizer needs GPT-2's {name} there")
        try:
            hf = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as exc:
            raise DataError(
                f"{vocab_file}, {merge_file}: not a GPT-2 vocabulary and merge list ({str(exc).splitlines()[0]})"
            ) from None
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        # As Megatron's GPT-2 tokenizer: the text "<|endoftext|>" in a document is ordinary
        # characters; only appended end-of-document tokens carry its id.
        return cls(hf, str(vocab_file))


class NullTokenizer:
    """Megatron's NullTokenizer: text is token ids separated by whitespace, ids below `vocab_size`;
    the end-of-document id is `vocab_size` itself, so the vocabulary holds vocab_size + 1 entries."""

    def __init__(self, vocab_size: int) -> None:
        self.ids_vocab_size = vocab_size
        self.eod_id = self.pad_id = vocab_size
        self.source = f"NullTokenizer({vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self.ids_vocab_size + 1

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(token) for token in text.split()]
        except ValueError as exc:
            raise ValueError(f"NullTokenizer expects token ids separated by spaces ({exc})") from None
        if any(not 0 <= i < self.ids_vocab_size for i in ids):
            raise ValueError(f"NullTokenizer: an id is outside [0, {self.ids_vocab_size})")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in ids)

    def save(self, path: Path) -> None:
        raise DataError("a NullTokenizer has no tokenizer file to save")

    def spec(self) -> dict:
        return {"type": "null", "vocab_size": self.ids_vocab_size}


AnyTokenizer = Tokenizer | NullTokenizer | SentencePieceTokenizer | TikTokenizer

TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
"""Hugging Face files beside tokenizer.json that hold its chat template and special tokens."""


def copy_template_files(source: Path, destination: Path) -> None:
    """Copy a tokenizer folder's chat template files (those present) into another folder."""
    for name in TEMPLATE_FILES:
        if (source / name).is_file() and (source / name).resolve() != (destination / name).resolve():
            shutil.copy(source / name, destination / name)


def tokenizer_from_spec(spec: dict) -> AnyTokenizer:
    if spec["type"] == "null":
        return NullTokenizer(spec["vocab_size"])
    if spec["type"] == "sentencepiece":
        return SentencePieceTokenizer(spec["path"], spec["kind"], spec["legacy"])
    if spec["type"] == "tiktoken":
        return TikTokenizer(
            spec["path"],
            spec["pattern"],
            spec["vocab_size"],
            spec["num_special_tokens"],
            spec["special_tokens"],
            spec["legacy"],
        )
    return Tokenizer(HFTokenizer.from_str(spec["json"]), spec.get("source", ""))


def load_tokenizer(
    kind: str | None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    *,
    legacy: bool = False,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: list[str] | None = None,
) -> AnyTokenizer:
    """An existing tokenizer by its Megatron type name (ByteLevelBPE is trained, see `train_byte_level_bpe`).
    `vocab_size` is NullTokenizer's ids and TikTokenizer's vocabulary (Megatron's --vocab-size). No `kind`
    (--tokenizer-type unset) with GPT-2 files means GPT2BPETokenizer, as in Megatron's pretrain_gpt.py."""
    if kind is None and (vocab_file or merge_file):
        kind = "GPT2BPETokenizer"
    if kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return SentencePieceTokenizer(tokenizer_model, kind, legacy)
    if kind == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens, tiktoken_special_tokens, legacy
        )
    if kind == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH")
        return Tokenizer.from_file(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise DataError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        return Tokenizer.from_gpt2_files(vocab_file, merge_file)
    if kind == "NullTokenizer":
        if not vocab_size:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise DataError(
        f"--tokenizer-type {kind}: not an existing tokenizer (choose HuggingFaceTokenizer, GPT2BPETokenizer, "
        "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or NullTokenizer)"
    )


def tokenizer_for(data: DataConfig, vocab_size: int | None) -> AnyTokenizer:
    """The existing tokenizer `data` names (see `DataConfig.resolved_tokenizer_type`); `vocab_size` is --vocab-size."""
    return load_tokenizer(
        data.resolved_tokenizer_type,
        data.tokenizer_model,
        data.vocab_file,
        data.merge_file,
        vocab_size,
        legacy=data.legacy_tokenizer,
        tiktoken_pattern=data.tiktoken_pattern,
        tiktoken_num_special_tokens=data.tiktoken_num_special_tokens,
        tiktoken_special_tokens=data.tokenizer_special_tokens or data.tiktoken_special_tokens,
    )


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
