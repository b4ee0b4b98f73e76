"""--debug-capture DIR: every module's forward output and every parameter's gradient of each
training step, under single-device names, written by global rank 0 as one file per step (what
`paratron debug compare` reads).

Forward outputs are those of the step's first global sample (sample 0 of micro-batch 0 of
data-parallel rank 0), taken at each module's first call of the step outside autograd's backward
(so activation recomputation does not record twice; evaluation runs outside the step). The
modules recorded are those whose output is [B, T, hidden] (norms, blocks, attention, MLP,
row-parallel layers, embeddings, dropouts), the outputs of column-parallel layers (each
projection of a fused query/key/value or gate/up, the output layer) and attention cores. Each
rank's part is mapped to the single-device tensor: column splits on the last dimension, the
sequence-parallel split of the sequence, context parallelism's load-balanced chunks. The
tensor-parallel ranks' copies of a replicated output are checked to agree: a difference is a
divergence at that module (one rank's part of a row-parallel layer gone wrong, say).

Inside a mixture-of-experts layer: the router, as `NAME.logits` (each token's score of every
expert, [B, T, E], recomputed from the router's input and weight with its own operations) and
`NAME` (its output: each token's weights of its chosen experts, [B, T, E]); the shared expert and
its projections like a dense MLP; the layer's output, whole after the combine. The routed experts
themselves are not recorded: their input and output rows are routed copies of tokens, grouped by
expert (padded to capacity), and under expert parallelism each lies on the rank of its expert,
mixed with the tokens of that rank's other data-parallel peers; placing them in single-device
order would take every rank's routing map. The router's decisions, the layer's combined output
and the experts' weight gradients (compared whole) cover them.

Gradients are read after the optimizer's `prepare_grads` (the step's reduced gradients as the
optimizer steps them, unscaled): reduced over data (and context) parallelism, partial sums
completed, pieces of ZeRO stage 1 and 2 shards, ZeRO stage 3's rows (the local part of FSDP2's
reduce-scattered gradient, a DTensor), tensor-parallel slices, expert-parallel ranks' experts (one
expert-data-parallel replica of each), zero-bubble deferred weight gradients; a tied embedding's
last-stage copy counts once.

Test switch (not a user setting): the environment variable PARATRON_DEBUG_DEFECT=NAME multiplies
the forward output of the module NAME (a single-device name; of a router: its expert weights) by
1 + 1e-2 in runs of more than one process, on the last tensor-parallel rank only when TP > 1 and
on the pipeline stage that holds it, so that tests can plant a layout bug and check that
`paratron debug compare` finds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from paratron.config.schema import Config
from paratron.debugging.capture_sample import (
    Captured,
    Piece,
    Tables,
    assemble,
    owns_gradient,
    param_tables,
    position_table,
    range_table,
    take_piece,
)
from paratron.distributed.rng import Forked
from paratron.distributed.topology import Axis, Topology
from paratron.model.attention import AttentionCore
from paratron.model.gpt import GPT
from paratron.model.layer_kind import LayerKind
from paratron.model.mlp import Projections
from paratron.model.moe import Experts, Router, Routing
from paratron.model.transformer import TransformerLayers
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.context.attention import ContextParallelAttention
from paratron.parallel.context.split import token_index
from paratron.parallel.data_parallel.fully_sharded import is_sharded, local_tensor
from paratron.parallel.model import ParallelModel
from paratron.parallel.recompute import Recomputed, is_recomputing
from paratron.parallel.sharding import boxes, full_shape, param_info
from paratron.parallel.tensor.layers import ColumnParallelLinear, ColumnParallelProjections
from paratron.storage import replacing

DEFECT_VARIABLE = "PARATRON_DEBUG_DEFECT"
DEFECT_FACTOR = 1 + 1e-2
INDEX_FILE = "index.json"
HEAD_BLOCK = 1_000_000


def step_file(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}.safetensors"


def single_device_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> its name in the single-device model (wrappers that run a module under a
    random stream or with recomputation take its name; the inner module is left out)."""
    names: dict[int, str] = {}

    def visit(module: nn.Module, name: str) -> None:
        names.setdefault(id(module), name)
        for child_name, child in module.named_children():
            if child is None:
                continue
            wrapped = isinstance(module, (Forked, Recomputed)) and child_name == "module"
            visit(child, name if wrapped else f"{name}.{child_name}".lstrip("."))

    visit(model, "")
    return names


def block_of(name: str) -> int:
    """Where a name lies in the model's order: 0 before the layers, 1 + its layer, then the head."""
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1])
    return HEAD_BLOCK if name.split(".")[0] in ("final_norm", "output") else 0


