"""Saving training checkpoints (the folder's files: `checkpoint.files`).

Every rank writes only what it holds, and of values several ranks hold (data-parallel replicas,
tensors whole on every tensor-parallel rank) one rank writes: no rank gathers anything. A single
process writes one model.safetensors of whole tensors under single-device names.

A checkpoint is written into a temporary folder and renamed into place before the
tracker moves, so a crash mid-save never leaves a half checkpoint behind the tracker. A save
that the filesystem cannot hold is refused before anything is written (the ranks writing to one
filesystem add up their bytes); one that runs out of space anyway removes the temporary folder.
Either ends on every rank with the same one-line `UserError` (`paratron.storage`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.checkpoint.files import TRACKER, WEIGHTS_INDEX, file_sha256, rank_state_file, weights_file
from paratron.checkpoint.gather import first_replica, persistent_buffers
from paratron.checkpoint.optimizer_state import optimizer_file, optimizer_snapshot
from paratron.checkpoint.optimizer_state import write_index as write_optimizer_index
from paratron.checkpoint.pieces import box_key, writes
from paratron.checkpoint.prune import prune_checkpoints
from paratron.config.loading import config_to_dict
from paratron.config.schema import Config
from paratron.data.special_tokens import CHAT_TEMPLATE_FILE
from paratron.distributed.topology import Axis, ParallelDims, Topology
from paratron.errors import UserError
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.data_parallel.fully_sharded import held_boxes, local_tensor
from paratron.parallel.sharding import full_shape
from paratron.storage import (
    Space,
    is_disk_full,
    no_space_message,
    replacing,
    save_object,
    save_tensors,
    space_at,
    tensor_bytes,
    write_text_atomic,
)

SAVE_FIX = "free space or choose another --save"
CONVERT_FIX = "free space or choose another destination (convert --to FORMAT DIR)"
CONVERTED = "the converted checkpoint"
"""What a full disk's line says a conversion to paratron was writing."""
FILE_SLACK = 8192
"""Bytes a checkpoint file may take beyond its tensors: its header, the filesystem's last block."""


def weight_boxes(model: nn.Module, topology: Topology) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """What this rank writes of the weights (`pieces.writes`): its boxes of each single-device
    tensor under their keys, on the CPU, and the single-device shapes. Persistent buffers (whole
    on every rank) come from the stage's first tensor- and data-parallel rank."""
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        if not writes(param, topology):
            continue
        local, shape = local_tensor(param).detach(), full_shape(param)
        shapes[name] = list(shape)
        for whole, mine in held_boxes(param):
            tensors[box_key(name, whole, shape)] = local[mine].cpu()
    if topology.tp_rank == 0 and first_replica(topology):
        for name, buffer in persistent_buffers(model).items():
            tensors[name], shapes[name] = buffer.detach().cpu(), list(buffer.shape)
    return tensors, shapes


@dataclass
class CheckpointContent:
    """What a checkpoint holds, as one rank sees it."""

    iteration: int
    consumed_samples: int
    config: Config
    model: nn.Module
    """This rank's plain model part (single-device names)."""
    optimizer: TrainingOptimizer | None = None
    tokenizer: Any = None
    rank_state: dict[str, Any] | None = None
    """This rank's random-generator and loss-scaler state."""
    extra_meta: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    """The jinja source of the template the run rendered conversations with, kept beside the tokenizer as
    chat_template.jinja (where transformers and every later command look for it)."""


def save_checkpoint(
    root: Path,
    content: CheckpointContent,
    topology: Topology | None = None,
    *,
    what: str | None = None,
    fix: str = SAVE_FIX,
) -> Path:
    """Write `content` under `root` and wait until it is published; every rank takes part (see
    `begin_save` for what each rank writes). Without a topology, this process alone writes it
    all, with no collective (a conversion, which one process of a job runs). `what` and
    `fix` word the line of a full disk (a conversion's destination is no --save)."""
    pending = begin_save(root, content, topology, what=what, fix=fix)
    pending.write()
    return pending.publish()


