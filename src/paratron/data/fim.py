"""Fill-in-the-middle samples (--fim-data), Megatron-LM's transform of pretraining samples for code models.

A sample (seq_length + 1 tokens) is cut at its end-of-document tokens; each document's text is, with
probability `rate`, cut at two random characters into prefix, middle and suffix, and written back as

    PSM: <prefix> prefix <suffix> suffix <middle> middle
    SPM: <prefix> <suffix> suffix <middle> prefix middle      (with probability `spm_rate`)

each part encoded again by the tokenizer; the sample is then cut, or padded with the pad token, to its length.
With a split token (`--fim-split-sample`, a repository's file separator) a document that holds one is, with
probability `rate`, rewritten fragment by fragment, each with probability `fragment_rate`. A text starting with
`no_prefix` stays as it is.

The draws, in Megatron-LM's order (per document: whether to rewrite, the two cut points, whether SPM), come from
one random stream per sample seeded by (seed, sample index), not from one stream in the order samples are read as
in Megatron-LM: sample k is the same at every layout, in any order and after a resume. Empty documents are left
alone, and every end-of-document and split token is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from paratron.config.schema import DataConfig
from paratron.data.datasets import SampleSource
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.errors import DataError


@dataclass(frozen=True)
class FIMTokens:
    """The sentinel ids, the id that ends a document, and the fragment separator's (None: no fragments)."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None


@dataclass(frozen=True)
class FIMRates:
    rate: float
    spm_rate: float
    fragment_rate: float | None = None
    no_prefix: str | None = None


class FIMTransform:
    """One sample's rewriting, given its random stream. `decode` gives a sample's text without special tokens;
    `encode` the ids of a text."""

    def __init__(
        self,
        rates: FIMRates,
        tokens: FIMTokens,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self.rates, self.tokens, self.encode, self.decode = rates, tokens, encode, decode

    def __call__(self, sample: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        pieces = _rewrite_parts(sample, self.tokens.eod, lambda document: self._document(document, rng))
        out = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]) if pieces else sample[:0]
        if len(out) < len(sample):
            out = np.concatenate([out, np.full(len(sample) - len(out), self.tokens.pad, dtype=np.int64)])
        return out[: len(sample)].astype(np.int64)

    def _document(self, document: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        split = self.tokens.split
        if split is None or not (document == split).any():
            return self._permute(document, self.rates.rate, rng)
        if not rng.binomial(1, self.rates.rate):
            return document
        fragment_rate = self.rates.fragment_rate or 0.0
        pieces = _rewrite_parts(document, split, lambda fragment: self._permute(fragment, fragment_rate, rng))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])

    def _permute(self, tokens: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
        """`tokens` in PSM or SPM order with probability `rate`, else as they are."""
        if not rng.binomial(1, rate):
            return tokens
        text = self.decode(tokens.tolist())
        if self.rates.no_prefix is not None and text.startswith(self.rates.no_prefix):
            return tokens
        low, high = sorted(int(b) for b in rng.integers(0, len(text) + 1, size=2))
        prefix, middle, suffix = (self.encode(part) for part in (text[:low], text[low:high], text[high:]))
        t = self.tokens
        if rng.binomial(1, self.rates.spm_rate):
            ids = [t.prefix, t.suffix, *suffix, t.middle, *prefix, *middle]
        else:
            ids = [t.prefix, *prefix, t.suffix, *suffix, t.middle, *middle]
        return np.asarray(ids, dtype=np.int64)


def _rewrite_parts(tokens: np.ndarray, separator: int, rewrite: Callable[[np.ndarray], np.ndarray]) -> list:
    """`tokens` cut at each `separator`, every non-empty part rewritten, the separators kept in place."""
    pieces: list = []
    start = 0
    for end in [*np.flatnonzero(tokens == separator).tolist(), len(tokens)]:
        if end > start:
            pieces.append(rewrite(tokens[start:end]))
        if end < len(tokens):
            pieces.append([separator])
        start = end + 1
    return pieces


class FIMSamples:
    """Samples of `samples` rewritten by `transform`, sample k with the random stream of (seed, k)."""

    def __init__(self, samples: SampleSource, transform: FIMTransform, seed: int) -> None:
        self.samples, self.transform, self.seed = samples, transform, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.transform(self.samples[index], sample_stream(self.seed, index))


def sample_stream(seed: int, index: int) -> np.random.Generator:
    """The random stream of sample `index`: its FIM draws depend on nothing else."""
    return np.random.default_rng([seed, index])


_SENTINELS = (
    ("prefix", "fim_prefix_token"),
    ("middle", "fim_middle_token"),
    ("suffix", "fim_suffix_token"),
    ("pad", "fim_pad_token"),
)


def fim_sentinels(d: DataConfig) -> tuple[str, ...]:
    """The texts of the tokens --fim-data needs beside the end-of-document one (what a tokenizer trained for the
    run is given)."""
    split = () if d.fim_split_sample is None else (d.fim_split_sample,)
    return (*(getattr(d, setting) for _, setting in _SENTINELS), *split)


def fim_transform(d: DataConfig, tokenizer: AnyTokenizer) -> FIMTransform:
    """The transform --fim-data and its settings describe, with the tokenizer's ids of the sentinel tokens (one
    line naming the setting and the fix when the tokenizer lacks one)."""
    if not isinstance(tokenizer, Tokenizer):
        raise DataError(
            f"--fim-data needs a tokenizer with named tokens (<fim_prefix> ...), and {type(tokenizer).__name__} has "
            "none paratron can look up; use a Hugging Face tokenizer that has them (--tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model PATH)"
        )

    def token_id(text: str, setting: str) -> int:
        found = tokenizer.hf.token_to_id(text)
        if found is None:
            raise DataError(
                f"--fim-data: the tokenizer ({tokenizer.source or 'trained'}) has no token {text!r} "
                f"(--{setting.replace('_', '-')}); use a tokenizer that has the fill-in-the-middle tokens, or name "
                f"its own with --{setting.replace('_', '-')}"
            )
        return int(found)

    ids = {name: token_id(getattr(d, setting), setting) for name, setting in _SENTINELS}
    eod = tokenizer.eod_id if d.fim_eod_token is None else token_id(d.fim_eod_token, "fim_eod_token")
    if eod is None:
        raise DataError(
            f"--fim-data: the tokenizer ({tokenizer.source or 'trained'}) declares no end-of-document token; name "
            "the token that separates documents with --fim-eod-token"
        )
    split = None if d.fim_split_sample is None else token_id(d.fim_split_sample, "fim_split_sample")
    tokens = FIMTokens(**ids, eod=eod, split=split)
    rates = FIMRates(d.fim_rate, d.fim_spm_rate, d.fim_fragment_rate, d.fim_no_prefix)
    return FIMTransform(rates, tokens, tokenizer.encode, _PlainText(tokenizer).decode)


class _PlainText:
    """A tokenizer's decoding that drops special tokens (as Megatron-LM's, so that the character cuts see only
    text); a class rather than a closure so that loader workers can be handed it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.hf.decode(list(ids), skip_special_tokens=True)
