"""Writing a Hugging Face model directory: config.json, the weights in Hugging Face's sharded
safetensors layout (one layer at a time: never the whole model in memory), and tokenizer.json with
the special tokens' ids config.json names. `write_hf` is the writer `checkpoint.formats` uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from paratron.checkpoint.converted import Converted, ConvertOptions, file_bytes
from paratron.checkpoint.hf.families import PEFT_FAMILIES
from paratron.checkpoint.hf.settings import hf_config, model_type_of
from paratron.checkpoint.hf.weights import weights_to_hf
from paratron.config.schema import ModelConfig
from paratron.data.tokenizer import export_tokenizer
from paratron.errors import CheckpointError
from paratron.model.gpt import GPT
from paratron.model.lora import is_adapter, merge_adapters
from paratron.storage import FOLDER_SLACK, new_folder, save_tensors


def write_hf(model: Converted, destination: Path, options: ConvertOptions) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer.json if any) of a
    converted model; LoRA adapters are merged into the base weights when the options say
    `merge_lora` (without it such a model is refused)."""
    m = model.config.model
    kind = model_type_of(m, model.hf_model_type)
    if m.lora_rank is not None and not options.merge_lora:
        alone = ", or convert with --to peft DIR to write the adapters alone" if kind in PEFT_FAMILIES else ""
        raise CheckpointError(
            f"{model.path}: holds LoRA adapters; add --merge-lora to write them merged into the base weights{alone}"
        )
    needed = _export_bytes(m) + file_bytes(model.tokenizer_file) + FOLDER_SLACK
    with new_folder(HF_MODEL, destination, needed, options.fix) as tmp:
        with model.open_tensors() as tensors, ShardWriter(tmp) as writer:
            for names in _layer_groups(m):  # one layer at a time: never the whole model in memory
                state = {name: tensors.whole(name).float() for name in names}  # (config.json says float32)
                if m.lora_rank is not None:
                    state = merge_adapters(state, m.lora_alpha, m.lora_rank)
                for hf_name, tensor in weights_to_hf(state, kind).items():
                    writer.add(hf_name, tensor)
        exported = model.tokenizer_file is not None
        token_ids = export_tokenizer(model.tokenizer_file.parent, tmp) if exported else {}
        config = {**hf_config(m, kind), **token_ids}  # (else transformers assumes its own ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return destination


HF_MODEL = "the Hugging Face model"
"""What a full disk's line says the conversion to Hugging Face was writing."""


def _export_bytes(m: ModelConfig) -> int:
    """The bytes of model `m`'s weights in float32, as `write_hf` writes them (adapters merged)."""
    with torch.device("meta"):
        sizes = [p.numel() for name, p in GPT(m).named_parameters() if not is_adapter(name)]
    return 4 * sum(sizes)


MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's usual largest weights file (`save_pretrained`'s max_shard_size="5GB")."""


def _layer_groups(config: ModelConfig) -> list[list[str]]:
    """The single-device parameter names of a model, one list per transformer layer (what one
    exported tensor may combine: fused q/k/v, LoRA adapters), and one per other tensor."""
    with torch.device("meta"):
        names = [name for name, _ in GPT(config).named_parameters()]  # (a tied output weight is the embedding's)
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = re.match(r"layers\.\d+\.", name)
        groups.setdefault(layer.group(0) if layer else name, []).append(name)
    return list(groups.values())


class ShardWriter:
    """Hugging Face's sharded weights layout, written as tensors arrive: a file each time
    `MAX_SHARD_BYTES` fill up, named model-0000K-of-0000N.safetensors with
    model.safetensors.index.json once N is known (model.safetensors when one file holds all)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.max_bytes = folder, MAX_SHARD_BYTES
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        save_tensors(self.pending, self.folder / f"part-{len(self.files):05d}.safetensors", {"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.size = {}, 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, error: object, *_: object) -> None:
        if error is not None:
            return
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            (self.folder / "part-00000.safetensors").replace(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.folder / f"part-{i:05d}.safetensors").replace(self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