def begin_save(
    root: Path,
    content: CheckpointContent,
    topology: Topology | None = None,
    snapshot: bool = False,
    *,
    what: str | None = None,
    fix: str = SAVE_FIX,
) -> PendingSave:
    """The collective part of a save: take this rank's boxes of the weights and the optimizer
    state and its RNG state, check that every rank's files fit their filesystem, create the
    temporary folder. With `snapshot`, every value is copied, so that training may go on while
    `PendingSave.write` runs (asynchronous saving).

    Each rank takes only what it holds and writes (`pieces.writes`); no values travel between
    ranks. The first data-parallel replica writes the rank states. A checkpoint that does not fit
    is refused on every rank with the same line (`UserError`) before anything is written."""
    what = what or f"checkpoint iteration {content.iteration}"
    collective = topology is not None  # (without one, this process alone: a conversion, which a job runs once)
    topology = topology or Topology(ParallelDims(1))
    weights, shapes = weight_boxes(content.model, topology)
    rank_state = content.rank_state if first_replica(topology) else None
    if snapshot:
        weights = {n: t.clone() for n, t in weights.items()}
        rank_state = copy.deepcopy(rank_state)
    pending = _pending_save(root, content, topology, what, fix, collective)
    if weights:
        pending.add(weights_file(topology), weights, {"format": "pt"}, "model", shapes)
    _add_optimizer_state(pending, content, topology, snapshot)
    if rank_state is not None:
        name = rank_state_file(topology.tp_rank, topology.pp_rank, topology.size(Axis.PP))
        pending.files[name] = ("torch", rank_state, None)
    _check_space(pending, topology)
    failure = _make_temporary_folder(pending) if pending.writer else None
    _raise_on_every_rank(failure, pending.collective)  # (and the barrier after which every rank may write)
    return pending


def _pending_save(
    root: Path, content: CheckpointContent, topology: Topology, what: str, fix: str, collective: bool
) -> PendingSave:
    """An empty `PendingSave` of `content` for this rank: rank 0 writes the shared files."""
    return PendingSave(
        root,
        content.iteration,
        content.consumed_samples,
        content.config,
        content.tokenizer,
        topology.rank == 0,
        content.extra_meta,
        files={},
        indexed=topology.dims.world_size > 1,
        what=what,
        fix=fix,
        collective=collective,
        chat_template=content.chat_template,
    )


def _add_optimizer_state(pending: PendingSave, content: CheckpointContent, topology: Topology, snapshot: bool) -> None:
    """This rank's boxes of the optimizer state (sharded under ZeRO across the data- x context-parallel
    group), and the optimizer's step count for the index."""
    if content.optimizer is None:
        return
    sharded = content.config.parallel.zero_stage > 0 and topology.size(Axis.DP_CP) > 1
    state = optimizer_snapshot(content.optimizer, content.model, topology, sharded, copy=snapshot)
    pending.step = state.step
    if state.tensors or state.shapes:
        # (numbered within the data- x context-parallel group: under context parallelism ZeRO shards over both)
        name = optimizer_file(topology.tp_rank, topology.pp_rank, topology.local_rank(Axis.DP_CP))
        pending.add(name, state.tensors, {"format": "pt"}, "optimizer", state.shapes)


def _make_temporary_folder(pending: PendingSave) -> str | None:
    """The writer rank's fresh temporary folder (an old one of a failed save removed); why it could
    not be made, or None."""
    try:
        pending.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(pending.tmp, ignore_errors=True)
        pending.tmp.mkdir()
    except OSError as error:
        return pending.failure(error)
    return None


def _bytes_to_write(pending: PendingSave) -> int:
    """An estimate of the bytes this rank writes: its tensors, the safetensors headers, some slack
    per file; its keys in the indexes; and on the writer rank the tokenizer and meta.json."""
    total = 0
    for kind, content, _ in pending.files.values():
        total += tensor_bytes(content) + FILE_SLACK
        if kind == "safetensors":
            total += sum(len(name) + 128 for name in content)
    total += sum(2 * (len(key) + 64) for files in pending.keys.values() for keys in files.values() for key in keys)
    if pending.writer:
        total += 4 * FILE_SLACK + len(json.dumps(config_to_dict(pending.config))) + _tokenizer_bytes(pending.tokenizer)
    return total


def _tokenizer_bytes(tokenizer: Any) -> int:
    """The size of the tokenizer.json a checkpoint will hold: its file's, or its serialized text's."""
    if tokenizer is None:
        return 0
    for attribute in ("path", "source"):  # (a tokenizer read from a file, a conversion's copy)
        file = getattr(tokenizer, attribute, None)
        if file and Path(file).is_file():
            return Path(file).stat().st_size
    hf = getattr(tokenizer, "hf", None)
    return len(hf.to_str()) if hf is not None else 0


