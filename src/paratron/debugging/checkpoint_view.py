"""A checkpoint of any format paratron reads, seen as `paratron inspect` shows it: where it came from (a paratron
save, a Megatron-LM checkpoint, a Hugging Face folder), its configuration, the layout it was saved at, step and
consumed samples, tokenizer, optimizer and other training state, its files with their recorded checksums
checked, and its tensors under single-device names, opened one at a time.

Formats are recognized as `--load` recognizes them (`model_of.is_hf_folder`, `megatron.detect_format`); the
tensors come from the readers of `paratron convert`'s table (`checkpoint.formats`), so a Megatron-LM or Hugging Face
checkpoint lists the names paratron would load it under, and any two checkpoints can be compared tensor by tensor.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer as HFTokenizer

from paratron.checkpoint.converted import CheckpointTensors, ConvertOptions, Tensors, in_memory
from paratron.checkpoint.files import TRACKER, WEIGHTS_INDEX, file_sha256
from paratron.checkpoint.hf import read_hf_folder
from paratron.checkpoint.load import weight_catalog
from paratron.checkpoint.megatron import detect_format, megatron_optimizer, megatron_weights, open_megatron
from paratron.checkpoint.megatron.settings import config_of
from paratron.checkpoint.model_of import is_hf_folder, megatron_tokenizer
from paratron.checkpoint.optimizer_state import INDEX as OPTIMIZER_INDEX
from paratron.checkpoint.pieces import parse_key
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint
from paratron.config.schema import Config
from paratron.errors import CheckpointError
from paratron.parallel.sharding import whole_box

NOT_A_CHECKPOINT = (
    "give a folder written by --save, a Megatron-LM checkpoint or a Hugging Face model folder (config.json and "
    "safetensors)"
)

VERIFIED, MISMATCH, MISSING, UNRECORDED, NOT_CHECKED = "verified", "MISMATCH", "MISSING", "unrecorded", "not checked"
"""A file's state against the checksum its checkpoint records (a format that records none: unrecorded)."""


@dataclass
class FileCheck:
    """One file of a checkpoint and what its recorded checksum says of it."""

    name: str
    size: int
    status: str


@dataclass
class CheckpointView:
    """What `paratron inspect` reports of one checkpoint; the tensors are opened on demand."""

    given: Path
    path: Path
    """The folder shown (one iteration folder of a save directory)."""
    source: str
    """paratron, megatron (torch), megatron (torch_dist) or hf."""
    config: Config
    open_tensors: Callable[[], contextlib.AbstractContextManager[Tensors]]
    iteration: int | None = None
    consumed_samples: int | None = None
    other_iterations: list[str] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)
    precision: str = ""
    tokenizer: str | None = None
    optimizer: dict[str, Any] = field(default_factory=dict)
    """State kind (exp_avg, exp_avg_sq, master) -> tensors holding it, and step; empty: weights only."""
    training_state: list[str] = field(default_factory=list)
    """Other state saved for an exact resume (loss scaler, random generators, counters), one phrase each."""
    files: list[FileCheck] = field(default_factory=list)
    tensor_files: dict[str, list[str]] = field(default_factory=dict)
    """Which files hold each tensor (where the format says), to mark a tensor of a damaged file."""
    recorded: dict[str, str] = field(default_factory=dict)
    """File name -> the sha256 the checkpoint records for it (paratron's meta.json; other formats record none)."""
    notes: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> list[FileCheck]:
        return [f for f in self.files if f.status in (MISMATCH, MISSING)]

    @property
    def verified(self) -> int:
        """How many files were found to match their recorded checksums."""
        return sum(1 for f in self.files if f.status == VERIFIED)


def verify_files(view: CheckpointView) -> None:
    """Check every file not yet checked against its recorded sha256 (read in chunks: any size; the hashing lets
    other threads run, so it can go on beside a comparison)."""
    for check in view.files:
        if check.status == NOT_CHECKED and check.name in view.recorded:
            check.status = VERIFIED if file_sha256(view.path / check.name) == view.recorded[check.name] else MISMATCH


