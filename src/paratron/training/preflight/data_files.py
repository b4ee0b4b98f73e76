"""The data files a run will read, checked before any worker starts: every --data-path entry is a dataset
prefix or text to preprocess (or, with --sft, conversations), and indexes are readable. Errors name the flag
and the file. Megatron-LM's loader flags that paratron refuses or bounds are checked with them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.data.blending import parse_blend
from paratron.data.indexed import IndexedDataset, dataset_exists
from paratron.data.preprocess import input_files
from paratron.data.sft.dataset import sft_dataset_exists
from paratron.errors import ConfigError
from paratron.training.preflight.tokenizer_files import check_tokenizer_files


@dataclasses.dataclass(frozen=True)
class DataKinds:
    """What the data paths hold, which decides what the tokenizer must be: text to tokenize (`raw`, with
    --corpus too) or token ids tokenized already (`preprocessed`)."""

    raw: bool
    preprocessed: bool


def check_data_files(config: Config) -> DataKinds:
    """Raise a ConfigError for the first data path that holds nothing the run can read; what they hold."""
    d = config.data
    raw, preprocessed = bool(d.corpus), False
    for values, blend_flag in d.blend_flags():
        for path in parse_blend(values, blend_flag).paths:
            if d.sft:
                _check_conversations(path, blend_flag)
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
    return DataKinds(raw=raw, preprocessed=preprocessed)


def _check_conversations(path: str, blend_flag: str) -> None:
    """An --sft data path: a .jsonl file of conversations or a preprocessed conversation dataset."""
    if not (sft_dataset_exists(path) or Path(path).is_file()):
        raise ConfigError(
            f"{blend_flag} {path}: neither a .jsonl file of conversations nor a `paratron preprocess "
            "--sft` dataset prefix; check the path"
        )


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
    """Raise a UserError for the first missing or unusable data or tokenizer file of `config`, or a refused
    loader flag; `saved_tokenizer`: the run uses the tokenizer of the checkpoint it loads."""
    kinds = check_data_files(config)
    check_loader_settings(config)
    check_tokenizer_files(config, kinds.raw, kinds.preprocessed, saved_tokenizer)
