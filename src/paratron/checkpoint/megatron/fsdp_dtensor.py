"""Megatron-LM's `fsdp_dtensor` format (what Megatron FSDP saves): plain torch.distributed.checkpoint files
(`.metadata` and `__R_0.distcp`, no `metadata.json`) of Megatron FSDP's DTensors, stored as global tensors
under `model.module.NAME` with megatron-core's per-layer names (`decoder.layers.3.NAME`), a SwiGLU
`linear_fc1` split into `weight_w` (gate) and `weight_v` (up), and the run's `args`, `iteration` and
`checkpoint_version` as pickled objects. Read whole without a process group; the model's weights and
counters are read, its optimizer state is not (Megatron FSDP's parameter groups are not recorded in it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from paratron.checkpoint.megatron.unpickle import dcp_reader, safe_load_bytes
from paratron.errors import CheckpointError
from paratron.model.mlp import MLP

FSDP_DTENSOR = "fsdp_dtensor"
_MODEL = re.compile(r"^model\.(?:module\.)*(.+)$")
_SWIGLU = re.compile(rf"^(.+\.{re.escape(MLP.checkpoint_names.megatron_children['in_proj'])}\.(?:weight|bias))_(w|v)$")
"""A SwiGLU MLP's input projection, stored as its gate (`_w`) and up (`_v`) halves."""
_OBJECTS = ("args", "iteration", "checkpoint_version")


def dcp_keys(folder: Path) -> dict[str, Any]:
    """Every entry of a torch.distributed.checkpoint folder's `.metadata` (key -> its storage metadata)."""
    return dict(dcp_reader(folder).read_metadata().state_dict_metadata)


def is_fsdp_dtensor(folder: Path) -> bool:
    """A DCP folder without torch_dist's `metadata.json` whose tensors are Megatron FSDP's `model.` entries."""
    if not (folder / ".metadata").is_file() or (folder / "metadata.json").is_file():
        return False
    return any(key.startswith("model.") for key in dcp_keys(folder))


def fsdp_objects(folder: Path) -> dict[str, Any]:
    """The pickled objects an fsdp_dtensor checkpoint keeps beside its tensors (args, iteration, ...),
    unpickled with the same allow-list as Megatron-LM's other files."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # (start-up speed)

    raw: dict[str, bytes] = {}

    class RawBytes(DefaultLoadPlanner):
        """Keeps each object's bytes for `safe_load_bytes` instead of DCP's unrestricted torch.load."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            raw[read_item.dest_index.fqn] = value.read()

    present = [key for key in _OBJECTS if key in dcp_keys(folder)]
    if present:
        _load(folder, dict.fromkeys(present), RawBytes())
    return {key: safe_load_bytes(data, f"{folder} ({key})") for key, data in raw.items()}


def fsdp_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors under megatron-core's names (one per layer; a SwiGLU fc1's gate and up
    parts joined as megatron-core keeps them, gate first)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # (start-up speed, as above)

    wanted = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in dcp_keys(folder).items()
        if isinstance(meta, TensorStorageMetadata) and _MODEL.match(key) and not key.endswith("_extra_state")
    }
    if not wanted:
        return {}
    _load(folder, wanted, None)
    named = {_MODEL.match(key).group(1): tensor for key, tensor in wanted.items()}  # type: ignore[union-attr]
    halves: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        split = _SWIGLU.match(name)
        if split:
            halves.setdefault(split.group(1), {})[split.group(2)] = tensor
        else:
            out[name] = tensor
    for name, parts in halves.items():
        if set(parts) != {"w", "v"}:
            raise CheckpointError(f"{folder}: {name} has only its {'gate' if 'w' in parts else 'up'} half")
        out[name] = torch.cat([parts["w"], parts["v"]])
    return out


def _load(folder: Path, state: dict[str, Any], planner: Any) -> None:
    import torch.distributed.checkpoint as dcp  # (start-up speed, docs/architecture.md)

    try:
        dcp.load(state, storage_reader=dcp_reader(folder), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # (DCP wraps a reader's failures in its own exception types)
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{folder}: fsdp_dtensor files unreadable ({reason})") from None
