"""Saving and loading training checkpoints.

Layout (Megatron-LM's tracker file and iteration folders):

    SAVE/latest_checkpointed_iteration.txt      newest complete checkpoint
    SAVE/iter_0000200/model_tp000_pp000_dp000.safetensors
                                                weights: what one rank holds, as boxes of the
                                                single-device tensors (`pieces.py`)
    SAVE/iter_0000200/model.safetensors.index.json
                                                every stored box's file, the single-device shapes
    SAVE/iter_0000200/optimizer_tp000_pp000_dp000.safetensors, optimizer.index.json
                                                optimizer state, the same way (`optimizer_state.py`)
    SAVE/iter_0000200/training_state_tp000_pp000.pt
                                                per tensor- and pipeline-parallel rank: RNG and
                                                loss-scaler state (tensors and numbers only)
    SAVE/iter_0000200/tokenizer.json            the run's tokenizer, if it has one
    SAVE/iter_0000200/chat_template.jinja       the chat template a fine-tuning run trained with
    SAVE/iter_0000200/meta.json                 iteration, consumed samples, config, checksums

Every rank writes only what it holds, and of values several ranks hold (data-parallel replicas,
tensors whole on every tensor-parallel rank) one rank writes: no rank gathers anything. A single
process writes one model.safetensors of whole tensors under single-device names; older
checkpoints (whole tensors per pipeline stage) and converted ones load the same way.

A checkpoint is written into a temporary folder and renamed into place before the
tracker moves, so a crash mid-save never leaves a half checkpoint behind the tracker. A save
that the filesystem cannot hold is refused before anything is written (the ranks writing to one
filesystem add up their bytes); one that runs out of space anyway removes the temporary folder.
Either ends on every rank with the same one-line `UserError` (`paratron.storage`).
Loading never unpickles arbitrary objects: safetensors, `torch.load(weights_only=True)`, JSON.
"""

from __future__ import annotations

import copy
import hashlib
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

from paratron.checkpoint.grow import NEW_PARTS, fill_grown, grows
from paratron.checkpoint.optimizer_state import optimizer_file, optimizer_snapshot
from paratron.checkpoint.optimizer_state import write_index as write_optimizer_index
from paratron.checkpoint.pieces import Catalog, box_key, writes
from paratron.config.loading import config_from_dict, config_to_dict
from paratron.config.schema import Config
from paratron.data.special_tokens import CHAT_TEMPLATE_FILE
from paratron.distributed.topology import Axis, ParallelDims, Topology
from paratron.errors import CheckpointError, UserError
from paratron.model.gpt import GPT, build_model
from paratron.model.lora import is_adapter
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.data.fully_sharded import full_parameter, held_boxes, local_tensor
from paratron.parallel.sharding import full_shape, gather_full, param_info, whole_box
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

TRACKER = "latest_checkpointed_iteration.txt"
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
SAVE_FIX = "free space or choose another --save"
CONVERT_FIX = "free space or choose another destination (convert --to FORMAT DIR)"
CONVERTED = "the converted checkpoint"
"""What a full disk's line says a conversion to paratron was writing."""
FILE_SLACK = 8192
"""Bytes a checkpoint file may take beyond its tensors: its header, the filesystem's last block."""


@dataclass
class CheckpointInfo:
    path: Path
    iteration: int
    consumed_samples: int
    config: Config
    weights_only: bool = False
    """Only weights, no training state (converted from Hugging Face): training starts from them at step 0."""
    hf_model_type: str | None = None
    """The Hugging Face architecture it was converted from, if any (kept for the way back)."""
    passed_over: list[str] = field(default_factory=list)
    """Why newer checkpoints of the same save directory were not used (damaged)."""


