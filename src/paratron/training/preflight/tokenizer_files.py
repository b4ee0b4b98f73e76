"""The tokenizer's files exist and suit the data: each file tokenizer has its file, GPT-2's BPE both of its,
and a tokenizer trained on the run's text is never asked to read data tokenized by another."""

from __future__ import annotations

from pathlib import Path

from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.errors import ConfigError

FILE_TOKENIZERS = {
    "GPTSentencePieceTokenizer": "a SentencePiece .model file",
    "Llama2Tokenizer": "a SentencePiece .model file",
    "TikTokenizer": "Megatron's tiktoken vocabulary .json",
}


def check_tokenizer_files(config: Config, raw: bool, preprocessed: bool, saved_tokenizer: bool = False) -> None:
    """Raise a ConfigError for the first missing tokenizer file or a tokenizer that cannot read the data
    (`raw`: some of it is text, `preprocessed`: some of it is token ids; `saved_tokenizer`: the run uses the
    tokenizer of the checkpoint it loads)."""
    _check_file_tokenizer(config)
    d, kind = config.data, config.data.resolved_tokenizer_type
    if kind == "HuggingFaceTokenizer" and d.tokenizer_model:
        model = Path(d.tokenizer_model).expanduser()
        if not (model.is_file() or (model / "tokenizer.json").is_file()):
            raise ConfigError(f"{flag.tokenizer_model} {d.tokenizer_model}: no tokenizer.json there; check the path")
    elif kind == "GPT2BPETokenizer":
        _check_gpt2_files(config)
    elif kind == "ByteLevelBPE" and d.sft and not config.checkpoint.load:
        raise ConfigError(
            f"{flag.sft} needs an existing tokenizer: {flag.load} a checkpoint saved with one, or give "
            f"{flag.tokenizer_type} HuggingFaceTokenizer {flag.tokenizer_model} PATH"
        )
    elif (
        kind == "ByteLevelBPE" and not d.sft and (preprocessed or (not raw and not d.mock_data)) and not saved_tokenizer
    ):
        raise ConfigError(
            f"{flag.tokenizer_type} ByteLevelBPE trains on text, but (some of) the data is "
            f"preprocessed already; name its tokenizer: HuggingFaceTokenizer {flag.tokenizer_model}, "
            f"GPT2BPETokenizer {flag.vocab_file}/{flag.merge_file}, or NullTokenizer {flag.vocab_size}"
        )


def _check_file_tokenizer(config: Config) -> None:
    """A SentencePiece or tiktoken tokenizer has its file; special tokens are TikTokenizer's setting."""
    d, kind = config.data, config.data.resolved_tokenizer_type
    if kind in FILE_TOKENIZERS:
        what = FILE_TOKENIZERS[kind]
        if not d.tokenizer_model:
            raise ConfigError(f"{flag.tokenizer_type} {kind} needs {flag.tokenizer_model} PATH ({what})")
        if not Path(d.tokenizer_model).expanduser().is_file():
            raise ConfigError(f"{flag.tokenizer_model} {d.tokenizer_model}: no such file ({what} for {kind})")
        if kind == "TikTokenizer" and d.legacy_tokenizer and d.tiktoken_pattern is None:
            raise ConfigError(f"{flag.legacy_tokenizer} with TikTokenizer needs {flag.tiktoken_pattern} v1 or v2")
    if d.tokenizer_special_tokens and kind != "TikTokenizer":
        image = f" (to give it an image token <image>, use {flag.add_image_token})" if config.model.has_vision else ""
        raise ConfigError(
            f"{flag.tokenizer_special_tokens} applies to TikTokenizer only here; remove it for {kind}{image}"
        )


def _check_gpt2_files(config: Config) -> None:
    """GPT-2's BPE reads two files, vocab.json and merges.txt."""
    d = config.data
    for value, file_flag, name in (
        (d.vocab_file, flag.vocab_file, "vocab.json"),
        (d.merge_file, flag.merge_file, "merges.txt"),
    ):
        if not value:
            raise ConfigError(f"GPT2BPETokenizer needs {file_flag} (GPT-2's {name}) as well")
        if not Path(value).expanduser().is_file():
            raise ConfigError(f"{file_flag} {value}: no such file (GPT-2's {name} for GPT2BPETokenizer)")