class MappedTensors(CheckpointTensors):
    """A paratron checkpoint's weights by single-device name: a tensor stored whole in one box is the file's own
    memory-mapped tensor (no copy: its pages are read as they are used and belong to the file); any other is
    assembled from its boxes."""

    def whole(self, name: str) -> torch.Tensor:
        saved = self.catalog.boxes.get(name) or []
        shape = self.catalog.shapes.get(name)
        if len(saved) == 1 and saved[0].tensor is None and saved[0].box == whole_box(shape or ()):
            try:
                mapped = self.catalog.handle(saved[0].file).get_tensor(saved[0].key)
            except SafetensorError as error:
                raise CheckpointError(
                    f"{self.catalog.folder / saved[0].file}: unreadable ({error}); the checkpoint is damaged"
                ) from None
            if tuple(mapped.shape) == tuple(shape):
                return mapped
        return self.catalog.whole(name)


@contextlib.contextmanager
def mapped_tensors(info: CheckpointInfo) -> Iterator[Tensors]:
    """Open a paratron checkpoint's weights for reading (the files stay open, and mapped, until the `with` ends)."""
    with weight_catalog(info) as catalog:
        yield MappedTensors(catalog)


def open_view(path: Path, verify: bool = True) -> CheckpointView:
    """The view of the checkpoint at `path`, of whichever format it is; one-line `CheckpointError` for a path that
    holds none. `verify` checks every file against its recorded checksum (paratron's)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory; {NOT_A_CHECKPOINT}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint (a file, not a folder); {NOT_A_CHECKPOINT}")
    if is_hf_folder(path):
        return _hf_view(path)
    if not _holds_marks(path):
        raise CheckpointError(
            f"{path}: not a checkpoint (no {TRACKER}, meta.json, iter_* folders, Megatron-LM's mp_rank_* folders or "
            f"metadata.json, nor config.json found); {NOT_A_CHECKPOINT}"
        )
    kind = detect_format(path)
    return _paratron_view(path, verify) if kind == "paratron" else _megatron_view(path)


def _holds_marks(path: Path) -> bool:
    marks = (TRACKER, "meta.json", "metadata.json", ".metadata", "release")
    return any((path / mark).exists() for mark in marks) or any(path.glob("iter_*")) or any(path.glob("mp_rank_*"))


# ---------------------------------------------------------------- paratron


def _paratron_view(path: Path, verify: bool) -> CheckpointView:
    info = read_checkpoint(path, verify=False)  # (the folder --load tries first; its files are checked below)
    meta = _meta(info.path)
    c = info.config
    view = CheckpointView(
        given=path,
        path=info.path,
        source="paratron",
        config=c,
        open_tensors=lambda: mapped_tensors(info),
        iteration=info.iteration,
        consumed_samples=info.consumed_samples,
        other_iterations=[p.name for p in _iterations(path) if p != info.path],
        precision=c.training.precision,
    )
    view.layout = _paratron_layout(info)
    view.tokenizer = _tokenizer_file(info.path / "tokenizer.json", c.data.tokenizer_type)
    view.recorded = dict(meta.get("files", {}))
    view.files = _check_files(info.path, view.recorded)
    if verify:
        verify_files(view)
    view.tensor_files = _weight_files(info.path)
    view.optimizer = _paratron_optimizer(info.path)
    view.training_state = _rank_states(info)
    view.notes += [f"passed over (as --load does): {problem}" for problem in info.passed_over]
    if info.weights_only:
        view.notes.append("weights only: training from it starts at step 0")
    if info.hf_model_type:
        view.notes.append(f"converted from a Hugging Face {info.hf_model_type} model")
    if meta.get("megatron_source"):
        view.notes.append(
            f"converted from a Megatron-LM {meta.get('megatron_format')} checkpoint {meta['megatron_source']}"
        )
    return view


def _meta(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable; the checkpoint is damaged") from None


def _iterations(path: Path) -> list[Path]:
    """A save directory's complete iteration folders (none for one iteration folder)."""
    if (path / "meta.json").is_file():
        return []
    return sorted(p for p in path.glob("iter_*") if (p / "meta.json").is_file())


