"""The data settings agree with each other (whether the files exist is checked with the inputs, before launch)."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.schema import DataConfig, ModelConfig, TrainingConfig
from paratron.errors import ConfigError


def parse_split(split: str) -> tuple[float, float, float]:
    """'969,30,1' -> normalized (train, valid, test) fractions."""
    parts = [p.strip() for p in split.strip("'\" ").replace("/", ",").split(",")]  # (quotes a script kept)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"{flag.split} {split!r}: expected up to three non-negative numbers such as 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def check_data_settings(d: DataConfig, t: TrainingConfig, m: ModelConfig, needs_source: bool = True) -> None:
    """The data settings agree with each other (whether the files exist is checked with the inputs);
    one source of data is given, unless `needs_source` is False (then at most one)."""
    _check_source(d, needs_source)
    _check_documents(d, m)
    _check_fine_tuning_data(d)
    _check_split_paths(d, t)
    _check_tokenizer_settings(d, m)
    _check_validation_share(d, t)


def _check_source(d: DataConfig, needs_source: bool) -> None:
    """One of --data-path, --train-data-path (per split), --corpus and --mock-data (at most one when the run
    reads no data)."""
    sources = [
        name
        for name, on in (
            (flag.mock_data, d.mock_data),
            (flag.corpus, d.corpus),
            (flag.data_path, bool(d.data_path)),
            (flag.train_data_path, _per_split(d)),
        )
        if on
    ]
    if len(sources) > 1 or (needs_source and not sources):
        what = "none" if not sources else " and ".join(sources)
        raise ConfigError(
            f"give exactly one of {flag.data_path}, {flag.train_data_path} (with "
            f"{flag.valid_data_path}), {flag.corpus} stdlib or {flag.mock_data} (got {what})"
        )


def _per_split(d: DataConfig) -> bool:
    """Whether the data comes as a path per split (--train-data-path, --valid-data-path, --test-data-path)."""
    return bool(d.train_data_path or d.valid_data_path or d.test_data_path)


def _check_documents(d: DataConfig, m: ModelConfig) -> None:
    """The settings that read each sample's documents need data that has them (--mock-data has none)."""
    documents = [
        name
        for name, on in (
            (flag.reset_position_ids, d.reset_position_ids),
            (flag.reset_attention_mask, d.reset_attention_mask),
            (flag.eod_mask_loss, d.eod_mask_loss),
            (f"{flag.attention_type} document", m.attention_type == "document" and not d.sft),
        )
        if on
    ]
    if documents and d.mock_data:
        raise ConfigError(
            f"{documents[0]} reads the documents of each sample, and {flag.mock_data} has none (no end-of-document "
            f"token); give {flag.data_path} or {flag.corpus} stdlib"
        )


def _check_fine_tuning_data(d: DataConfig) -> None:
    """--sft reads conversations from files; its own settings need it, and the pretraining documents' settings
    do not apply to it."""
    if d.sft and (d.mock_data or d.corpus):
        raise ConfigError(f"{flag.sft} trains on conversations: give {flag.data_path} FILE.jsonl ... instead")
    sft_only = [
        f
        for f, on in (
            (flag.sft_truncation, d.sft_truncation != "truncate"),
            (f"--no-{flag.truncate[2:]}", not d.truncate),
        )
        if on
    ]
    if sft_only and not d.sft:
        raise ConfigError(f"{sft_only[0]} applies to fine-tuning data; add {flag.sft}")
    if d.sft and (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        raise ConfigError(
            f"{flag.reset_position_ids}, {flag.reset_attention_mask} and {flag.eod_mask_loss} are for pretraining "
            f"documents; {flag.sft} already gives each conversation its own positions, attention and loss mask"
        )


def _check_split_paths(d: DataConfig, t: TrainingConfig) -> None:
    """Paths per split start with the training split, and evaluation has a validation path to read."""
    per_split = _per_split(d)
    if per_split and not d.train_data_path:
        raise ConfigError(f"{flag.valid_data_path} and {flag.test_data_path} need {flag.train_data_path} too")
    if per_split and t.eval_iters != 0 and not d.valid_data_path:
        raise ConfigError(f"{_evaluation(d, t)} needs {flag.valid_data_path}; give it or set {flag.eval_iters} 0")


def _evaluation(d: DataConfig, t: TrainingConfig) -> str:
    """The run's evaluation, as its error lines name it."""
    batches = t.eval_batches(d.sft)
    return f"{flag.eval_iters} {batches}" if batches is not None else f"validation (unset {flag.eval_iters})"


def _check_tokenizer_settings(d: DataConfig, m: ModelConfig) -> None:
    """A tokenizer type has the setting it is built from (its files are checked with the inputs)."""
    kind = d.tokenizer_type
    if kind == "HuggingFaceTokenizer" and not d.tokenizer_model:
        raise ConfigError(
            f"{flag.tokenizer_type} HuggingFaceTokenizer needs {flag.tokenizer_model} PATH (a tokenizer.json)"
        )
    if kind == "NullTokenizer" and not m.vocab_size:
        raise ConfigError(f"{flag.tokenizer_type} NullTokenizer needs {flag.vocab_size}")


def _check_validation_share(d: DataConfig, t: TrainingConfig) -> None:
    """A --split that carves validation data out of the training data gives it a share when the run evaluates."""
    _, valid_share, _ = parse_split(d.split)
    if t.eval_iters != 0 and valid_share == 0 and (d.data_path or d.corpus):
        raise ConfigError(
            f"{flag.split} {d.split} leaves no validation data for {_evaluation(d, t)}; "
            f"give the split a validation share or set {flag.eval_iters} 0"
        )
