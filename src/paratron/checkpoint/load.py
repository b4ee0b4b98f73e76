"""Loading a verified training checkpoint: its weights into a model (each rank reading only the boxes it
holds, whatever layout wrote them), one tensor whole, a rank's random-generator and loss-scaler state.
Older checkpoints (whole tensors per pipeline stage) and converted ones load the same way.
Loading never unpickles arbitrary objects: safetensors and `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from paratron.checkpoint.files import WEIGHTS, WEIGHTS_INDEX, rank_state_file
from paratron.checkpoint.gather import persistent_buffers
from paratron.checkpoint.grow import NEW_PARTS, fill_grown, grows
from paratron.checkpoint.pieces import Catalog
from paratron.checkpoint.verify import CheckpointInfo
from paratron.distributed.topology import Axis, Topology
from paratron.errors import CheckpointError
from paratron.model.gpt import GPT, build_model
from paratron.model.lora import is_adapter
from paratron.parallel.data_parallel.fully_sharded import held_boxes, local_tensor
from paratron.parallel.sharding import full_shape, param_info, whole_box


def weight_catalog(info: CheckpointInfo) -> Catalog:
    """Every stored box of the checkpoint's weights (close it, or use it in a `with`)."""
    index = info.path / WEIGHTS_INDEX
    if index.is_file():
        try:
            record = json.loads(index.read_text(encoding="utf-8"))
            return Catalog(info.path, dict(record["weight_map"]), record.get("shapes"))
        except (ValueError, KeyError):
            raise CheckpointError(f"{index}: unreadable; the checkpoint is damaged") from None
    if not (info.path / WEIGHTS).is_file():
        raise CheckpointError(f"{info.path}: holds no weights (neither {WEIGHTS} nor {WEIGHTS_INDEX}); it is damaged")
    with Catalog(info.path, {}) as probe:
        keys = list(probe.handle(WEIGHTS).keys())
    return Catalog(info.path, {key: WEIGHTS for key in keys})


@torch.no_grad()
def load_model_weights(info: CheckpointInfo, model: nn.Module, whole: bool = True, grow: bool = False) -> None:
    """Copy the checkpoint's weights into `model` (or, whole=False, this rank's pipeline stage of
    it), each rank reading only the boxes it holds (`fully_sharded.held_boxes`) from the files,
    whatever layout wrote them; refuses a checkpoint of another shape. A text checkpoint leaves a
    vision model's encoder and projector as initialized, and `grow` (--add-image-token) lets the
    vocabulary have more rows than the checkpoint's (`checkpoint.grow`)."""
    expected = dict(model.named_parameters())
    buffers = persistent_buffers(model)
    with weight_catalog(info) as catalog:
        for name, buffer in buffers.items():  # (a checkpoint without them, a converted one, leaves them at zero)
            if name in catalog:
                catalog.fill(name, buffer, [(whole_box(buffer.shape), whole_box(buffer.shape))])
        if not any(is_adapter(name) for name in catalog.boxes):  # a base model for LoRA: new adapters keep their init
            expected = {name: param for name, param in expected.items() if not is_adapter(name)}
        if not info.config.model.has_vision:  # a text model gaining an encoder and projector: they keep their init
            expected = {name: param for name, param in expected.items() if not name.startswith(NEW_PARTS)}
        for name in expected:
            if name not in catalog:
                raise CheckpointError(f"{info.path}: has no tensor {name}; it belongs to a different model")
        extra = set(catalog.boxes) - set(expected) - set(buffers)
        if whole and extra:
            raise CheckpointError(
                f"{info.path}: has tensors this model lacks ({sorted(extra)[0]}, ...); it belongs to a different model"
            )
        for name, param in expected.items():
            shape = catalog.shapes[name]
            local = local_tensor(param)
            record = param_info(param)
            if record.shard is not None or record.expert_shard is not None:
                local.zero_()  # (padding: in no box)
            if shape != full_shape(param):
                if not (grow and grows(name, shape, full_shape(param))):
                    raise CheckpointError(_shape_mismatch(info, name, shape, full_shape(param)))
                fill_grown(catalog, name, local, held_boxes(param))
                continue
            catalog.fill(name, local, held_boxes(param))


def _shape_mismatch(info: CheckpointInfo, name: str, saved: tuple[int, ...], wanted: tuple[int, ...]) -> str:
    """The one line that refuses a tensor of another shape, naming --add-image-token where it is the fix."""
    line = f"{info.path}: {name} has shape {list(saved)} there but {list(wanted)} in this model"
    if grows(name, saved, wanted):
        return (
            f"{line}: the tokenizer has {wanted[0] - saved[0]} token(s) more than the checkpoint's vocabulary; add "
            "--add-image-token with --finetune (and a --vision-model) to grow it, the new rows the mean of the old, "
            "or use the checkpoint's own tokenizer"
        )
    return f"{line}; use the same model settings"


def load_training_state(checkpoint: CheckpointInfo, topology: Topology) -> tuple[dict[str, Any], bool]:
    """The saved RNG and loss-scaler state for this rank, and whether it is this rank's own (the
    checkpoint has the same tensor- and pipeline-parallel layout). At another layout it is the
    first rank's: its loss scaler and counters apply, its random-generator states do not."""
    saved = checkpoint.config.parallel
    pp_size = topology.size(Axis.PP)
    same = (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (topology.size(Axis.TP), pp_size)
    name = (
        rank_state_file(topology.tp_rank, topology.pp_rank, pp_size)
        if same
        else rank_state_file(0, 0, saved.pipeline_model_parallel_size)
    )
    return torch.load(checkpoint.path / name, map_location="cpu", weights_only=True), same


def read_weight(info: CheckpointInfo, name: str) -> torch.Tensor:
    """One single-device tensor of the checkpoint's weights, assembled from its stored boxes."""
    with weight_catalog(info) as catalog:
        return catalog.whole(name)


def model_from_checkpoint(checkpoint: CheckpointInfo, device: torch.device | str = "cpu") -> GPT:
    """The single-device model of a checkpoint, in eval mode."""
    model = build_model(checkpoint.config.model, device, seed=checkpoint.config.training.seed)
    load_model_weights(checkpoint, model)
    return model.eval()
