"""Megatron-LM's reader for `checkpoint.formats`: a checkpoint of any format it reads (legacy `torch`,
`torch_dist`, `fsdp_dtensor`) as a converted model: its weights under paratron's names, checked against what its args
describe, and (unless only the weights are wanted) its iteration, consumed samples and Adam's state.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paratron.checkpoint.converted import Converted, ConvertOptions, in_memory
from paratron.checkpoint.megatron.distrib_optim import (
    dp_reshardable_optimizer,
    has_distrib_optim,
    legacy_distributed_optimizer,
)
from paratron.checkpoint.megatron.fsdp_dtensor import FSDP_DTENSOR, fsdp_weights
from paratron.checkpoint.megatron.legacy import legacy_optimizer, legacy_weights
from paratron.checkpoint.megatron.locate import MegatronCheckpoint, open_megatron
from paratron.checkpoint.megatron.settings import config_of
from paratron.checkpoint.megatron.tensor_layout import to_paratron
from paratron.checkpoint.megatron.torch_dist import dist_optimizer, dist_weights
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError
from paratron.model.gpt import GPT


def read_megatron(source: Path, options: ConvertOptions) -> Converted:
    """A Megatron-LM checkpoint (a save directory or one iteration folder) as a converted model."""
    ckpt = open_megatron(source)
    config = config_of(ckpt.args, f"{ckpt.folder} args")
    state = megatron_weights(ckpt, config.model)
    optimizer = None if options.weights_only else megatron_optimizer(ckpt, config.model)
    params = _check_weights(ckpt, config.model, state)
    if optimizer is not None:
        lacking = [name for name in params if name not in optimizer["exp_avg"]]
        if lacking:
            raise CheckpointError(f"{ckpt.folder}: its optimizer state lacks {lacking[0]}; convert with --finetune")
    weights_only = options.weights_only
    return Converted(
        path=ckpt.folder,
        config=config,
        open_tensors=in_memory(state),
        given=source,
        iteration=0 if weights_only else ckpt.iteration,
        consumed_samples=0 if weights_only else ckpt.consumed_samples,
        optimizer=optimizer,
        optimizer_step=_optimizer_step(ckpt, optimizer.get("step", {})) if optimizer is not None else 0,
        meta={"weights_only": weights_only, "megatron_source": str(ckpt.folder), "megatron_format": ckpt.format},
    )


def megatron_weights(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under paratron's single-device names."""
    if ckpt.format == FSDP_DTENSOR:
        merged = fsdp_weights(ckpt.folder)
    else:
        merged = legacy_weights(ckpt) if ckpt.format == "torch" else dist_weights(ckpt)
    if not merged:
        raise CheckpointError(f"{ckpt.folder}: holds no model weights")
    return to_paratron(merged, m, str(ckpt.folder))


def megatron_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam's state of either format, from either optimizer, under paratron's names (None when the
    checkpoint has none it can read; fsdp_dtensor's optimizer state is not read)."""
    if ckpt.format == FSDP_DTENSOR:
        return None
    if ckpt.format == "torch":
        return legacy_distributed_optimizer(ckpt, m) if has_distrib_optim(ckpt) else legacy_optimizer(ckpt, m)
    return dist_optimizer(ckpt, m) or dp_reshardable_optimizer(ckpt, m)


def _check_weights(ckpt: MegatronCheckpoint, m: ModelConfig, state: dict[str, torch.Tensor]) -> list[str]:
    """Refuse weights that are not those of the model the args describe; the model's parameter names."""
    with torch.device("meta"):
        params = dict(GPT(m).named_parameters())  # (a tied output weight is the embedding's)
    missing = sorted(set(params) - set(state))
    if missing:
        raise CheckpointError(f"{ckpt.folder}: has no tensor for {missing[0]}; its args and weights disagree")
    for name, param in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"{ckpt.folder}: {name} has shape {list(state[name].shape)} but its args give "
                f"{list(param.shape)}; the checkpoint's args and weights disagree"
            )
    return list(params)


def _optimizer_step(ckpt: MegatronCheckpoint, steps: dict[str, torch.Tensor]) -> int:
    """Adam's step count: what the saved optimizer state records, else the iteration."""
    values = [int(t.reshape(-1)[0]) for t in steps.values() if t.numel()]
    return max(values) if values else ckpt.iteration
