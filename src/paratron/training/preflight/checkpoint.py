"""The checkpoint a run loads (--load): a directory that holds a complete checkpoint, and whether the run
takes the tokenizer saved with it."""

from __future__ import annotations

from pathlib import Path

from paratron.checkpoint.megatron import check_load
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint
from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_checkpoint_to_load(config: Config) -> CheckpointInfo | None:
    """The checkpoint --load names exists and is complete; its description when it is paratron's own
    (None without --load, or for Megatron-LM's)."""
    load = config.checkpoint.load
    if load is None:
        return None
    if not Path(load).expanduser().is_dir():
        raise ConfigError(f"{flag.load} {load}: no such checkpoint directory; check the path")
    if check_load(Path(load).expanduser(), config.checkpoint.ckpt_format) == "paratron":  # (or Megatron-LM's)
        return read_checkpoint(Path(load).expanduser(), verify=False)
    return None


def uses_saved_tokenizer(config: Config, info: CheckpointInfo | None) -> bool:
    """Whether a run takes the tokenizer saved with the checkpoint it loads: when it fine-tunes from it
    (--sft, --finetune, or a converted model's weights) and the checkpoint has one; a resume builds its
    own (the same one, from the same settings). A tokenizer the run names still comes first (`build_data`)."""
    fine_tuning = info is not None and (config.data.sft or config.checkpoint.finetune or info.weights_only)
    return fine_tuning and (info.path / "tokenizer.json").is_file()
