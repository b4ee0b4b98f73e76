"""What the training state occupies on this rank: parameters, gradients, master weights and
optimizer state, counted exactly from the tensors that hold them.

The figures are meant to be set beside the ZeRO paper's model (Rajbhandari et al., 2020): with
psi parameters and N data-parallel ranks, mixed-precision Adam needs 16 psi bytes per rank under
plain data parallelism, 4 psi + 12 psi/N at stage 1, 2 psi + 14 psi/N at stage 2 and 16 psi/N
at stage 3. `training_state_elements` counts what this rank really holds; `paper_bytes` prices
those element counts at the paper's widths, so a layout can be checked against the formulas
whatever dtype it trains in.

Two rules keep the count honest:

- Storage is counted once. A tensor's bytes are those of its whole storage (what the allocator
  gave out, padding included), charged to the first category that meets it; a view of storage
  already counted adds no bytes. This is how the fp32 master weights of the distributed optimizer
  (views into the flat parameter buffer) and the gradients of plain data parallelism (views into
  the gradient buffer) are seen to cost nothing extra.
- Primary holders always count their elements: the flat parameter buffer, the reducer's
  gradient buffer or shard, the optimizer's parameters (its master weights) and its state.
  Secondary tensors (each `param.grad`, a master's `.grad`, a bucket's transient buffer) count
  only if their storage is new, so a gradient or bucket buffer left alive by mistake shows up
  and a view of a buffer is not counted twice.

It only reads attributes and storage pointers (on the meta device, storage identities: the
same count runs on a model `paratron train --dry-run` built there): cheap (one pass over the parameters and the
optimizer state), no collectives, no allocation, safe to call at any point of a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paratron.parallel.data_parallel.fully_sharded import local_tensor
from paratron.parallel.model import ParallelModel

CATEGORIES = ("parameters", "gradients", "master", "optimizer_state")

PAPER_WIDTHS = {"parameters": 2, "gradients": 2, "master": 4, "optimizer_state": 4}
"""Bytes per element in the ZeRO paper's mixed-precision Adam: fp16 parameters and gradients, fp32
master weights, and two fp32 moments per parameter (8 bytes per parameter = 2 state elements x 4)."""


class _Ledger:
    """Per-category element and byte counts, with each storage charged once."""

    def __init__(self) -> None:
        self.counts = {c: {"elements": 0, "bytes": 0} for c in CATEGORIES}
        self._seen: set[int] = set()

    def add(self, category: str, tensors: Iterable[torch.Tensor | None], primary: bool = True) -> None:
        for tensor in tensors:
            if tensor is None:
                continue
            local = local_tensor(tensor.detach())
            storage = local.untyped_storage()
            key = _storage_key(storage)
            new = storage.nbytes() > 0 and key not in self._seen
            if new:
                self._seen.add(key)
            if primary or new:
                self.counts[category]["elements"] += local.numel()
                self.counts[category]["bytes"] += storage.nbytes() if new else 0


def _storage_key(storage: torch.UntypedStorage) -> int:
    """What identifies a storage: its address, or on the meta device (which has none: `--dry-run`
    builds there) the storage object that views share."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors the optimizer updates: the distributed optimizer's masters, or the parameters."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def training_state_elements(model: nn.Module, optimizer: Any | None = None) -> dict[str, Any]:
    """This rank's training state: {category: {"elements", "bytes"}} for `CATEGORIES`, and
    "total_bytes". `model` is what `parallelize` returned (or any module); `optimizer` the one
    built for it (`paratron.optim.build.build_optimizer`, or any torch optimizer), or None before
    it exists.

    parameters: the flat parameter buffer under ZeRO 1/2 (padding included), FSDP2's local shards
    under ZeRO 3, the parameters otherwise. gradients: the reducer's full buffer (DDP, ZeRO 1) or
    persistent shard (ZeRO 2) and any bucket buffer still alive; FSDP2's local gradient shards.
    master: the tensors the optimizer steps (views of fp32 parameters: elements, no bytes; fp32
    copies of 16-bit ones). optimizer_state: every tensor in `optimizer.state` but the `step` counters."""
    ledger = _Ledger()
    params = list(model.parameters())
    parallel = model if isinstance(model, ParallelModel) else None
    flats = parallel.flat_parameters if parallel is not None else []
    ledger.add("parameters", [flat.buffer for flat in flats])
    ledger.add("parameters", params, primary=not flats)

    reducers = parallel.gradients.reducers if parallel is not None else []
    for reducer in reducers:
        ledger.add("gradients", [reducer.grad_buffer if reducer.grad_buffer is not None else reducer.grad_shard])
        ledger.add("gradients", [t for b in reducer.buckets for t in (b.buffer, b.shard_out)], primary=False)
    ledger.add("gradients", [p.grad for p in params], primary=not reducers)

    if optimizer is not None:
        masters = _optimizer_params(optimizer)
        ledger.add("master", masters)
        ledger.add("gradients", [m.grad for m in masters], primary=False)
        ledger.add(
            "optimizer_state",
            [
                value
                for state in optimizer.state.values()
                for name, value in state.items()
                if name != "step" and isinstance(value, torch.Tensor)
            ],
        )
    report: dict[str, Any] = dict(ledger.counts)
    report["total_bytes"] = sum(c["bytes"] for c in ledger.counts.values())
    return report


def paper_bytes(report: dict[str, Any]) -> dict[str, int]:
    """The bytes `report`'s element counts would take at the ZeRO paper's mixed-precision widths
    (`PAPER_WIDTHS`), per category and in "total"."""
    priced = {c: report[c]["elements"] * PAPER_WIDTHS[c] for c in CATEGORIES}
    priced["total"] = sum(priced.values())
    return priced


def zero_formula(stage: int, psi: int, size: int, precision: str = "mixed") -> float:
    """Bytes per rank the model predicts for `psi` parameters over `size` data-parallel ranks with
    Adam: "mixed" is the paper's (16 psi, 4 psi + 12 psi/N, 2 psi + 14 psi/N, 16 psi/N); "fp32" is
    paratron's fp32 training, whose master weights alias the parameters (16 psi, 8 psi + 8 psi/N,
    4 psi + 12 psi/N, 16 psi/N)."""
    whole, shared = {"mixed": ((16, 0), (4, 12), (2, 14), (0, 16)), "fp32": ((16, 0), (8, 8), (4, 12), (0, 16))}[
        precision
    ][stage]
    return whole * psi + shared * psi / size