def file_sha256(path: Path) -> str:
    """The checksum meta.json lists for every file of a checkpoint (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def full_state(model: nn.Module, topology: Topology, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stage holds, once (a tied output weight appears as the
    embedding; the last pipeline stage's copy of it is left to the first), whole and on the CPU:
    tensor-parallel slices (and experts held by other expert-parallel ranks) are gathered one
    tensor at a time (collective over those groups; ranks with keep=False take part and keep nothing)."""
    out = {}
    tp_group, ep_group, etp_group = topology.group(Axis.TP), topology.group(Axis.EP), topology.group(Axis.EXPERT_TP)
    for name, param in model.named_parameters():
        if param_info(param).pipeline_duplicate:
            continue
        full = gather_full(param, tp_group, full_parameter(param), ep_group, etp_group)
        if keep:
            out[name] = full.cpu()
    if keep:
        out.update({name: buffer.detach().cpu() for name, buffer in persistent_buffers(model).items()})
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """State that is not a parameter but belongs in a checkpoint (a MoE router's expert bias)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def _stage_writer(topology: Topology) -> bool:
    """The rank that writes its pipeline stage's weights: the stage's first tensor-, context- and
    data-parallel rank."""
    return _first_replica(topology) and topology.tp_rank == 0


def _first_replica(topology: Topology) -> bool:
    """The first of the ranks that hold the same model part (data- and context-parallel peers)."""
    return topology.local_rank(Axis.DP_CP) == 0


def whole_model_state(model: nn.Module, topology: Topology) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (empty elsewhere): each pipeline stage's, gathered over
    tensor parallelism, sent to it. Collective over the tensor-parallel group; the stage writers
    also take part over the pipeline-parallel group."""
    stage_writer, main = _stage_writer(topology), topology.rank == 0
    state = full_state(model, topology, keep=stage_writer)
    pp = topology.group(Axis.PP)
    if pp.size == 1 or not stage_writer:
        return state if main else {}
    stages: list[Any] = [None] * pp.size
    dist.gather_object(state, stages if main else None, dst=0, group=pp.process_group)
    return {name: t for part in stages for name, t in part.items()} if main else {}


def weights_file(topology: Topology) -> str:
    """This rank's weights file: model.safetensors for a single process."""
    if topology.dims.world_size == 1:
        return WEIGHTS
    return (
        f"model_tp{topology.tp_rank:03d}_pp{topology.pp_rank:03d}_dp{topology.local_rank(Axis.DP_CP):03d}.safetensors"
    )


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
    if topology.tp_rank == 0 and _first_replica(topology):
        for name, buffer in persistent_buffers(model).items():
            tensors[name], shapes[name] = buffer.detach().cpu(), list(buffer.shape)
    return tensors, shapes


