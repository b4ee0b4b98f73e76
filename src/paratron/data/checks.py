"""The data files a run will read, checked before any worker starts: every --data-path entry is
a dataset prefix or text to preprocess, indexes are readable, and the tokenizer's files exist
and suit the data. Errors name the flag and the file."""

from __future__ import annotations

from pathlib import Path

from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.data.blending import parse_blend
from paratron.data.indexed import IndexedDataset, dataset_exists
from paratron.data.preprocess import input_files
from paratron.data.sft.dataset import sft_dataset_exists
from paratron.errors import ConfigError

FILE_TOKENIZERS = {
    "GPTSentencePieceTokenizer": "a SentencePiece .model file",
    "Llama2Tokenizer": "a SentencePiece .model file",
    "TikTokenizer": "Megatron's tiktoken vocabulary .json",
}


def check_loader_settings(config: Config) -> None:
    """Megatron-LM's data-loader flags paratron refuses or bounds, each by name."""
    d = config.data
    if d.num_workers < 0:
        raise ConfigError(f"{flag.num_workers} {d.num_workers}: must be 0 (read in the training process) or more")
    if d.dataloader_type == "external":
        raise ConfigError(
            f"{flag.dataloader_type} external hands Megatron-LM a loader built in Python by the user's own script; "
            "paratron builds its loader from the flags: use single or cyclic"
        )
    if d.vocab_extra_ids:
        raise ConfigError(
            f"{flag.vocab_extra_ids} {d.vocab_extra_ids}: sentinel tokens are for Megatron-LM's T5 and BERT span "
            "masking, which paratron (GPT models) does not train; remove it"
        )


def check_data_inputs(config: Config, saved_tokenizer: bool = False) -> None:
    """Raise a UserError for the first missing or unusable data or tokenizer file of `config`;
    `saved_tokenizer`: the run uses the tokenizer of the checkpoint it loads (`training.run`)."""
    d = config.data
    raw, preprocessed = bool(d.corpus), False
    for values, blend_flag in d.blend_flags():
        for path in parse_blend(values, blend_flag).paths:
            if d.sft:
                if not (sft_dataset_exists(path) or Path(path).is_file()):
                    raise ConfigError(
                        f"{blend_flag} {path}: neither a .jsonl file of conversations nor a `paratron preprocess "
                        "--sft` dataset prefix; check the path"
                    )
            elif dataset_exists(path):
                IndexedDataset(path)  # reads and checks the index
                preprocessed = True
            elif Path(path).exists():
                input_files([path], blend_flag)
                raw = True
            else:
                raise ConfigError(
                    f"{blend_flag} {path}: neither a dataset prefix ({path}.bin/.idx) nor a file or "
                    "directory; check the path"
                )
    check_loader_settings(config)
    kind = d.resolved_tokenizer_type
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
    if kind == "HuggingFaceTokenizer" and d.tokenizer_model:
        model = Path(d.tokenizer_model).expanduser()
        if not (model.is_file() or (model / "tokenizer.json").is_file()):
            raise ConfigError(f"{flag.tokenizer_model} {d.tokenizer_model}: no tokenizer.json there; check the path")
    elif kind == "GPT2BPETokenizer":
        for value, file_flag, name in (
            (d.vocab_file, flag.vocab_file, "vocab.json"),
            (d.merge_file, flag.merge_file, "merges.txt"),
        ):
            if not value:
                raise ConfigError(f"GPT2BPETokenizer needs {file_flag} (GPT-2's {name}) as well")
            if not Path(value).expanduser().is_file():
                raise ConfigError(f"{file_flag} {value}: no such file (GPT-2's {name} for GPT2BPETokenizer)")
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
