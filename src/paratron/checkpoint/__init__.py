"""Checkpoints: atomic save, verified load, weights under their single-device names."""

from paratron.checkpoint.load import load_model_weights, load_training_state, model_from_checkpoint
from paratron.checkpoint.pretrained import load_pretrained, tokenizer_from_checkpoint
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint

__all__ = [
    "CheckpointContent",
    "CheckpointInfo",
    "load_model_weights",
    "load_training_state",
    "read_checkpoint",
    "save_checkpoint",
    "load_pretrained",
    "model_from_checkpoint",
    "tokenizer_from_checkpoint",
]