def rank_state_file(tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """training_state_tp000[_pp000].pt: random-generator states and loss scaler of one rank."""
    return f"training_state_tp{tp_rank:03d}" + (f"_pp{pp_rank:03d}" if pp_size > 1 else "") + ".pt"


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
    pp_rank, pp_size, tp_rank = topology.pp_rank, topology.size(Axis.PP), topology.tp_rank
    sharded = content.config.parallel.zero_stage > 0 and topology.size(Axis.DP_CP) > 1
    weights, shapes = weight_boxes(content.model, topology)
    rank_state = content.rank_state if _first_replica(topology) else None
    if snapshot:
        weights = {n: t.clone() for n, t in weights.items()}
        rank_state = copy.deepcopy(rank_state)
    pending = PendingSave(
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
    if weights:
        pending.add(weights_file(topology), weights, {"format": "pt"}, "model", shapes)
    if content.optimizer is not None:
        state = optimizer_snapshot(content.optimizer, content.model, topology, sharded, copy=snapshot)
        pending.step = state.step
        if state.tensors or state.shapes:
            # (numbered within the data- x context-parallel group: under context parallelism ZeRO shards over both)
            name = optimizer_file(tp_rank, pp_rank, topology.local_rank(Axis.DP_CP))
            pending.add(name, state.tensors, {"format": "pt"}, "optimizer", state.shapes)
    if rank_state is not None:
        pending.files[rank_state_file(tp_rank, pp_rank, pp_size)] = ("torch", rank_state, None)
    _check_space(pending, topology)
    failure = None
    if pending.writer:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(pending.tmp, ignore_errors=True)
            pending.tmp.mkdir()
        except OSError as error:
            failure = pending.failure(error)
    _raise_on_every_rank(failure, pending.collective)  # (and the barrier after which every rank may write)
    return pending


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


def prune_checkpoints(root: Path, keep: int, retain_interval: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `root` (none with `keep` 0), and
    with `retain_interval` all but the newest and those whose step is a multiple of it (Megatron-LM's
    --save-retain-interval); each is first renamed out of sight, so no reader meets a half-deleted
    one. Returns what was deleted."""
    complete = sorted(p for p in root.glob("iter_*") if p.is_dir() and (p / "meta.json").exists())
    doomed = complete[:-keep] if keep > 0 else []
    if retain_interval:
        doomed += [p for p in complete[:-1] if p not in doomed and int(p.name[5:]) % retain_interval]
    for path in doomed:
        hidden = root / f".old-{path.name}-{os.getpid()}"
        path.replace(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed


def _raise_on_every_rank(failure: str | None, collective: bool = True) -> None:
    """Rank 0's verdict on every rank (so also a barrier): nothing, or the same one-line error; a
    save that is not `collective` raises its own."""
    if collective and dist.is_initialized():
        verdict = [failure]
        dist.broadcast_object_list(verdict, src=0)
        failure = verdict[0]
    if failure is not None:
        raise UserError(failure)


def holds_checkpoint(path: Path) -> bool:
    """Whether a directory holds anything a checkpoint leaves (a tracker, an iteration folder, a
    checkpoint's meta.json, Megatron-LM's `release` folder), intact or not."""
    if not path.is_dir():
        return False
    marks = (path / TRACKER, path / "meta.json", path / "release")
    return any(mark.exists() for mark in marks) or any(path.glob("iter_*"))


def _candidates(path: Path) -> list[Path]:
    """Iteration folders to try, best first: the folder itself; or the tracker's, then the other
    complete ones of a save directory, newest first."""
    if (path / "meta.json").is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory; check --load")
    tracker = path / TRACKER
    others = sorted((p for p in path.glob("iter_*") if (p / "meta.json").is_file()), reverse=True)
    first: list[Path] = []
    if tracker.is_file():
        try:
            first = [path / f"iter_{int(tracker.read_text().strip()):07d}"]
        except ValueError:
            pass
    folders = first + [p for p in others if p not in first]
    if not folders:
        raise CheckpointError(f"{path}: no checkpoint here (neither {TRACKER} nor meta.json); check --load")
    return folders


def read_checkpoint(path: Path, verify: bool = True) -> CheckpointInfo:
    """Locate a checkpoint and (unless verify=False) check every file's checksum; loads no tensors.

    Given a save directory, a damaged newest checkpoint (missing, truncated or corrupted files) is
    passed over for the newest good one, and `CheckpointInfo.passed_over` says why; given one
    iteration folder, damage is an error."""
    problems: list[str] = []
    for folder in _candidates(path):
        try:
            info = _read_folder(folder, verify)
        except CheckpointError as exc:
            if folder == path:
                raise
            problems.append(str(exc))
            continue
        info.passed_over = problems
        return info
    raise CheckpointError(
        f"{path}: no intact checkpoint ({problems[0]}"
        + (f", and {len(problems) - 1} more" if len(problems) > 1 else "")
        + ")"
    )


def _read_folder(folder: Path, verify: bool) -> CheckpointInfo:
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder}: missing or incomplete; the checkpoint is damaged")
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        files: dict[str, str] = meta["files"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable; the checkpoint is damaged") from None
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; the checkpoint is incomplete")
        if verify and file_sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch; the file is corrupted")
    try:
        config = config_from_dict(meta["config"])
    except UserError as exc:
        raise CheckpointError(f"{folder / 'meta.json'}: its config does not load ({exc})") from None
    return CheckpointInfo(
        folder,
        int(meta["iteration"]),
        int(meta["consumed_samples"]),
        config,
        bool(meta.get("weights_only", False)),
        meta.get("hf_model_type"),
    )


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
