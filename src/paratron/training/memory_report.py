"""Where a rank's memory goes: training state (`parallel/data_parallel/state_memory.py`) and the activations
autograd keeps for backward, counted exactly.

`SavedActivations` is a saved-tensor hook: every tensor autograd saves during forward passes
through it, so it knows the bytes saved for backward at any moment, and the peak. Each storage
is counted once (views and tensors saved by several operations share it), parameters are not
activations and are left out, and a storage stops counting when autograd lets go of its last
saved reference (after its backward, or when the graph is dropped). Inside recomputed regions
(`parallel/recompute.py`) torch's checkpoint installs its own hook, so what recomputation does
not keep is not seen; the region's inputs, which it does keep, are.

The figures are those of the device-independent model: bytes of tensor storage. On an accelerator the
allocator's peak (`torch.accelerator.max_memory_allocated`) is reported beside them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed.init import peak_memory_bytes
from paratron.distributed.topology import Topology
from paratron.parallel.data_parallel.fully_sharded import is_sharded
from paratron.parallel.data_parallel.state_memory import CATEGORIES, training_state_elements
from paratron.storage import write_text_atomic


class _Saved:
    """What autograd holds instead of a saved tensor; uncounts the storage when dropped."""

    __slots__ = ("tensor", "owner", "key")

    def __init__(self, tensor: torch.Tensor, owner: SavedActivations, key: int) -> None:
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedActivations:
    """Context manager: live and peak bytes of activations saved for backward within it.

    `exclude` are modules whose parameters (and views of them) are not counted."""

    def __init__(self, *exclude: nn.Module) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._params = {
            p.untyped_storage().data_ptr()
            for m in exclude
            for p in m.parameters()
            if not is_sharded(p) and p.device.type != "meta"
        }
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        # (a view of a parameter, such as the transposed weight a matmul keeps, is the parameter:
        # under ZeRO-3 that is FSDP's gathered weight, which it frees after forward and gathers again)
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return tensor
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def rank_memory(
    model: nn.Module, optimizer: Any, activations: SavedActivations | None, device: torch.device
) -> dict[str, Any]:
    """This rank's memory in bytes: each training-state category, the peak of saved activations
    (when measured), their sum, and the allocator's peak on CUDA (None elsewhere)."""
    state = training_state_elements(model, optimizer)
    report: dict[str, Any] = {c: state[c]["bytes"] for c in CATEGORIES}
    report["activations_peak"] = activations.peak if activations is not None else None
    report["total"] = state["total_bytes"] + (activations.peak if activations is not None else 0)
    report["device_peak"] = peak_memory_bytes(device) if device.type != "cpu" else None
    return report


def gather_memory(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's report, in rank order (on all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [report]
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def format_memory(reports: list[dict[str, Any]]) -> list[str]:
    """A table, one line per rank, in MiB (`coordinates` of each report: where the rank sits)."""
    columns = ("parameters", "gradients", "master", "optimizer_state", "activations_peak", "total", "device_peak")
    header = ["rank", "coordinates", "params", "grads", "master", "optim", "activations", "total", "device peak"]
    rows = [
        [str(r), report.get("coordinates", "")] + [_mib(report[c]) for c in columns] for r, report in enumerate(reports)
    ]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header] + rows]


def report_memory(
    report: dict[str, Any],
    topology: Topology,
    run_dir: Path,
    main: bool,
    info: Callable[[str], None],
) -> None:
    """After the first step (when the optimizer state exists): rank 0's training state in one line
    (`report`: this rank's `rank_memory`); when the activations were measured (--log-memory) every
    rank's, in a table and in memory.json. Collective then: every rank calls it."""
    mib = {k: (v or 0) / 2**20 for k, v in report.items()}
    measured = report["activations_peak"] is not None
    info(
        f"memory of rank 0 after the first step: parameters {mib['parameters']:,.1f} MiB, gradients "
        f"{mib['gradients']:,.1f}, master weights {mib['master']:,.1f}, optimizer state "
        f"{mib['optimizer_state']:,.1f}" + (f", activations (peak) {mib['activations_peak']:,.1f}" if measured else "")
    )
    if not measured:
        return
    report["coordinates"] = f"tp{topology.tp_rank} pp{topology.pp_rank} dp{topology.dp_rank}"
    reports = gather_memory(report)
    if main:
        path = run_dir / "memory.json"
        write_text_atomic(path, json.dumps({"unit": "bytes", "ranks": reports}, indent=1) + "\n")
        info("memory per rank after the first step (MiB; activations: peak bytes saved for backward):")
        for line in format_memory(reports):
            info("  " + line)
        info(f"memory report: {path}")
