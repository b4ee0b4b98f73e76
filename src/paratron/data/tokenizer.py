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
end-of-document. A tokenizer.json read from a folder takes its end, padding and beginning tokens
and the ids that stop generation from what the folder's files declare (special_tokens.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from paratron.data.file_tokenizers import SentencePieceTokenizer, TikTokenizer
from paratron.data.special_tokens import (
    CARRIED_FILES,
    EOD_GUESSES,
    SpecialTokens,
    hf_declarations,
    read_special_tokens,
    write_record,
)
from paratron.errors import DataError

if TYPE_CHECKING:
    from paratron.config.schema import DataConfig

EOD_TOKEN = EOD_GUESSES[0]


class Tokenizer:
    """Text <-> token ids, plus the ids that end a document, pad, begin and stop generation.

    `special` is what the tokenizer's files declare (`from_file` reads them); without it the
    end and padding tokens are guessed from their usual names."""

    def __init__(self, hf: HFTokenizer, source: str = "", special: SpecialTokens | None = None) -> None:
        self.hf = hf
        self.source = source
        self.special = special or read_special_tokens(hf, None, source or "tokenizer")
        self.eod_id = self.special.eos_token_id
        self.pad_id = self.special.pad_token_id if self.special.pad_token_id is not None else self.eod_id
        self.bos_id = self.special.bos_token_id
        self.stop_ids = self.special.stop_ids

    def token(self, token_id: int | None) -> str | None:
        """The text of special token `token_id` (None for None), as a chat template writes it."""
        return None if token_id is None else self.hf.id_to_token(token_id)

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
        """Write tokenizer.json (callers write into temporary paths that they rename). Saved as a
        folder's tokenizer.json, it keeps its special tokens beside it (special_tokens.json), and a
        tokenizer read from a folder brings that folder's chat template and declarations along."""
        self.hf.save(str(path))
        if Path(path).name == "tokenizer.json":
            if self.source and Path(self.source).is_file():
                copy_tokenizer_files(Path(self.source).parent, Path(path).parent)
            self.save_special_tokens(Path(path).parent)

    def save_special_tokens(self, folder: Path) -> None:
        """Record the special tokens in `folder`'s special_tokens.json, where `from_file` finds them."""
        write_record(self.special, folder)

    def spec(self) -> dict:
        """Everything needed to rebuild this tokenizer in another process."""
        return {"type": "hf", "json": self.hf.to_str(), "source": self.source, "special": self.special.as_dict()}

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: no such file; give a tokenizer.json or a folder holding one")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{path}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None
        return cls(hf, str(path), read_special_tokens(hf, path.parent, str(path)))

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
        self.stop_ids = (self.eod_id,)
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


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    """Copy a tokenizer folder's chat template and special-token declarations (those present) into
    another folder."""
    for name in CARRIED_FILES:
        if (source / name).is_file() and (source / name).resolve() != (destination / name).resolve():
            shutil.copyfile(source / name, destination / name)  # (the mode: this umask's, not the source's)


def export_tokenizer(folder: Path, destination: Path) -> dict[str, Any]:
    """A saved tokenizer (`folder`'s tokenizer.json and the files beside it) as a Hugging Face model
    folder holds it: the files are copied, and where tokenizer_config.json or generation_config.json
    is missing, one is written that declares the special tokens (the ids of the model's config.json
    included, which paratron kept in special_tokens.json). Returns those ids (eos_token_id, ...) for
    the model's config.json."""
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    shutil.copyfile(folder / "tokenizer.json", destination / "tokenizer.json")
    copy_tokenizer_files(folder, destination)
    tokenizer_config, generation_config = hf_declarations(tokenizer.special, tokenizer.hf)
    for name, values in (("tokenizer_config.json", tokenizer_config), ("generation_config.json", generation_config)):
        if not (destination / name).is_file():
            (destination / name).write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
    return generation_config


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
    special = SpecialTokens.from_dict(spec["special"]) if "special" in spec else None
    return Tokenizer(HFTokenizer.from_str(spec["json"]), spec.get("source", ""), special)


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


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """Train byte-level BPE (GPT-2 style) on `texts` with `vocab_size` entries, EOD and `special_tokens` (the
    fill-in-the-middle sentinels of a --fim-data run) included."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return Tokenizer(hf, "trained byte-level BPE")
