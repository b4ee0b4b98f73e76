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


def check_data_inputs(config: Config) -> None:
    """Raise a UserError for the first missing or unusable data or tokenizer file of `config`."""
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
    kind = d.tokenizer_type
    if kind == "HuggingFaceTokenizer" and d.tokenizer_model:
        model = Path(d.tokenizer_model).expanduser()
        if not (model.is_file() or (model / "tokenizer.json").is_file()):
            raise ConfigError(f"{flag.tokenizer_model} {d.tokenizer_model}: no tokenizer.json there; check the path")
    elif kind == "GPT2BPETokenizer":
        for value, file_flag, name in (
            (d.vocab_file, flag.vocab_file, "vocab.json"),
            (d.merge_file, flag.merge_file, "merges.txt"),
        ):
            if not value or not Path(value).expanduser().is_file():
                raise ConfigError(
                    f"{flag.tokenizer_type} GPT2BPETokenizer needs {file_flag} (GPT-2's {name}); got {value}"
                )
    elif kind == "ByteLevelBPE" and d.sft and not config.checkpoint.load:
        raise ConfigError(
            f"{flag.sft} needs an existing tokenizer: {flag.load} a checkpoint saved with one, or give "
            f"{flag.tokenizer_type} HuggingFaceTokenizer {flag.tokenizer_model} PATH"
        )
    elif kind == "ByteLevelBPE" and not d.sft and (preprocessed or (not raw and not d.mock_data)):
        raise ConfigError(
            f"{flag.tokenizer_type} ByteLevelBPE trains on text, but (some of) the data is "
            f"preprocessed already; name its tokenizer: HuggingFaceTokenizer {flag.tokenizer_model}, "
            f"GPT2BPETokenizer {flag.vocab_file}/{flag.merge_file}, or NullTokenizer {flag.vocab_size}"
        )
