"""Export of LoRA adapters to Hugging Face PEFT: `adapter_config.json` + `adapter_model.safetensors`.

The folder loads onto the base model with `peft.PeftModel.from_pretrained(base, folder)`; the
base model is the one the adapters were trained on (e.g. the Hugging Face model the paratron
checkpoint was converted from). Only the adapters are written, under PEFT's names:

    paratron                                   PEFT
    layers.{i}.attention.in_proj.q.lora_a      base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
    layers.{i}.attention.in_proj.q.lora_b      base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight

(the module part of each name is `checkpoint.hf`'s mapping of the layer's weight). Both
compute W x + (lora_alpha / r) B A x, with the same A [r, in] and B [out, r]. The families whose
layers map one to one onto PEFT's target modules only (`checkpoint.hf.PEFT_FAMILIES`: Llama,
Mistral, Qwen2, Qwen3). `write_peft` is the writer `checkpoint.formats` uses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from paratron.checkpoint.converted import Converted, ConvertOptions, Tensors
from paratron.checkpoint.hf import PEFT_FAMILIES, model_type_of, weights_to_hf
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError
from paratron.model.gpt import GPT
from paratron.model.lora import adapted_layers, add_adapters
from paratron.storage import FOLDER_SLACK, new_folder, save_tensors, tensor_bytes

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PARTS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def write_peft(model: Converted, destination: Path, options: ConvertOptions) -> Path:
    """Write the LoRA adapters of a converted model (a paratron checkpoint's) as a PEFT adapter folder."""
    source = model.given or model.path
    m = model.config.model
    if m.lora_rank is None:
        raise CheckpointError(f"{source}: holds no LoRA adapters; train with --lora-rank")
    kind = model_type_of(m, model.hf_model_type)
    if kind not in PEFT_FAMILIES:
        raise CheckpointError(
            f"{source}: a {kind} model; PEFT export supports {', '.join(PEFT_FAMILIES)} models; convert with "
            "--to hf DIR --merge-lora instead, which writes the adapters merged into the base weights"
        )
    with model.open_tensors() as opened:
        tensors, modules = peft_tensors(opened, m, kind)
    _write_folder(destination, tensors, adapter_config(m, modules), options.fix)
    return destination


def checkpoint_layers(model: ModelConfig) -> list[str]:
    """The adapted layers (paratron name prefixes) of a model with LoRA settings, worked out on
    the meta device from the settings alone."""
    assert model.lora_rank is not None
    with torch.device("meta"):
        skeleton = GPT(model)
    add_adapters(skeleton, model.lora_rank, model.lora_alpha, model.lora_targets)  # (kept if already there)
    return adapted_layers(name for name, _ in skeleton.named_parameters())


def peft_tensors(opened: Tensors, model: ModelConfig, kind: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """PEFT's adapter tensors of a model's, and the Hugging Face module names they adapt
    (the last part of each: q_proj, ...), sorted."""
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for layer in checkpoint_layers(model):
        module = hf_module(layer, kind)
        modules.add(module.rsplit(".", 1)[-1])
        for ours, theirs in _PEFT_PARTS.items():
            tensors[f"base_model.model.{module}.{theirs}.weight"] = opened.whole(f"{layer}.{ours}").contiguous()
    return tensors, sorted(modules)


def hf_module(layer: str, kind: str) -> str:
    """The Hugging Face module of paratron layer `layer` (`layers.0.attention.in_proj.q` ->
    `model.layers.0.self_attn.q_proj`), from hf.py's mapping of its weight."""
    (name,) = weights_to_hf({f"{layer}.weight": torch.empty(0)}, kind)
    return name.removesuffix(".weight")


def adapter_config(model: ModelConfig, modules: list[str]) -> dict[str, Any]:
    """PEFT's `LoraConfig` for these adapters (fields PEFT has read since its early versions)."""
    alpha = model.lora_alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "revision": None,
        "inference_mode": True,
        "r": model.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write_folder(destination: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], fix: str) -> None:
    """Write into a temporary folder, then rename it into place: never a half-written folder (a
    full disk removes it and says so in one line)."""
    text = json.dumps(config, indent=2)
    with new_folder("the PEFT adapters", destination, tensor_bytes(tensors) + FOLDER_SLACK, fix) as tmp:
        save_tensors(tensors, tmp / ADAPTER_WEIGHTS, {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(text, encoding="utf-8")