def _inner(module: nn.Module) -> nn.Module:
    while isinstance(module, (Forked, Recomputed)):
        module = module.module
    return module


class DebugCapture:
    """The training loop's capture hook: `with capture.step(iteration): train_step(...)`, with
    `capture.gradients` as the step's after-`prepare_grads` callback."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        model: ParallelModel,
        loss_scale: Callable[[], float],
        global_batch_size: int,
    ):
        self.folder = Path(config.logging.debug_capture or ".")
        self.limit = config.logging.debug_capture_elements
        self.identity = run_identity(config, global_batch_size)
        self.seq_length = config.data.seq_length
        self.hidden = config.model.hidden_size
        self.topology, self.loss_scale = topology, loss_scale
        self.zero_stage = config.parallel.zero_stage
        self.tp, self.cp = topology.size(Axis.TP), topology.size(Axis.CP)
        self.tp_rank, self.cp_rank = topology.tp_rank, topology.coords.get("cp", 0)
        self.sequence_parallel = config.parallel.sequence_parallel and self.tp > 1
        self.records_forward = topology.dp_rank == 0
        self.gpt = next(m for m in model.module.modules() if isinstance(m, GPT))
        self.names = single_device_names(self.gpt)
        self.modules = {name: m for m in self.gpt.modules() if (name := self.names.get(id(m)))}
        self.param_names: dict[int, tuple[int, str]] = {}
        """id(parameter) -> (its place, its single-device name); a tied weight keeps its first name."""
        for module in self.gpt.modules():
            for local, param in module.named_parameters(recurse=False) if id(module) in self.names else ():
                name = f"{self.names[id(module)]}.{local}".lstrip(".")
                self.param_names.setdefault(id(param), (len(self.param_names), name))
        self.weight_infos = {
            id(m): param_info(m.weight)
            for m in self.gpt.modules()
            if isinstance(getattr(m, "weight", None), nn.Parameter)
        }
        """id(module) -> its weight's record, taken now: FSDP2 swaps in unsharded weights without it during forward."""
        self.armed = False
        self.seen: set[str] = set()
        self.outputs: list[tuple[str, torch.Tensor, Tables, bool, int]] = []
        self.pieces: list[Piece] = []
        self.handles = self._install(
            os.environ.get(DEFECT_VARIABLE), torch.distributed.is_initialized() and dist.get_world_size() > 1
        )

    # ---------------------------------------------------------------- hooks

    def _install(self, defect: str | None, parallel: bool) -> list[Any]:
        """A recording hook on every module that has a single-device name (a projection's parts are
        recorded through it; not the routed experts), and the test defect's hook first."""
        handles = []
        perturbs = defect is not None and parallel and (self.tp == 1 or self.tp_rank == self.tp - 1)
        skipped: set[int] = set()
        for module in self.gpt.modules():
            name = self.names.get(id(module))
            if id(module) in skipped or name is None or module is self.gpt or isinstance(module, TransformerLayers):
                continue
            inner = _inner(module)
            if isinstance(inner, Experts):
                continue
            if isinstance(inner, (Projections, ColumnParallelProjections)):
                skipped.update(id(m) for m in inner.modules() if m is not inner)
            if module is not inner:
                skipped.add(id(inner))
            if perturbs and defect is not None and (name == defect or defect.startswith(name + ".")):
                handles.append(module.register_forward_hook(_perturbing(name, defect, inner)))
            handles.append(module.register_forward_hook(self._recorder(name, inner)))
        return handles

    def _recorder(self, name: str, inner: nn.Module) -> Callable[..., None]:
        """The forward hook of module `name` (`inner`: the module inside any wrapper): keeps its first
        output of the step with the tables that place it in the single-device tensor."""

        def record(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self.armed or not self.records_forward or name in self.seen:
                return
            if is_recomputing():
                return
            self.seen.add(name)
            if isinstance(inner, (Projections, ColumnParallelProjections)):
                for (part, linear), tensor in zip(inner.items(), output):
                    self._keep(f"{name}.{part}", tensor, self._column_tables(linear, tensor))
                return
            if isinstance(inner, Router) and isinstance(output, Routing):
                self._keep_routing(name, inner, inputs[0], output)
                return
            tensor = output[0] if isinstance(output, tuple) else output
            if isinstance(inner, (AttentionCore, ContextParallelAttention)):
                self._keep(name, tensor, self._head_tables(name, tensor))
            elif isinstance(inner, ColumnParallelLinear) or isinstance(inner, nn.Linear) and name == "output":
                self._keep(name, tensor, self._column_tables(inner, tensor))
            elif isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.size(-1) == self.hidden:
                sequence = self._sequence_table(tensor.size(1))
                if sequence is not None:
                    self._keep(name, tensor, ([None, sequence[0], None], sequence[1]))

        return record

    def _keep(self, name: str, tensor: Any, layout: tuple[Tables, bool] | None) -> None:
        """Keep sample 0 of a module output. `layout`: its tables and whether tensor parallelism
        splits it (None when it cannot be mapped); a replicated output is kept by every
        tensor-parallel rank, counted from the first and checked against the others."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or layout is None:
            return
        tables, split = layout
        self.outputs.append((name, tensor[:1].detach().clone(), tables, split or self.tp_rank == 0, len(self.outputs)))

    def _keep_routing(self, name: str, router: Router, tokens: torch.Tensor, routing: Routing) -> None:
        """A router's logits and expert weights of the tokens [B x T, ...] it routed (the whole local
        sequence of each sample: tensor parallelism gathers it, so every tensor-parallel rank holds a copy)."""
        length = self.seq_length // self.cp
        sequence = self._sequence_table(length)
        if sequence is None or tokens.size(0) % length:
            return
        with torch.no_grad():
            logits = tokens[:length].float() @ router.weight.float().t()
        tables = ([None, sequence[0], None], False)
        self._keep(f"{name}.logits", logits.unsqueeze(0), tables)
        self._keep(name, routing.probs[:length].unsqueeze(0), tables)

    def _sequence_table(self, length: int) -> tuple[torch.Tensor | None, bool] | None:
        """The sequence dimension's table for a local length (None: not a sequence this maps), and
        whether tensor parallelism splits it."""
        full = self.seq_length
        positions = token_index(full, self.cp, self.cp_rank) if self.cp > 1 else torch.arange(full)
        if length == positions.numel():
            return (position_table(full, positions) if self.cp > 1 else None), False
        if self.sequence_parallel and length * self.tp == positions.numel():
            return position_table(full, positions[self.tp_rank * length : (self.tp_rank + 1) * length]), True
        return None

    def _column_tables(self, linear: nn.Module, tensor: torch.Tensor) -> tuple[Tables, bool] | None:
        sequence = self._sequence_table(tensor.size(1)) if tensor.dim() == 3 else None
        if sequence is None or sequence[1]:
            return None
        info = self.weight_infos.get(id(linear)) if isinstance(linear, ColumnParallelLinear) else None
        shard = info.shard if info is not None else None
        if info is None or shard is None:
            return [None, sequence[0], None], False
        layout = info.layout or (shard,)
        pairs = [(w[0], m[0]) for w, m in boxes((tensor.size(-1),), shard)]
        return [None, sequence[0], range_table(shard.full_size, pairs)], layout.index(shard) == self.tp_rank

    def _head_tables(self, name: str, tensor: torch.Tensor) -> tuple[Tables, bool] | None:
        """An attention core's [B, heads, T, head_dim]: heads split as the query projection's rows."""
        sequence = self._sequence_table(tensor.size(2)) if tensor.dim() == 4 else None
        attention = self.modules.get(name.rsplit(".", 1)[0])
        if sequence is None or attention is None:
            return None
        query = attention.query_projection() if isinstance(attention, LayerKind) else None
        info = self.weight_infos.get(id(query)) if query is not None else None
        shard = info.shard if info is not None else None
        if shard is None:
            return [None, None, sequence[0], None], False
        # (the query projection's rows per head: the core's width, or another: multi-latent attention's values)
        rows = shard.length // tensor.size(1)
        heads = [
            (slice(w[0].start // rows, w[0].stop // rows), slice(m[0].start // rows, m[0].stop // rows))
            for w, m in boxes((shard.length,), shard)
        ]
        return [None, range_table(shard.full_size // rows, heads), sequence[0], None], True

    # ---------------------------------------------------------------- the step

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Record the forward outputs and gradients of one training step, then write them (collective)."""
        self.armed = True
        self.seen, self.outputs, self.pieces = set(), [], []
        try:
            yield
        finally:
            self.armed = False
        self._write(iteration, self._gather(self._forward_pieces() + self.pieces))

    def _forward_pieces(self) -> list[Piece]:
        pieces = []
        for name, tensor, tables, owner, order in self.outputs:
            shape = [1] + [t.numel() if t is not None else tensor.size(d) for d, t in enumerate(tables)][1:]
            key = (block_of(name), order)
            pieces.append(take_piece("forward", name, key, tensor, tables, shape, self.limit, owner=owner))
        return pieces

    def gradients(self, optimizer: TrainingOptimizer) -> None:
        """Take this rank's pieces of the step's gradients (after `prepare_grads`, before unscaling)."""
        if not self.armed:
            return
        scale = self.loss_scale()
        for piece in optimizer.pieces():
            found = self.param_names.get(id(piece.param))
            grad = None if piece.master.grad is None else local_tensor(piece.master.grad)
            info = param_info(piece.param)
            if found is None or grad is None or info.pipeline_duplicate or not self._owns_gradient(piece.param):
                continue
            order, name = found
            shape = full_shape(piece.param)
            tables = param_tables(piece.param, shape)
            key = (block_of(name), order)
            self.pieces.append(
                take_piece(
                    "gradient",
                    name,
                    key,
                    grad / scale,
                    tables,
                    shape,
                    self.limit,
                    flat_range=(piece.start, piece.end),
                    local_shape=piece.param.shape,
                )
            )

    def _owns_gradient(self, param: torch.Tensor) -> bool:
        return owns_gradient(param_info(param), is_sharded(param), self.zero_stage, self.topology.coords)

    def _gather(self, pieces: list[Piece]) -> list[Captured]:
        everyone: list[Any] = [pieces]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(pieces, everyone, dst=0)
        if everyone is None:
            return []
        return assemble([p for rank_pieces in everyone for p in rank_pieces], self.limit)

    def _write(self, iteration: int, captured: list[Captured]) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        write_capture(self.folder, iteration, captured, self.limit, {"world_size": world, "run": self.identity})


