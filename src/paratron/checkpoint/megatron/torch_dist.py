"""Megatron-LM's `torch_dist` format: torch.distributed.checkpoint files of global tensors under
Megatron's sharded names (`metadata.json` saying `torch_dist`), read whole without a process group;
a layer's tensors are stacked over the layers (`decoder.layers.NAME` [layers, ...]).
"""

from __future__ import annotations

import re

import torch

from paratron.checkpoint.megatron.locate import MegatronCheckpoint
from paratron.checkpoint.megatron.tensor_layout import to_paratron
from paratron.checkpoint.megatron.unpickle import dcp_reader
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError

_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")


def dist_tensors(ckpt: MegatronCheckpoint, prefix: str = "") -> dict[str, torch.Tensor]:
    """Whole tensors of a torch_dist checkpoint whose keys start with `prefix` (and, for the
    model, are not optimizer entries), read without a process group."""
    import torch.distributed.checkpoint as dcp  # (start-up speed, docs/architecture.md)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # (start-up speed, docs/architecture.md)

    reader = dcp_reader(ckpt.folder)
    metadata = reader.read_metadata()
    wanted = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
        and key.startswith(prefix)
        and (prefix or not key.startswith("optimizer."))
        and not key.endswith("_extra_state")
    }
    if not wanted:
        return {}
    try:
        dcp.load(wanted, storage_reader=dcp_reader(ckpt.folder), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # (DCP wraps a reader's failures in its own exception types)
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{ckpt.folder}: torch_dist files unreadable ({reason})") from None
    return wanted


def dist_shapes(ckpt: MegatronCheckpoint, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The shapes `dist_tensors` would read (layers unstacked), from the metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # (start-up speed, docs/architecture.md)

    out: dict[str, tuple[int, ...]] = {}
    for key, meta in dcp_reader(ckpt.folder).read_metadata().state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not key.startswith(prefix) or key.endswith("_extra_state"):
            continue
        if not prefix and key.startswith("optimizer."):
            continue
        stacked = _STACKED.match(key)
        if stacked:
            out.update({f"decoder.layers.{i}.{stacked.group(1)}": tuple(meta.size)[1:] for i in range(meta.size[0])})
        else:
            out[key] = tuple(meta.size)
    return out


def dist_chunk_bounds(ckpt: MegatronCheckpoint, prefix: str) -> dict[str, set[int]]:
    """Where the saved pieces of each flat (1-D) tensor under `prefix` begin and end, from the metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # (start-up speed, docs/architecture.md)

    out: dict[str, set[int]] = {}
    for key, meta in dcp_reader(ckpt.folder).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and key.startswith(prefix) and len(meta.size) == 1:
            out[key] = {b for c in meta.chunks for b in (c.offsets[0], c.offsets[0] + c.sizes[0])}
    return out


def unstack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch_dist keeps a layer's tensors stacked over layers (`decoder.layers.NAME` [layers, ...])."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        stacked = _STACKED.match(key)
        if stacked:
            for i, layer in enumerate(tensor):
                out[f"decoder.layers.{i}.{stacked.group(1)}"] = layer.contiguous()
        else:
            out[key] = tensor
    return out


def dist_weights(ckpt: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    """The model's tensors of a torch_dist checkpoint, one per layer (Megatron's names)."""
    return unstack(dist_tensors(ckpt))


_OPTIMIZER_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "master"}


def dist_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam's moments and the fp32 masters of a torch_dist checkpoint saved with a reshardable
    optimizer format (`optimizer.state.STATE.KEY`), as paratron state name -> {paratron name: tensor};
    None when the checkpoint has none in that form."""
    found = dist_tensors(ckpt, "optimizer.state.")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for megatron_state, ours in _OPTIMIZER_STATES.items():
        prefix = f"optimizer.state.{megatron_state}."
        part = {key[len(prefix) :]: t for key, t in found.items() if key.startswith(prefix)}
        if part:
            out[ours] = to_paratron(unstack(part), m, str(ckpt.folder))
    if "exp_avg" not in out or "exp_avg_sq" not in out:
        return None
    common = ckpt.common.get("optimizer")
    step = common.get("state", {}).get("common_step") if isinstance(common, dict) else None  # (megatron-core's)
    out["step"] = {"common_step": torch.as_tensor(step).reshape(1).float()} if step is not None else {}
    return out
