"""Megatron-LM's tokenizers that read a model file with their own library: SentencePiece
(GPTSentencePieceTokenizer, Llama2Tokenizer) and tiktoken (TikTokenizer).

Ids, the end-of-document id and what a document's token ids begin with follow Megatron-LM's
tokenizer library (megatron.core.tokenizers, the default since it replaced the classes of
megatron/training/tokenizer, which --legacy-tokenizer selects), checked against it in
tests/unit/test_megatron_tokenizers.py:

- SentencePiece: the model's own ids; end of document = the model's </s> (eos) id. A document
  is its pieces alone; only Llama2Tokenizer under --legacy-tokenizer starts it with <s>.
- TikTokenizer: ids 0..N-1 (N = --tiktoken-num-special-tokens) are the special tokens, named ones
  first, then <SPECIAL_i> fillers; the vocabulary file's rank r is id r + N; the vocabulary is cut
  to --vocab-size (default 2**17) ids. End of document = </s>. Special-token text inside a
  document becomes its special id (read as plain text under --legacy-tokenizer).

Nothing is downloaded: both are built from the local file only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from paratron.errors import DataError

DEFAULT_TIKTOKEN_VOCAB = 2**17
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
LEGACY_TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TIKTOKEN_PATTERNS = {
    # Megatron-LM's two pre-tokenization regexes (a file format constant: they must match exactly).
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _model_file(path: str | Path | None, kind: str, what: str) -> Path:
    if not path:
        raise DataError(f"--tokenizer-type {kind} needs --tokenizer-model PATH ({what})")
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"--tokenizer-model {path}: no such file; {kind} needs {what}")
    return file


class SentencePieceTokenizer:
    """GPTSentencePieceTokenizer and Llama2Tokenizer: a SentencePiece .model file."""

    def __init__(self, path: str | Path | None, kind: str = "GPTSentencePieceTokenizer", legacy: bool = False) -> None:
        import sentencepiece  # (lazy for start-up speed: docs/architecture.md)

        file = _model_file(path, kind, "a SentencePiece .model file")
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        except Exception as exc:  # sentencepiece raises bare RuntimeError/OSError for unreadable models
            reason = str(exc).splitlines()[0]
            raise DataError(f"--tokenizer-model {path}: not a SentencePiece model ({reason})") from None
        self.kind, self.legacy, self.source = kind, legacy, str(file)
        self.digest = _file_digest(file)
        self.bos_id = int(self.sp.bos_id())
        self.eod_id = int(self.sp.eos_id())
        if self.eod_id < 0:
            raise DataError(f"--tokenizer-model {path}: the model has no </s> (eos) piece to end documents with")
        self.pad_id = int(self.sp.pad_id()) if self.sp.pad_id() >= 0 else self.eod_id
        self.stop_ids = (self.eod_id,)
        self.prepend_bos = kind == "Llama2Tokenizer" and legacy
        if self.prepend_bos and self.bos_id < 0:
            raise DataError(f"--tokenizer-model {path}: Llama2Tokenizer starts documents with <s>, which it lacks")

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encoded = self.sp.encode(list(texts))
        return [[self.bos_id, *ids] for ids in encoded] if self.prepend_bos else encoded

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode_ids(list(ids))

    def save(self, path: Path) -> None:
        """Beside `path` (a checkpoint's tokenizer.json): the model file, as tokenizer.model."""
        shutil.copyfile(self.source, Path(path).with_name("tokenizer.model"))

    def spec(self) -> dict:
        return {"type": "sentencepiece", "path": self.source, "kind": self.kind, "legacy": self.legacy,
                "sha256": self.digest}  # fmt: skip


def _mergeable_ranks(file: Path, entries: int | None) -> dict[bytes, int]:
    """Megatron's tiktoken vocabulary: a JSON list of {"rank": i, "token_bytes": base64, "token_str": ...}
    in rank order, the first 256 being the single bytes 0..255; cut to its first `entries`."""
    try:
        vocab = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"--tokenizer-model {file}: not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(vocab, list):
        raise DataError(f"--tokenizer-model {file}: expected a JSON list of tiktoken vocabulary entries")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:entries]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise DataError(
                f"--tokenizer-model {file}: entry {i} is not {{'rank': {i}, 'token_bytes': ..., 'token_str': ...}}"
            )
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise DataError(f"--tokenizer-model {file}: entry {i} must be the single byte {i}")
        if token in ranks:
            raise DataError(f"--tokenizer-model {file}: entry {i} repeats the bytes of entry {ranks[token]}")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """Megatron-LM's TikTokenizer over its tiktoken vocabulary JSON (see the module's docstring)."""

    def __init__(
        self,
        path: str | Path | None,
        pattern: str | None = None,
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] | None = None,
        legacy: bool = False,
    ) -> None:
        import tiktoken  # (lazy for start-up speed: docs/architecture.md)

        file = _model_file(path, "TikTokenizer", "Megatron's tiktoken vocabulary .json")
        if pattern is None and legacy:
            raise DataError("--legacy-tokenizer with TikTokenizer needs --tiktoken-pattern v1 or v2")
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"--tiktoken-pattern {pattern}: choose v1 or v2")
        vocab_size = vocab_size or DEFAULT_TIKTOKEN_VOCAB
        required = LEGACY_TIKTOKEN_SPECIAL_TOKENS if legacy else TIKTOKEN_SPECIAL_TOKENS
        named = list(special_tokens) if special_tokens else list(required)
        if len(set(named)) != len(named):
            raise DataError(f"--tiktoken-special-tokens {' '.join(named)}: a token is named twice")
        missing = [t for t in required if t not in named]
        if missing:
            needed, lacking = " ".join(required), " ".join(missing)
            raise DataError(f"--tiktoken-special-tokens must include {needed} (missing {lacking})")
        if not len(named) <= num_special_tokens < vocab_size:
            raise DataError(
                f"--tiktoken-num-special-tokens {num_special_tokens}: must be at least the {len(named)} named special "
                f"tokens and below the vocabulary size {vocab_size} (--vocab-size)"
            )
        inner = vocab_size - num_special_tokens
        ranks = _mergeable_ranks(file, inner)
        if len(ranks) < inner:
            raise DataError(
                f"--tokenizer-model {path}: {len(ranks)} vocabulary entries, but --vocab-size {vocab_size} with "
                f"{num_special_tokens} special tokens needs {inner}; "
                f"give --vocab-size {len(ranks) + num_special_tokens}"
            )
        specials = named + [f"<SPECIAL_{i}>" for i in range(len(named), num_special_tokens)]
        self.special_ids = {token: i for i, token in enumerate(specials)}
        self.encoding = tiktoken.Encoding(
            name=file.stem or "tiktoken",
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self.special_ids,
        )
        self.source, self.digest, self.legacy = str(file), _file_digest(file), legacy
        self.settings = (pattern, vocab_size, num_special_tokens, tuple(named))
        self.num_special_tokens, self._vocab_size = num_special_tokens, vocab_size
        self.bos_id, self.eod_id, self.unk_id = (self.special_ids[t] for t in ("<s>", "</s>", "<unk>"))
        self.pad_id = self.special_ids.get("<pad>", self.eod_id) if not legacy else self.eod_id
        self.stop_ids = (self.eod_id,)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        if self.legacy:
            return self.encoding.encode_ordinary(text)
        return self.encoding.encode(text, allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.legacy:
            return self.encoding.encode_ordinary_batch(list(texts))
        return self.encoding.encode_batch(list(texts), allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def save(self, path: Path) -> None:
        """Beside `path` (a checkpoint's tokenizer.json): the vocabulary file, as tokenizer_tiktoken.json."""
        shutil.copyfile(self.source, Path(path).with_name("tokenizer_tiktoken.json"))

    def spec(self) -> dict:
        pattern, vocab_size, num_special, named = self.settings
        return {"type": "tiktoken", "path": self.source, "pattern": pattern, "vocab_size": vocab_size,
                "num_special_tokens": num_special, "special_tokens": list(named), "legacy": self.legacy,
                "sha256": self.digest}  # fmt: skip
