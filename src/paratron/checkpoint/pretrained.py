"""Single-device models (and their tokenizers) from saved checkpoints or Hugging Face directories,
for inference and fine-tuning."""

from __future__ import annotations

from pathlib import Path

import torch

from paratron.checkpoint.hf import model_from_hf
from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint
from paratron.data.tokenizer import Tokenizer
from paratron.model.gpt import GPT


def tokenizer_from_checkpoint(info: CheckpointInfo) -> Tokenizer | None:
    """The tokenizer saved with a checkpoint (None for runs on mock data), with the special tokens
    recorded beside it (those its original folder declared, config.json's ids included)."""
    file = info.path / "tokenizer.json"
    return Tokenizer.from_file(file) if file.is_file() else None


def load_pretrained(path: str | Path, device: torch.device | str = "cpu") -> GPT:
    """The model of a paratron checkpoint (a save directory or one iteration folder) or of a Hugging
    Face model directory (config.json + safetensors, of any family in `checkpoint.hf.FAMILIES`:
    Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE, and the vision-language LLaVA, read by the
    converters' reader of that format, `hf.read_hf_model`), on one device in eval mode; `model(input_ids)` returns
    logits (`model(input_ids, images=pixel_values)` for LLaVA)."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        return model_from_hf(path, device)
    return model_from_checkpoint(read_checkpoint(path), device)