def _check_space(pending: PendingSave, topology: Topology) -> None:
    """Refuse a checkpoint whose files do not fit: the estimates of the ranks that write to one
    filesystem (one machine's device) are summed and compared with its free space. Collective
    over all ranks when there are several; every rank reaches the same verdict from the same records."""
    space = space_at(pending.root)
    mine = (socket.gethostname(), space.device, str(space.mount), space.free, _bytes_to_write(pending))
    records: list[Any] = [mine]
    if topology.dims.world_size > 1 and dist.is_initialized():
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)
    filesystems: dict[tuple[str, int], list[Any]] = {}
    for host, device, mount, free, nbytes in records:
        filesystems.setdefault((host, device), [mount, free, 0])[2] += nbytes
    pending.space, pending.needed = space, filesystems[mine[:2]][2]
    several_hosts = len({host for host, _ in filesystems}) > 1
    for (host, _), (mount, free, needed) in filesystems.items():
        if needed > free:
            where = Space(Path(f"{host}:{mount}" if several_hosts else mount), 0, free)
            raise UserError(no_space_message(pending.what, pending.final, needed, where, pending.fix, ahead=True))


@dataclass
class PendingSave:
    """One checkpoint on its way to disk. `write` puts this rank's files in the temporary folder
    (no communication: it may run in a background thread); `publish` waits for every rank, then
    the writer rank adds the indexes, tokenizer and meta.json with checksums, renames the folder
    into place, moves the tracker and prunes old checkpoints. A rank that cannot write (a full
    disk) makes `publish` remove the temporary folder and fail on every rank with one line."""

    root: Path
    iteration: int
    consumed_samples: int
    config: Config
    tokenizer: Any
    writer: bool
    extra_meta: dict[str, Any]
    files: dict[str, tuple[str, Any, Any]]
    indexed: bool = False
    """Write the index files (several ranks wrote boxes); a single process's weights are one plain file."""
    keys: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """For the indexes: kind ("model", "optimizer") -> file -> the keys this rank writes to it."""
    shapes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """kind -> single-device shape of each tensor this rank writes boxes of."""
    step: float | None = None
    """The optimizer's step count."""
    checksums: dict[str, str] = field(default_factory=dict)
    """SHA-256 of each file this rank wrote (computed by `write`, so off the training thread too)."""
    what: str = "a checkpoint"
    """What a full disk's line calls it (checkpoint iteration N, a converted checkpoint)."""
    fix: str = SAVE_FIX
    needed: int | None = None
    """Estimated bytes of every rank writing to this rank's filesystem (`begin_save`'s check)."""
    space: Space | None = None
    """This rank's filesystem and its free bytes when the save began."""
    error: str | None = None
    """Why this rank's `write` failed, for `publish` to report on every rank."""
    collective: bool = True
    """Every rank of the job takes part (a training checkpoint); False: this process saves alone."""
    chat_template: str | None = None
    """Written as chat_template.jinja beside the tokenizer (`CheckpointContent.chat_template`)."""

    def add(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict, kind: str, shapes: dict) -> None:
        """A safetensors file of this rank's boxes of kind `kind`."""
        self.files[name] = ("safetensors", tensors, metadata)
        self.keys.setdefault(kind, {})[name] = list(tensors)
        self.shapes.setdefault(kind, {}).update(shapes)

    @property
    def final(self) -> Path:
        return self.root / f"iter_{self.iteration:07d}"

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp-{self.final.name}"

    def write(self) -> None:
        """This rank's files; a full disk (or another `OSError`) is kept in `error` for `publish`."""
        try:
            for name, (kind, content, metadata) in self.files.items():
                with replacing(self.tmp / name) as partial:
                    if kind == "safetensors":
                        save_tensors({n: t.contiguous() for n, t in content.items()}, partial, metadata)
                    else:
                        save_object(content, partial)
                    self.checksums[name] = file_sha256(partial)
        except Exception as error:
            if not (isinstance(error, OSError) or is_disk_full(error)):
                raise
            self.error = self.failure(error)
        finally:
            self.files = {}  # (the values are no longer needed)

    def failure(self, error: BaseException) -> str:
        """The one line of an error met while writing into the temporary folder."""
        if is_disk_full(error):
            return no_space_message(self.what, self.tmp, self.needed, self.space or space_at(self.tmp), self.fix)
        if isinstance(error, OSError):
            return f"{error.filename or self.tmp}: {error.strerror or error} while writing {self.what}"
        return str(error)

    def publish(self) -> Path:
        report = {
            "checksums": self.checksums,
            "keys": self.keys,
            "shapes": self.shapes,
            "step": self.step,
            "error": self.error,
        }
        reports = [report]
        if self.indexed and dist.is_initialized():  # every rank's files and keys, to rank 0 (the writer)
            reports = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(report, reports, dst=0)
        failure = None
        if self.writer:
            failure = next((part["error"] for part in reports if part["error"]), None)
            if failure is None:
                failure = self._complete(reports)
        if failure is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            _raise_on_every_rank(failure, self.collective)
        except UserError:
            shutil.rmtree(self.tmp, ignore_errors=True)  # (each machine's own, where --save is not shared)
            raise
        return self.final

    def _complete(self, reports: list[Any]) -> str | None:
        """The writer's part once every rank has written: indexes, tokenizer, meta.json, the
        rename, the tracker, pruning. Returns why it failed (a full disk), or None."""
        tmp, final, root = self.tmp, self.final, self.root
        try:
            self._write_indexes(reports)
            if self.tokenizer is not None:
                self.tokenizer.save(tmp / "tokenizer.json")
                if self.chat_template is not None:  # (over the template the tokenizer's folder brought)
                    (tmp / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
            written = {name: digest for part in reports for name, digest in part["checksums"].items()}
            files = {p.name: written.get(p.name) or file_sha256(p) for p in sorted(tmp.iterdir())}
            meta = {
                "iteration": self.iteration,
                "consumed_samples": self.consumed_samples,
                "config": config_to_dict(self.config),
                "files": files,
                **self.extra_meta,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
            if final.exists():  # re-saving an iteration: keep the old one until the new one is in place
                old = root / f".old-{final.name}-{os.getpid()}"
                final.replace(old)
                tmp.replace(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.replace(final)
            write_text_atomic(root / TRACKER, f"{self.iteration}\n", "the checkpoint tracker", self.fix)
        except Exception as error:
            if isinstance(error, UserError):
                return str(error)
            if not (isinstance(error, OSError) or is_disk_full(error)):
                raise
            return self.failure(error)
        c = self.config.checkpoint
        if c.keep_last or c.save_retain_interval:
            prune_checkpoints(root, c.keep_last or 0, c.save_retain_interval)
        return None

    def _write_indexes(self, reports: list[Any]) -> None:
        """model.safetensors.index.json and optimizer.index.json from every rank's keys and shapes."""
        merged: dict[str, tuple[dict[str, list[str]], dict[str, list[int]]]] = {}
        for report in reports:
            for kind, files in report["keys"].items():
                keys, shapes = merged.setdefault(kind, ({}, {}))
                keys.update(files)
                shapes.update(report["shapes"][kind])
        step = next((r["step"] for r in reports if r["step"] is not None), None)
        if "optimizer" in merged:
            write_optimizer_index(self.tmp, *merged["optimizer"], step)
        if self.indexed and "model" in merged:
            keys, shapes = merged["model"]
            weight_map = {key: file for file, names in sorted(keys.items()) for key in names}
            index = {"metadata": {"format": "boxes"}, "weight_map": weight_map, "shapes": shapes}
            (self.tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1), encoding="utf-8")


class BackgroundSave:
    """A `PendingSave` whose files are written by a thread while training goes on."""

    def __init__(self, pending: PendingSave) -> None:
        self.pending = pending
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write, name="paratron-save", daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            self.pending.write()
        except BaseException as exc:  # handed to the training thread in finish()
            self.error = exc

    def finish(self) -> Path:
        """Wait for this rank's files, then publish the checkpoint (collective)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.pending.publish()


def _raise_on_every_rank(failure: str | None, collective: bool = True) -> None:
    """Rank 0's verdict on every rank (so also a barrier): nothing, or the same one-line error; a
    save that is not `collective` raises its own."""
    if collective and dist.is_initialized():
        verdict = [failure]
        dist.broadcast_object_list(verdict, src=0)
        failure = verdict[0]
    if failure is not None:
        raise UserError(failure)