def _check_files(folder: Path, recorded: dict[str, str]) -> list[FileCheck]:
    """Every file meta.json lists (missing, or not checked yet: `verify_files` checks them), and any file it does
    not."""
    checks = []
    for name in sorted(recorded):
        file = folder / name
        checks.append(
            FileCheck(name, file.stat().st_size, NOT_CHECKED) if file.is_file() else FileCheck(name, 0, MISSING)
        )
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name not in recorded and file.name != "meta.json":
            checks.append(FileCheck(file.name, file.stat().st_size, UNRECORDED))
    return checks


def _weight_files(folder: Path) -> dict[str, list[str]]:
    """Tensor name -> the files holding its boxes (model.safetensors alone when there is no index)."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return {}
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{index}: unreadable; the checkpoint is damaged") from None
    out: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        files = out.setdefault(parse_key(key)[0], [])
        if file not in files:
            files.append(file)
    return out


def _paratron_layout(info: CheckpointInfo) -> dict[str, Any]:
    """The layout the checkpoint was saved at: the config's parallel sizes, and the ranks that wrote files."""
    p = info.config.parallel
    layout: dict[str, Any] = {
        "TP": p.tensor_model_parallel_size,
        "PP": p.pipeline_model_parallel_size,
        "CP": p.context_parallel_size,
        "EP": p.expert_model_parallel_size,
        "ZeRO": p.zero_stage,
    }
    if p.virtual_pipeline_model_parallel_size:
        layout["VPP"] = p.virtual_pipeline_model_parallel_size
    optimizer_files = list(info.path.glob("optimizer_tp*_pp*_dp*.safetensors"))
    dp_ranks = {f.stem.rsplit("_dp", 1)[1] for f in optimizer_files}
    if p.zero_stage > 0 and dp_ranks:
        layout["DP"] = len(dp_ranks)  # (every data-parallel rank writes its shard under ZeRO)
    layout["weight files"] = len(list(info.path.glob("model*.safetensors")))
    return layout


def _paratron_optimizer(folder: Path) -> dict[str, Any]:
    """Optimizer state kinds and how many tensors hold each, read from optimizer.index.json (no values)."""
    index = folder / OPTIMIZER_INDEX
    if not index.is_file():
        return {}
    try:
        record = json.loads(index.read_text(encoding="utf-8"))
    except ValueError:
        raise CheckpointError(f"{index}: unreadable; the checkpoint is damaged") from None
    kinds: dict[str, set[str]] = {}
    for key in record.get("weight_map", {}):
        kind, _, of = key.partition("/")
        kinds.setdefault(kind, set()).add(parse_key(of)[0])
    state: dict[str, Any] = {kind: len(names) for kind, names in sorted(kinds.items())}
    if not kinds:
        state["state"] = "older format (flat pieces)"
    step = record.get("step")
    if step is not None:
        state["step"] = int(step) if float(step).is_integer() else step
    return state


def _rank_states(info: CheckpointInfo) -> list[str]:
    """The per-rank training state files (RNG, loss scaler, counters), described from the first one's keys."""
    files = sorted(info.path.glob("training_state_tp*.pt"))
    if not files:
        return []
    out = [f"{len(files)} rank state file(s)"]
    try:
        saved = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as error:  # (a damaged file is named, the rest still shown)
        return out + [f"{files[0].name} unreadable ({type(error).__name__})"]
    if "rng" in saved:
        out.append("RNG states" + (" (+ tensor-parallel)" if "tensor_parallel_rng" in saved else ""))
    if "loss_scaler" in saved:
        scaler = saved["loss_scaler"]
        scale = scaler.get("scale") if isinstance(scaler, dict) else None
        out.append("loss scaler" + (f" (scale {float(scale):g})" if scale is not None else ""))
    if "skipped_iterations" in saved:
        out.append(f"skipped steps {saved['skipped_iterations']}")
    if "lr_schedule_samples" in saved:
        out.append(f"learning-rate schedule at sample {saved['lr_schedule_samples']}")
    out.append(f"data iterator at sample {info.consumed_samples}")
    return out


