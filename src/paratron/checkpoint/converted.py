"""What every converter shares: the model a reader hands a writer (`Converted`), the options of
`paratron convert`, and the few rules all writers keep (a destination that already holds files is
refused; a converted paratron checkpoint carries its recipe in `model.yaml`).

A reader turns a folder of some format into a `Converted`: the paratron configuration, the tensors
under paratron's single-device names (opened on demand, so a writer can take one layer at a time),
and what else the format knows (tokenizer, iteration, optimizer state, the Hugging Face family it
came from). A writer turns a `Converted` into a folder of its format. `checkpoint.formats` holds
the table of both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from paratron.checkpoint.load import weight_catalog
from paratron.checkpoint.save import CONVERT_FIX
from paratron.checkpoint.verify import CheckpointInfo
from paratron.config.loading import build_config, config_to_dict
from paratron.config.schema import Config
from paratron.data.tokenizer import Tokenizer
from paratron.errors import CheckpointError
from paratron.model.gpt import GPT, build_model


@dataclass(frozen=True)
class ConvertOptions:
    """The settings of one conversion; each reader and writer takes those that concern it."""

    merge_lora: bool = False
    """paratron -> Hugging Face: fold LoRA adapters into the base weights."""
    weights_only: bool = False
    """Megatron-LM -> paratron: the weights alone (iteration 0, no optimizer state), for fine-tuning."""
    tensor_parallel: int = 1
    """paratron -> Megatron-LM: the written checkpoint's tensor-parallel size."""
    pipeline_parallel: int = 1
    """paratron -> Megatron-LM: the written checkpoint's pipeline-parallel size."""
    fix: str = CONVERT_FIX
    """What a full disk's line tells the user to do (where the caller chose the destination)."""
    vision_model_path: Path | None = None
    """Hugging Face -> paratron: a vision encoder folder (CLIP or SigLIP) put before the language model read, with
    a new projector: one vision-language model."""
    vision_feature_layer: int | None = None
    """With `vision_model_path`: the encoder layer whose output feeds the projector (default -2, LLaVA's)."""
    vision_feature_select: str | None = None
    """With `vision_model_path`: default (drop CLIP's class token) or full (default: the encoder family's)."""
    vision_projection: str | None = None
    """With `vision_model_path`: the new projector, mlp (default) or affine."""


class Tensors(Protocol):
    """Tensors under paratron's single-device names, each read whole when asked for."""

    def names(self) -> list[str]: ...

    def whole(self, name: str) -> torch.Tensor: ...


class StateTensors:
    """Tensors a reader already holds in memory."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def names(self) -> list[str]:
        return list(self.state)

    def whole(self, name: str) -> torch.Tensor:
        return self.state[name]


class CheckpointTensors:
    """The weights of a paratron checkpoint, assembled from their stored boxes one tensor at a time."""

    def __init__(self, catalog: Any) -> None:
        self.catalog = catalog

    def names(self) -> list[str]:
        return list(self.catalog.boxes)

    def whole(self, name: str) -> torch.Tensor:
        return self.catalog.whole(name)


@contextlib.contextmanager
def checkpoint_tensors(info: CheckpointInfo) -> Iterator[Tensors]:
    """Open a paratron checkpoint's weights (their files stay open until the `with` ends)."""
    with weight_catalog(info) as catalog:
        yield CheckpointTensors(catalog)


def in_memory(state: dict[str, torch.Tensor]) -> Callable[[], contextlib.AbstractContextManager[Tensors]]:
    """The opener of tensors a reader has already read."""
    return lambda: contextlib.nullcontext(StateTensors(state))


@dataclass
class Converted:
    """A model as a reader found it, for a writer: configuration, tensors under paratron's
    single-device names, and the facts of its source a writer carries over."""

    path: Path
    """The folder read (one iteration folder for a checkpoint); messages name it."""
    config: Config
    open_tensors: Callable[[], contextlib.AbstractContextManager[Tensors]]
    given: Path | None = None
    """The path the user gave, where a message names it rather than the folder found there."""
    tokenizer: Tokenizer | None = None
    """The tokenizer read with the model (a Hugging Face folder's), saved with a paratron checkpoint."""
    tokenizer_file: Path | None = None
    """The source's tokenizer.json, if any (what other formats export, and its size)."""
    hf_model_type: str | None = None
    """The Hugging Face family the model came from, if any (kept for the way back)."""
    iteration: int = 0
    consumed_samples: int = 0
    optimizer: dict[str, dict[str, torch.Tensor]] | None = None
    """Adam's state by paratron state name (exp_avg, exp_avg_sq, master) -> {paratron name: tensor}."""
    optimizer_step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    """What a paratron checkpoint of it records in meta.json about where it came from."""

    @property
    def weights_only(self) -> bool:
        return bool(self.meta.get("weights_only", True))


def refuse_existing(destination: Path) -> None:
    """Every conversion writes a new folder: one that already holds files is never overwritten."""
    if destination.exists() and any(destination.iterdir()):
        raise CheckpointError(f"{destination}: already exists and is not empty; choose a new directory")


def config_from_settings(settings: dict[str, Any]) -> Config:
    """The paratron configuration of a converted model's settings (its data mock: a conversion has none)."""
    return build_config(dict(settings, mock_data=True))


def model_recipe(config: Config) -> dict[str, Any]:
    """The model section of a converted checkpoint's config, for `model.yaml`."""
    return {"model": {k: v for k, v in config_to_dict(config)["model"].items() if v is not None}}


def write_recipe(folder: Path, config: Config) -> None:
    """`model.yaml` beside a converted checkpoint: a recipe with the model's shape."""
    (folder / "model.yaml").write_text(yaml.safe_dump(model_recipe(config), sort_keys=False), encoding="utf-8")


def build_converted(model: Converted, device: torch.device | str = "cpu") -> GPT:
    """A single-device paratron model holding a reader's tensors."""
    built = build_model(model.config.model, device)
    with model.open_tensors() as tensors, torch.no_grad():
        for name, param in built.named_parameters():  # (a tied output weight is the embedding's)
            param.copy_(tensors.whole(name))
    return built


def file_bytes(path: Path | None) -> int:
    """The size of a file that a conversion copies (0 when there is none)."""
    return path.stat().st_size if path is not None and path.is_file() else 0
