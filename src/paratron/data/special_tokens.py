"""Which tokens end a document, pad and begin one, and which stop generation: read from what a
tokenizer's folder declares, guessed from the usual names only when nothing is declared.

A Hugging Face folder declares them in two kinds of file, read in this order:

    tokenizer_config.json, special_tokens_map.json   eos_token, pad_token, bos_token: a string, or an
                                                     AddedToken object {"content": "...", ...}
    generation_config.json, config.json              eos_token_id (an id or a list of ids),
                                                     pad_token_id, bos_token_id

then paratron's own record, special_tokens.json, which a checkpoint keeps beside its tokenizer.json
(a checkpoint holds no config.json, so the ids declared there would otherwise be lost). The first
file that declares a token decides it. Generation stops at the end-of-document token and at every
eos_token_id of the model's configuration (e.g. Llama 3's [128001, 128008, 128009]).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from paratron.errors import DataError

RECORD_FILE = "special_tokens.json"
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
MODEL_FILES = ("generation_config.json", "config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A chat template beside tokenizer.json (transformers' name); a fine-tuned checkpoint keeps the one it trained with."""
CARRIED_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)
"""Hugging Face files beside tokenizer.json that a checkpoint keeps: the chat template, the declarations, and a
vision-language model's image preprocessing."""
EOD_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
PAD_GUESSES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
KINDS = ("eos", "pad", "bos")


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special token ids, as its files declare them (the fields of special_tokens.json)."""

    eos_token_id: int
    """Ends documents (`Tokenizer.eod_id`)."""
    pad_token_id: int | None = None
    """Pads samples; None: padding uses eos_token_id."""
    bos_token_id: int | None = None
    generation_eos_token_ids: tuple[int, ...] = ()
    """Every eos_token_id the model's configuration lists: each one also stops generation."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end generated text: end of document first, then the model configuration's."""
        return tuple(dict.fromkeys((self.eos_token_id, *self.generation_eos_token_ids)))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "generation_eos_token_ids": list(self.generation_eos_token_ids)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpecialTokens:
        return cls(**{**values, "generation_eos_token_ids": tuple(values.get("generation_eos_token_ids", ()))})


def read_special_tokens(hf: HFTokenizer, folder: Path | None, name: str) -> SpecialTokens:
    """The special tokens `folder`'s files declare for tokenizer `hf` (named `name` in messages);
    `folder` None: guessed from the token names alone."""
    files = _Declarations(hf, folder, name)
    eod = files.token_id("eos")
    if eod is None:
        eod = _guess(hf, EOD_GUESSES)
    if eod is None:
        raise DataError(
            f"{name}: no end-of-document token is declared (eos_token in tokenizer_config.json, eos_token_id in "
            f"config.json) and none of {', '.join(EOD_GUESSES)} is in the vocabulary; declare the tokenizer's "
            "eos_token in tokenizer_config.json"
        )
    pad = files.token_id("pad")
    return SpecialTokens(
        eos_token_id=eod,
        pad_token_id=pad if pad is not None else _guess(hf, PAD_GUESSES),
        bos_token_id=files.token_id("bos"),
        generation_eos_token_ids=files.generation_eos_ids(),
    )


def write_record(special: SpecialTokens, folder: Path) -> None:
    """special_tokens.json in `folder` (a checkpoint being written under a temporary name)."""
    (folder / RECORD_FILE).write_text(json.dumps(special.as_dict(), indent=2) + "\n", encoding="utf-8")


def hf_declarations(special: SpecialTokens, hf: HFTokenizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tokenizer_config.json and generation_config.json entries that declare `special` to transformers."""
    ids = {"eos": special.eos_token_id, "pad": special.pad_token_id, "bos": special.bos_token_id}
    tokens = {f"{kind}_token": hf.id_to_token(i) for kind, i in ids.items() if i is not None}
    generation = {f"{kind}_token_id": i for kind, i in ids.items() if i is not None}
    listed = special.generation_eos_token_ids
    if listed:
        generation["eos_token_id"] = listed[0] if len(listed) == 1 else list(listed)
    return {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}, generation


def _guess(hf: HFTokenizer, names: tuple[str, ...]) -> int | None:
    return next((i for i in map(hf.token_to_id, names) if i is not None), None)


class _Declarations:
    """The JSON files of a tokenizer folder that declare special tokens, read once each."""

    def __init__(self, hf: HFTokenizer, folder: Path | None, name: str) -> None:
        self.hf, self.name = hf, name
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.folder = folder or Path()
        names = (*TOKEN_FILES, *MODEL_FILES, RECORD_FILE)
        self.files = {n: _read_json(folder / n) for n in names if folder is not None and (folder / n).is_file()}

    def token_id(self, kind: str) -> int | None:
        """The id of the `kind` token from the first file that declares it."""
        for file in (f for f in TOKEN_FILES if f in self.files):
            token = _token_text(self.files[file].get(f"{kind}_token"), self.folder / file, kind)
            if token is None:
                continue
            token_id = self.hf.token_to_id(token)
            if token_id is None:
                raise DataError(
                    f"{self.folder / file}: {kind}_token {token!r} is not in the vocabulary of {self.name}; "
                    "declare a token the tokenizer has, or add it to the tokenizer"
                )
            return token_id
        key = "eos_token_id" if kind == "eos" else f"{kind}_token_id"
        for file in (*MODEL_FILES, RECORD_FILE):
            ids = self._ids(file, key)
            if ids:
                return ids[0]
        return None

    def generation_eos_ids(self) -> tuple[int, ...]:
        """Every eos_token_id of the first model configuration that lists any."""
        for file, key in (*((f, "eos_token_id") for f in MODEL_FILES), (RECORD_FILE, "generation_eos_token_ids")):
            ids = self._ids(file, key)
            if ids:
                return ids
        return ()

    def _ids(self, file: str, key: str) -> tuple[int, ...]:
        value = self.files.get(file, {}).get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        # (a negative id, such as some Llama configs' pad_token_id -1, is their way of declaring none)
        values = [v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and v < 0)]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise DataError(
                    f"{self.folder / file}: {key} {v!r} is not a token id of {self.name} "
                    f"(0 to {self.vocab_size - 1}); fix the file"
                )
        return tuple(values)


def _token_text(value: Any, path: Path, kind: str) -> str | None:
    """A declared token as tokenizer_config.json writes it: a string or {"content": ...}; None: not declared."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise DataError(f"{path}: {kind}_token must be a string or an object with a 'content' string; fix the file")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({str(exc).splitlines()[0]}); fix or remove the file") from None
    if not isinstance(values, dict):
        raise DataError(f"{path}: not a JSON object; fix or remove the file")
    return values