def _tokenizer_file(file: Path, kind: str | None) -> str | None:
    if not file.is_file():
        return kind
    vocab = _vocab_size(file)
    return f"{file.name}" + (f" ({vocab} tokens)" if vocab else "") + (f", {kind}" if kind else "")


def _vocab_size(file: Path) -> int | None:
    try:
        return HFTokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception:  # (a tokenizer this library cannot read: shown by name only)
        return None


# ---------------------------------------------------------------- Megatron-LM and Hugging Face


def _megatron_view(path: Path) -> CheckpointView:
    ckpt = open_megatron(path)
    config = config_of(ckpt.args, f"{ckpt.folder} args")
    args = ckpt.args

    @contextlib.contextmanager
    def tensors() -> Iterator[Tensors]:
        with in_memory(megatron_weights(ckpt, config.model))() as opened:
            yield opened

    root = path if ckpt.folder != path else ckpt.folder.parent  # (the save folder, for files the args name)
    others = sorted(p.name for p in path.glob("iter_*") if p.is_dir() and p != ckpt.folder) if root == path else []
    view = CheckpointView(
        given=path,
        path=ckpt.folder,
        source=f"megatron ({ckpt.format})",
        config=config,
        open_tensors=tensors,
        iteration=ckpt.iteration,
        consumed_samples=ckpt.consumed_samples,
        other_iterations=others,
        precision="bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32",
    )
    view.layout = {
        "TP": args.get("tensor_model_parallel_size", 1),
        "PP": args.get("pipeline_model_parallel_size", 1),
        "CP": args.get("context_parallel_size", 1),
        "EP": args.get("expert_model_parallel_size", 1),
    }
    if args.get("data_parallel_size"):
        view.layout["DP"] = args["data_parallel_size"]
    if args.get("use_distributed_optimizer"):
        view.layout["distributed optimizer"] = True
    settings = megatron_tokenizer(args, root)
    view.tokenizer = ", ".join(f"{k} {v}" for k, v in settings.items()) or None
    view.files = [
        FileCheck(str(f.relative_to(ckpt.folder)), f.stat().st_size, UNRECORDED)
        for f in sorted(ckpt.folder.rglob("*"))
        if f.is_file()
    ]
    optimizer = megatron_optimizer(ckpt, config.model)
    if optimizer:
        view.optimizer = {kind: len(per) for kind, per in optimizer.items() if kind != "step"}
    common = ckpt.common
    view.training_state = [
        what
        for key, what in (("rng_state", "RNG states"), ("opt_param_scheduler", "learning-rate scheduler"))
        if key in common
    ]
    if isinstance(common.get("optimizer"), dict) and "grad_scaler" in common["optimizer"]:
        view.training_state.append("loss scaler")
    view.notes.append("Megatron-LM records no checksums: files are listed, not verified")
    return view


def _hf_view(path: Path) -> CheckpointView:
    model = read_hf_folder(path, ConvertOptions(), tokenizer=False)
    hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    view = CheckpointView(
        given=path,
        path=path,
        source="hf",
        config=model.config,
        open_tensors=model.open_tensors,
        precision=str(hf.get("torch_dtype") or hf.get("dtype") or "not recorded"),
    )
    architectures = hf.get("architectures") or []
    view.notes.append(
        f"Hugging Face {hf.get('model_type')} model" + (f" ({', '.join(architectures)})" if architectures else "")
    )
    view.notes.append("weights only; safetensors record no checksums: files are listed, not verified")
    view.tokenizer = _tokenizer_file(path / "tokenizer.json", None)
    view.files = [FileCheck(f.name, f.stat().st_size, UNRECORDED) for f in sorted(path.iterdir()) if f.is_file()]
    return view