def write_capture(folder: Path, step: int, captured: list[Captured], limit: int, about: dict[str, Any]) -> None:
    """One step's captured tensors as a safetensors file (their kept elements; shapes and statistics in its
    metadata), and the folder's index.json (steps, names in order, shapes, elements kept, `about` the run)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{c.kind}/{c.name}": c.values.contiguous() for c in captured}
    entries = [
        {
            "kind": c.kind,
            "name": c.name,
            "shape": list(c.shape),
            "rms": c.rms,
            "max_abs": c.max_abs,
            "disagreement": c.disagreement,
            "notes": c.notes,
        }
        for c in captured
    ]
    with replacing(step_file(folder, step)) as tmp:
        save_file(tensors, str(tmp), metadata={"entries": json.dumps(entries)})
    index_path = folder / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.exists() else {"steps": []}
    index.update(about, elements=limit)
    index["steps"] = sorted(set(index["steps"]) | {step})
    index["names"] = [f"{c.kind}/{c.name}" for c in captured]
    index["shapes"] = {f"{c.kind}/{c.name}": list(c.shape) for c in captured}
    with replacing(index_path) as tmp:
        tmp.write_text(json.dumps(index, indent=1))


def _perturbing(name: str, defect: str, inner: nn.Module) -> Callable[..., Any]:
    """A forward hook that plants the test defect in `defect`'s output (a projection's part through its parent)."""

    def perturb(module: nn.Module, inputs: Any, output: Any) -> Any:
        if name == defect:
            if isinstance(output, Routing):
                return dataclasses.replace(output, probs=output.probs * DEFECT_FACTOR)
            if isinstance(output, tuple):
                return (output[0] * DEFECT_FACTOR, *output[1:])
            return output * DEFECT_FACTOR
        if isinstance(inner, nn.ModuleDict) and isinstance(output, tuple):
            part = defect[len(name) + 1 :]
            keys = list(inner.keys())
            if part in keys:
                i = keys.index(part)
                return (*output[:i], output[i] * DEFECT_FACTOR, *output[i + 1 :])
        return output

    return perturb


def run_identity(config: Config, global_batch_size: int) -> dict[str, Any]:
    """What two compared runs must share (as JSON values): the model, the data, the seed and the global batch."""
    identity = {
        "model": dataclasses.asdict(config.model),
        "data": dataclasses.asdict(config.data),
        "seed": config.training.seed,
        "global_batch_size": global_batch_size,
    }
    return json.loads(json.dumps(identity, default=str))


def install_capture(
    config: Config, topology: Topology, model: ParallelModel, loss_scale: Callable[[], float], global_batch_size: int
) -> DebugCapture | None:
    """The capture hook of a run with --debug-capture (None without)."""
    if not config.logging.debug_capture:
        return None
    return DebugCapture(config, topology, model, loss_scale, global_batch_size)
