"""Megatron-LM checkpoints of GPT and Llama-style models (megatron-core `GPTModel`) <-> paratron.

Read: Megatron-LM's legacy `torch` format (`latest_checkpointed_iteration.txt`,
`iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`, or `release/`) at any tensor- and
pipeline-parallel size, and its `torch_dist` format (torch.distributed.checkpoint files of global
tensors under Megatron's sharded names, `metadata.json` saying `torch_dist`). Written: the legacy
format at a chosen TP/PP (`paratron_to_megatron`), with the local layer spec's names.

Megatron's layouts, as single-device tensors (TP slices merged): `linear_qkv` holds q, k and v
interleaved per query group ([q of the group's heads; k; v] for each group in turn), `linear_fc1`
of a SwiGLU MLP holds [gate; up], the embedding and output layer carry a padded vocabulary, and the
norms are either separate modules (`input_layernorm`, `pre_mlp_layernorm`: the local spec) or
fused into the linear layers (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`:
Transformer Engine's spec). Under TP, column-parallel weights (qkv, fc1, embedding, output) are
split along dim 0 (qkv by whole query groups, fc1 gate and up each), row-parallel ones (proj,
fc2) along dim 1; under PP each stage numbers its layers from 0.

Optimizer state: Adam's moments and fp32 masters from torch_dist's reshardable formats
(`optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.KEY`) and from the legacy format's
non-distributed optimizer (its parameter indices matched to names through Megatron's standard
weight-decay groups) become paratron's optimizer files (`optimizer_state.py`).

Unpickling is restricted: `torch.load(weights_only=True)` with an explicit allow-list
(`ALLOWED_GLOBALS`; Megatron's enums and config classes are rebuilt as inert stand-ins), and
torch_dist's `.metadata` through an unpickler that knows only torch.distributed.checkpoint's
metadata classes. Anything else is a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import pathlib
import pickle
import re
import signal
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from paratron.checkpoint.io import (
    CONVERT_FIX,
    CONVERTED,
    TRACKER,
    CheckpointContent,
    file_sha256,
    read_checkpoint,
    save_checkpoint,
    weight_catalog,
)
from paratron.checkpoint.optimizer_state import INDEX as OPTIMIZER_INDEX
from paratron.checkpoint.optimizer_state import load_optimizer, optimizer_file, write_index
from paratron.config.loading import build_config, config_to_dict
from paratron.config.schema import Config, ModelConfig
from paratron.data.tokenizer import export_tokenizer
from paratron.errors import CheckpointError
from paratron.model.gpt import build_model
from paratron.storage import FOLDER_SLACK, new_folder, save_object, save_tensors, tensor_bytes

try:  # (numpy 2's place of the array rebuild that pickled numpy arrays name)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # (numpy < 2)
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]

MEGATRON_FILE = "model_optim_rng.pt"
RELEASE = "release"


# ---------------------------------------------------------------- restricted unpickling


class MegatronStandIn:
    """An inert stand-in for a Megatron-LM class found in a checkpoint's pickled `args` (an enum
    value such as AttnBackend.auto, a config dataclass): it keeps what it was built from, nothing runs."""

    def __init__(self, *values: Any) -> None:
        self.values = values

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.values!r}"


def _stand_in(qualified: str) -> tuple[type, str]:
    name = qualified.rsplit(".", 1)[1]
    return type(name, (MegatronStandIn,), {}), qualified


_MEGATRON_CLASSES = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.ModelType",
    "megatron.core.model_parallel_config.ModelParallelConfig",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


def _numpy_globals() -> list[Any]:
    """What numpy random states in `rng_state` unpickle through (numpy's array rebuild)."""
    found: list[Any] = [_reconstruct, np.ndarray, np.dtype]
    found += [getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(np, "dtypes")]
    # (the same objects under numpy 1's module names, which a checkpoint written there refers to)
    found += [(_reconstruct, "numpy.core.multiarray._reconstruct")]
    return found


ALLOWED_GLOBALS: list[Any] = [
    argparse.Namespace,
    types.SimpleNamespace,
    pathlib.PosixPath,
    io.BytesIO,
    signal.Signals,
    *_numpy_globals(),
    *(_stand_in(name) for name in _MEGATRON_CLASSES),
]
"""What a Megatron-LM `model_optim_rng.pt` / `common.pt` may contain beyond tensors and plain
values: the `args` Namespace (with a PosixPath, a signal, Megatron's enums as stand-ins), numpy
random states, Transformer Engine's BytesIO extra state."""


def safe_load(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` with `ALLOWED_GLOBALS`; anything else is one line. Memory-mapped
    where the file's format allows (zip, torch >= 1.6), so that reading a large file's args costs little."""
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # (the legacy format)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"the class {found.group(1)}" if found else "an object"
        raise CheckpointError(
            f"{path}: holds {what}, which paratron does not unpickle (only tensors, plain values and "
            "Megatron-LM's args are allowed)"
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable ({str(exc).splitlines()[0][:120]})") from None


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_DCP_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` pickle, allowed to build only its own metadata
    classes, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _DCP_MODULES or (module, name) in _DCP_NAMES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def _dcp_reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader  # start-up speed

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                with open(folder / ".metadata", "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"{folder / '.metadata'}: holds {str(exc).replace('GLOBAL ', 'the class ')}, which paratron "
                    "does not unpickle"
                ) from None
            except (EOFError, OSError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{folder / '.metadata'}: unreadable ({exc})") from None
            from torch.distributed.checkpoint.metadata import StorageMeta  # start-up speed

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


# ---------------------------------------------------------------- locating a checkpoint


@dataclass
class MegatronCheckpoint:
    """One Megatron-LM checkpoint folder (`iter_NNNNNNN` or `release`) and what it says of itself."""

    folder: Path
    format: str
    """torch (legacy, one pickle per model-parallel rank) or torch_dist."""
    iteration: int
    args: dict[str, Any]
    consumed_samples: int = 0
    common: dict[str, Any] = field(default_factory=dict)
    """The pickled dict of the first rank (legacy) or common.pt (torch_dist), tensors included."""
    loaded: dict[tuple[int, int], dict[str, Any]] | None = None
    """Every rank file of a legacy checkpoint once read (`legacy_files`)."""

    def legacy_files(self) -> dict[tuple[int, int], dict[str, Any]]:
        if self.loaded is None:
            self.loaded = _legacy_files(self)
        return self.loaded


def detect_format(path: Path) -> str:
    """torch, torch_dist or paratron for a save directory or one iteration folder (one-line error
    for anything else). A paratron save directory is recognised by any intact iteration folder, so
    that a damaged newest one is passed over as paratron's reader does."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory; check --load")
    if (path / "meta.json").is_file() or any((p / "meta.json").is_file() for p in path.glob("iter_*")):
        return "paratron"
    megatron_marks = (path / "metadata.json", path / ".metadata", path / TRACKER)
    if not any(mark.is_file() for mark in megatron_marks) and not any(path.glob("mp_rank_*")):
        if (path / "config.json").is_file():
            raise CheckpointError(
                f"{path}: a Hugging Face model folder, not a checkpoint; convert it once with paratron convert "
                f"--from hf {path} --to paratron CKPT and give --load CKPT"
            )
        raise CheckpointError(
            f"{path}: no checkpoint here (neither {TRACKER} nor meta.json, nor Megatron-LM's mp_rank_* folders "
            "or metadata.json); check --load"
        )
    folder = _iteration_folder(path)
    if (folder / "meta.json").is_file():
        return "paratron"
    return _folder_format(folder)


def _folder_format(folder: Path) -> str:
    metadata = folder / "metadata.json"
    if metadata.is_file():
        try:
            backend = json.loads(metadata.read_text(encoding="utf-8")).get("sharded_backend")
        except ValueError:
            raise CheckpointError(f"{metadata}: not valid JSON; the checkpoint is damaged") from None
        if backend == "torch_dist":
            return "torch_dist"
        raise CheckpointError(f"{folder}: sharded backend {backend!r} is not read; only torch_dist and torch are")
    if (folder / ".metadata").is_file():
        return "torch_dist"
    if any(p.name.startswith("mp_rank_") for p in folder.iterdir()):
        return "torch"
    raise CheckpointError(
        f"{folder}: neither a Megatron-LM checkpoint (no mp_rank_* folders or metadata.json) nor a paratron one"
    )


def _iteration_folder(path: Path) -> Path:
    """The folder the tracker file names (`iter_NNNNNNN` or `release`), or `path` itself."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    tracker = path / TRACKER
    if not tracker.is_file():
        if (path / "metadata.json").is_file() or (path / ".metadata").is_file() or any(path.glob("mp_rank_*")):
            return path
        raise CheckpointError(f"{path}: no {TRACKER}; give a Megatron-LM save directory or one iter_* folder")
    text = tracker.read_text(encoding="utf-8").strip()
    if text == RELEASE:
        folder = path / RELEASE
    elif text.isdigit():
        folder = path / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, neither an iteration number nor 'release'")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: missing, though {TRACKER} names it; the checkpoint is incomplete")
    return folder


def open_megatron(path: Path) -> MegatronCheckpoint:
    """Locate a Megatron-LM checkpoint under `path` and read its args, iteration and counters."""
    folder = _iteration_folder(path)
    kind = _folder_format(folder)
    if kind == "torch":
        first = _rank_file(folder, 0, 0, _legacy_pp(folder) > 1)
        common = safe_load(first)
    else:
        common = safe_load(folder / "common.pt") if (folder / "common.pt").is_file() else {}
    if not isinstance(common, dict) or not isinstance(common.get("args"), argparse.Namespace):
        raise CheckpointError(
            f"{folder}: stores no Megatron-LM args (save it with Megatron-LM's training loop, which keeps them)"
        )
    args = vars(common["args"])
    iteration = 0 if folder.name == RELEASE else int(common.get("iteration", args.get("iteration", 0)) or 0)
    consumed = int(args.get("consumed_train_samples", 0) or 0)
    return MegatronCheckpoint(folder, kind, iteration, args, consumed, common)


def _legacy_pp(folder: Path) -> int:
    stages = {p.name.split("_")[3] for p in folder.glob("mp_rank_*_*")}
    return max(1, len(stages))


def _rank_file(folder: Path, tp: int, pp: int, pipelined: bool) -> Path:
    name = f"mp_rank_{tp:02d}_{pp:03d}" if pipelined else f"mp_rank_{tp:02d}"
    path = folder / name / MEGATRON_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (its args say TP/PP ranks up to it)")
    return path


# ---------------------------------------------------------------- model settings


def model_settings(args: dict[str, Any], source: str = "args") -> dict[str, Any]:
    """paratron model settings for Megatron-LM `args` (refused with one line where paratron's
    layers differ)."""

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{source}: {what} is not supported by paratron's GPT layers")

    if args.get("num_experts"):
        raise refuse("a mixture of experts (--num-experts)")
    optional = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = {}
    for name, default in (("apply_layernorm_1p", False), ("rotary_interleaved", False), ("rotary_percent", 1.0)):
        value = args.get(name, default)
        if name in optional:  # (paratron has the setting: carried over as it is)
            extra[name] = type(default)(value)
        elif value != default:
            raise refuse(f"--{name.replace('_', '-')} {value}")
    if args.get("use_rope_scaling"):
        raise refuse("--use-rope-scaling")
    if args.get("squared_relu") or args.get("multi_latent_attention"):
        raise refuse("squared ReLU / multi-latent attention")
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none"):
        raise refuse(f"--position-embedding-type {position}")
    normalization = args.get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise refuse(f"--normalization {normalization}")
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    settings = dict(
        num_layers=int(args["num_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(args.get("ffn_hidden_size") or 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=int(groups or heads),
        kv_channels=int(kv) if kv and int(kv) * heads != hidden else None,
        max_position_embeddings=int(args.get("max_position_embeddings") or args.get("seq_length") or 1024),
        vocab_size=vocab_size_of(args),
        position_embedding_type=position,
        normalization=normalization,
        norm_epsilon=float(args.get("norm_epsilon", 1e-5)),
        activation="swiglu" if args.get("swiglu") else "gelu",
        openai_gelu=bool(args.get("openai_gelu", False)),
        add_bias_linear=bool(args.get("add_bias_linear", True)),
        add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        qk_layernorm=bool(args.get("qk_layernorm", False)),
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights", False)),
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        init_method_std=float(args.get("init_method_std", 0.02)),
        make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by", 128)),
    )
    if position == "rope":
        settings["rotary_base"] = float(args.get("rotary_base", 10000))
        settings.update(extra)
    else:
        settings.update({k: v for k, v in extra.items() if k == "apply_layernorm_1p"})
    return settings


def vocab_size_of(args: dict[str, Any]) -> int:
    """The real vocabulary: `vocab_size` when the args record it (the tokenizer's), else the padded one."""
    return int(args.get("vocab_size") or args["padded_vocab_size"])


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def config_of(args: dict[str, Any], source: str) -> Config:
    return build_config(dict(model_settings(args, source), mock_data=True))


# ---------------------------------------------------------------- Megatron layouts <-> paratron


@dataclass(frozen=True)
class Shapes:
    """The widths that Megatron's fused layouts interleave by."""

    heads: int
    groups: int
    head_dim: int
    gated: bool

    @classmethod
    def of(cls, m: ModelConfig) -> Shapes:
        heads = m.num_attention_heads
        groups = m.num_query_groups
        return cls(heads, groups, m.kv_channels, m.activation == "swiglu")


def split_qkv(fused: torch.Tensor, s: Shapes) -> dict[str, torch.Tensor]:
    """Megatron's per-group [q..; k; v] rows -> paratron's q, k, v (weight [rows, in] or bias [rows])."""
    per_group = s.heads // s.groups
    grouped = fused.reshape(s.groups, (per_group + 2) * s.head_dim, *fused.shape[1:])
    q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return {p: t.reshape(-1, *fused.shape[1:]).contiguous() for p, t in zip("qkv", (q, k, v))}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shapes) -> torch.Tensor:
    """paratron's q, k, v -> Megatron's rows, interleaved per query group."""
    tail = q.shape[1:]
    parts = [t.reshape(s.groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *tail).contiguous()


_NORMS = {
    "input_layernorm": "attention_norm",
    "self_attention.linear_qkv.layer_norm": "attention_norm",
    "pre_mlp_layernorm": "mlp_norm",
    "mlp.linear_fc1.layer_norm": "mlp_norm",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def to_paratron(global_state: dict[str, torch.Tensor], m: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Megatron single-device tensors (global layer numbers, TP merged, padded vocabulary) ->
    paratron's single-device state."""
    s = Shapes.of(m)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in global_state.items():
        layer = _LAYER.match(name)
        if layer is None:
            _top_level(name, tensor, m, out, source)
            continue
        i, rest = layer.groups()
        prefix = f"layers.{i}."
        norm = re.match(r"^(.+?)[._](weight|bias)$", rest)
        if norm and norm.group(1) in _NORMS:
            out[prefix + f"{_NORMS[norm.group(1)]}.{norm.group(2)}"] = tensor
        elif rest.startswith("self_attention.linear_qkv."):
            part = rest.rsplit(".", 1)[1]
            for p, piece in split_qkv(tensor, s).items():
                out[prefix + f"attention.in_proj.{p}.{part}"] = piece
        elif rest.startswith("self_attention.linear_proj."):
            out[prefix + "attention.out_proj." + rest.rsplit(".", 1)[1]] = tensor
        elif re.fullmatch(r"self_attention\.[qk]_layernorm\.(weight|bias)", rest):
            which, part = rest.split(".")[1][0], rest.rsplit(".", 1)[1]
            out[prefix + f"attention.{which}_norm.{part}"] = tensor
        elif rest.startswith("mlp.linear_fc1."):
            part = rest.rsplit(".", 1)[1]
            if s.gated:
                gate, up = tensor.chunk(2)
                out[prefix + f"mlp.in_proj.gate.{part}"] = gate.contiguous()
                out[prefix + f"mlp.in_proj.up.{part}"] = up.contiguous()
            else:
                out[prefix + f"mlp.in_proj.up.{part}"] = tensor
        elif rest.startswith("mlp.linear_fc2."):
            out[prefix + "mlp.out_proj." + rest.rsplit(".", 1)[1]] = tensor
        else:
            raise CheckpointError(f"{source}: holds {name}, which paratron's GPT layers have no place for")
    return out


def _top_level(name: str, tensor: torch.Tensor, m: ModelConfig, out: dict[str, torch.Tensor], source: str) -> None:
    vocab = m.vocab_size or tensor.shape[0]
    if name == "embedding.word_embeddings.weight":
        out["embedding.weight"] = tensor[:vocab].contiguous()
    elif name == "embedding.position_embeddings.weight":
        out["position_embedding.weight"] = tensor
    elif name.startswith("decoder.final_layernorm."):
        out["final_norm." + name.rsplit(".", 1)[1]] = tensor
    elif name == "output_layer.weight":
        if m.untie_embeddings_and_output_weights:  # (tied: the last stage's copy of the embedding)
            out["output.weight"] = tensor[:vocab].contiguous()
    else:
        raise CheckpointError(f"{source}: holds {name}, which paratron's GPT layers have no place for")


def from_paratron(state: dict[str, torch.Tensor], m: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    """paratron's single-device state -> Megatron single-device tensors (local spec names, global
    layer numbers, vocabulary padded with zero rows to `padded`)."""
    s = Shapes.of(m)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t

    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": pad(state["embedding.weight"])}
    if "position_embedding.weight" in state:
        out["embedding.position_embeddings.weight"] = state["position_embedding.weight"]
    for i in range(m.num_layers):
        p, q = f"layers.{i}.", f"decoder.layers.{i}."
        for part in ("weight", "bias"):
            if p + f"attention_norm.{part}" in state:
                out[q + f"input_layernorm.{part}"] = state[p + f"attention_norm.{part}"]
                out[q + f"pre_mlp_layernorm.{part}"] = state[p + f"mlp_norm.{part}"]
            if p + f"attention.in_proj.q.{part}" in state:
                qkv = (state[p + f"attention.in_proj.{x}.{part}"] for x in "qkv")
                out[q + f"self_attention.linear_qkv.{part}"] = fuse_qkv(*qkv, s)
            if p + f"attention.out_proj.{part}" in state:
                out[q + f"self_attention.linear_proj.{part}"] = state[p + f"attention.out_proj.{part}"]
            if p + f"mlp.in_proj.up.{part}" in state:
                up = state[p + f"mlp.in_proj.up.{part}"]
                gated = [state[p + f"mlp.in_proj.gate.{part}"], up] if s.gated else [up]
                out[q + f"mlp.linear_fc1.{part}"] = torch.cat(gated).contiguous()
            if p + f"mlp.out_proj.{part}" in state:
                out[q + f"mlp.linear_fc2.{part}"] = state[p + f"mlp.out_proj.{part}"]
        for x in "qk":
            for part in ("weight", "bias"):
                if p + f"attention.{x}_norm.{part}" in state:
                    out[q + f"self_attention.{x}_layernorm.{part}"] = state[p + f"attention.{x}_norm.{part}"]
    for part in ("weight", "bias"):
        if f"final_norm.{part}" in state:
            out[f"decoder.final_layernorm.{part}"] = state[f"final_norm.{part}"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad(state["output.weight"])
    return out


# ---------------------------------------------------------------- tensor-parallel slices


def tp_dim(name: str) -> int | None:
    """The dimension Megatron splits tensor `name` along under TP (None: whole on every rank)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if re.search(r"\.linear_(qkv|fc1)\.(weight|bias)$", name):
        return 0
    if re.search(r"\.linear_(proj|fc2)\.weight$", name):
        return 1
    return None


def merge_tp(name: str, slices: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """One tensor from its TP ranks' slices (a SwiGLU fc1's gate halves and up halves each joined)."""
    dim = tp_dim(name)
    if dim is None or len(slices) == 1:
        return slices[0]
    if gated and re.search(r"\.linear_fc1\.(weight|bias)$", name):
        halves = [t.chunk(2) for t in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(slices, dim=dim)


def split_tp(name: str, tensor: torch.Tensor, tp: int, gated: bool) -> list[torch.Tensor]:
    """`merge_tp`'s inverse: rank r's slice of `tensor`."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [tensor] * tp
    if gated and re.search(r"\.linear_fc1\.(weight|bias)$", name):
        gate, up = (h.chunk(tp) for h in tensor.chunk(2))
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate, up)]
    return [t.contiguous() for t in tensor.chunk(tp, dim=dim)]


# ---------------------------------------------------------------- reading


def _legacy_files(ckpt: MegatronCheckpoint) -> dict[tuple[int, int], dict[str, Any]]:
    """Every rank file of a legacy checkpoint, by (TP rank, PP stage), checked to hold a megatron-core model."""
    a = ckpt.args
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    pipelined = _legacy_pp(ckpt.folder) > 1 or pp > 1
    files = {}
    for stage in range(pp):
        for rank in range(tp):
            first = (rank, stage) == (0, 0)
            loaded = ckpt.common if first else safe_load(_rank_file(ckpt.folder, rank, stage, pipelined))
            if not isinstance(loaded, dict) or not _chunk_keys(loaded):
                raise CheckpointError(f"{ckpt.folder}: rank ({rank}, {stage}) holds no model state")
            if float(loaded.get("checkpoint_version", 0)) < 3.0:
                raise CheckpointError(
                    f"{ckpt.folder}: checkpoint_version {loaded.get('checkpoint_version')} predates megatron-core's "
                    "GPTModel (3.0); only megatron-core GPT checkpoints are read"
                )
            files[(rank, stage)] = loaded
    return files


def _chunk_keys(loaded: dict[str, Any]) -> list[str]:
    """`model`, or `model0`, `model1`, ... under virtual pipeline stages, in order."""
    return sorted((k for k in loaded if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))


def _parameters(chunk: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A model chunk's tensors in its state_dict order (which is megatron-core's parameter order)."""
    names = {n: t for n, t in chunk.items() if not n.endswith("_extra_state") and isinstance(t, torch.Tensor)}
    if any(n.startswith("language_model.") for n in names):
        raise CheckpointError("a legacy Megatron model (language_model.*); only megatron-core's GPTModel is read")
    return names


def _merge_legacy(files: dict[tuple[int, int], dict[str, Any]], pick: Any, gated: bool) -> dict[str, torch.Tensor]:
    """Tensors `pick((TP rank, stage), chunk index)` gives per rank, merged: TP slices joined, local layer
    numbers made global (virtual chunk outer, stage inner: Megatron's layer order)."""
    per_chunk: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for key, loaded in sorted(files.items(), key=lambda item: (item[0][1], item[0][0])):
        for v, _ in enumerate(_chunk_keys(loaded)):
            per_chunk.setdefault((v, key[1]), []).append(pick(key, v))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for v, stage in sorted(per_chunk):
        ranks = per_chunk[(v, stage)]
        layers = {int(m.group(1)) for n in _parameters(files[(0, stage)][_chunk_keys(files[(0, stage)])[v]])
                  if (m := _LAYER.match(n))}  # fmt: skip
        for name in ranks[0]:
            merged = merge_tp(name, [r[name] for r in ranks], gated)
            layer = _LAYER.match(name)
            if layer:
                name = f"decoder.layers.{int(layer.group(1)) + offset}.{layer.group(2)}"
            if name == "output_layer.weight" and name in out:
                continue
            out[name] = merged
        offset += len(layers)
    return out


def _legacy_state(ckpt: MegatronCheckpoint, files: dict[tuple[int, int], dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The model's tensors of a legacy checkpoint, merged over its rank files."""
    try:
        return _merge_legacy(
            files, lambda key, v: _parameters(files[key][_chunk_keys(files[key])[v]]), bool(ckpt.args.get("swiglu"))
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{ckpt.folder}: {exc}") from None


def _legacy_optimizer(
    ckpt: MegatronCheckpoint, files: dict[tuple[int, int], dict[str, Any]], m: ModelConfig
) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam's moments (and fp32 masters) of a legacy checkpoint's non-distributed optimizer, under
    paratron's names; None when there are none (or they cannot be told apart by name)."""
    per_rank = {key: _rank_optimizer(loaded) for key, loaded in files.items()}
    if any(state is None for state in per_rank.values()):
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for state in ("exp_avg", "exp_avg_sq", "master"):
        if all(state in part[0] for part in per_rank.values()):
            merged = _merge_legacy(files, lambda key, v, s=state: per_rank[key][v][s], m.activation == "swiglu")
            out[state] = to_paratron(merged, m, str(ckpt.folder))
    if "exp_avg" not in out or "exp_avg_sq" not in out:
        return None  # (not Adam)
    steps = [t for part in per_rank.values() for chunk in part for t in chunk.get("step", {}).values()]
    out["step"] = {str(i): t.reshape(1).float() for i, t in enumerate(steps[:1])}
    return out


def _rank_optimizer(loaded: dict[str, Any]) -> list[dict[str, dict[str, torch.Tensor]]] | None:
    """One rank file's optimizer state per model chunk: state -> {Megatron name: local tensor}.

    The optimizer numbers parameters group by group, each group in megatron-core's parameter order;
    Megatron's standard groups split them by weight decay (biases and 1-D parameters have none), so
    each group's members follow from the names. Any other grouping returns None."""
    wrapper = loaded.get("optimizer")
    if not isinstance(wrapper, dict):
        return None
    inner = wrapper.get("optimizer", wrapper)
    if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
        return None
    masters = wrapper.get("fp32_from_fp16_params")
    chunks = [_parameters(loaded[k]) for k in _chunk_keys(loaded)]
    everything = [(v, n, t) for v, chunk in enumerate(chunks) for n, t in chunk.items()]
    no_decay = [(v, n) for v, n, t in everything if n.endswith(".bias") or t.dim() == 1]
    decay = [(v, n) for v, n, t in everything if not (n.endswith(".bias") or t.dim() == 1)]
    groups = inner["param_groups"]
    kinds = [float(g.get("wd_mult", 1.0)) == 0.0 for g in groups]
    if len(set(kinds)) != len(kinds):
        return None  # (more groups than the two standard ones: decoupled learning rates, overrides)
    out: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in chunks]
    for g, (group, no_wd) in enumerate(zip(groups, kinds)):
        members = no_decay if no_wd else decay
        if len(group["params"]) != len(members):
            return None
        for position, (index, (v, name)) in enumerate(zip(group["params"], members)):
            for key, value in inner["state"].get(index, {}).items():
                if key in ("exp_avg", "exp_avg_sq"):
                    out[v].setdefault(key, {})[name] = value
                elif key == "step":
                    out[v].setdefault("step", {})[name] = torch.as_tensor(value)
            if masters is not None:
                out[v].setdefault("master", {})[name] = masters[g][position]
    return out


_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")


def _dist_tensors(ckpt: MegatronCheckpoint, prefix: str = "") -> dict[str, torch.Tensor]:
    """Whole tensors of a torch_dist checkpoint whose keys start with `prefix` (and, for the
    model, are not optimizer entries), read without a process group."""
    import torch.distributed.checkpoint as dcp  # start-up speed
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # start-up speed

    reader = _dcp_reader(ckpt.folder)
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
        dcp.load(wanted, storage_reader=_dcp_reader(ckpt.folder), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # (DCP wraps a reader's failures in its own exception types)
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{ckpt.folder}: torch_dist files unreadable ({reason})") from None
    return wanted


def _unstack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def megatron_weights(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under paratron's single-device names."""
    merged = _legacy_state(ckpt, ckpt.legacy_files()) if ckpt.format == "torch" else _unstack(_dist_tensors(ckpt))
    if not merged:
        raise CheckpointError(f"{ckpt.folder}: holds no model weights")
    return to_paratron(merged, m, str(ckpt.folder))


_OPTIMIZER_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "master"}


def megatron_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam's moments and the fp32 masters of a torch_dist checkpoint saved with a reshardable
    optimizer format (`optimizer.state.STATE.KEY`), as paratron state name -> {paratron name: tensor};
    None when the checkpoint has none in that form."""
    if ckpt.format == "torch":
        return _legacy_optimizer(ckpt, ckpt.legacy_files(), m)
    found = _dist_tensors(ckpt, "optimizer.state.")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for megatron_state, ours in _OPTIMIZER_STATES.items():
        prefix = f"optimizer.state.{megatron_state}."
        part = {key[len(prefix) :]: t for key, t in found.items() if key.startswith(prefix)}
        if part:
            out[ours] = to_paratron(_unstack(part), m, str(ckpt.folder))
    if "exp_avg" not in out or "exp_avg_sq" not in out:
        return None
    common = ckpt.common.get("optimizer")
    step = common.get("state", {}).get("common_step") if isinstance(common, dict) else None  # (megatron-core's)
    out["step"] = {"common_step": torch.as_tensor(step).reshape(1).float()} if step is not None else {}
    return out


# ---------------------------------------------------------------- conversions


def megatron_to_paratron(source: Path, destination: Path, finetune: bool = False, fix: str = CONVERT_FIX) -> Path:
    """Write a paratron checkpoint of a Megatron-LM one: its weights, and (unless `finetune`) its
    iteration, consumed samples and, from torch_dist, its optimizer state. Returns the folder.
    `fix` ends the line of a full disk (what to do about it where the caller chose `destination`)."""
    _refuse_existing(destination)
    ckpt = open_megatron(source)
    config = config_of(ckpt.args, f"{ckpt.folder} args")
    state = megatron_weights(ckpt, config.model)
    optimizer = None if finetune else megatron_optimizer(ckpt, config.model)
    model = build_model(config.model, "cpu")
    names = dict(model.named_parameters())
    missing = sorted(set(names) - set(state))
    if missing:
        raise CheckpointError(f"{ckpt.folder}: has no tensor for {missing[0]}; its args and weights disagree")
    with torch.no_grad():
        for name, param in names.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{ckpt.folder}: {name} has shape {list(state[name].shape)} but its args give "
                    f"{list(param.shape)}; the checkpoint's args and weights disagree"
                )
            param.copy_(state[name])
    meta = {"weights_only": finetune, "megatron_source": str(ckpt.folder), "megatron_format": ckpt.format}
    iteration, consumed = (0, 0) if finetune else (ckpt.iteration, ckpt.consumed_samples)
    needed = tensor_bytes(list(names.values())) + tensor_bytes(optimizer or {}) + FOLDER_SLACK
    with new_folder(CONVERTED, destination, needed, fix) as tmp:
        content = CheckpointContent(iteration, consumed, config, model, extra_meta=meta)
        folder = save_checkpoint(tmp, content, what=CONVERTED, fix=fix)
        if optimizer is not None:
            _write_optimizer(folder, optimizer, names, ckpt)
        (tmp / "model.yaml").write_text(yaml.safe_dump(model_recipe(config), sort_keys=False), encoding="utf-8")
    return destination / folder.name


MEGATRON_CHECKPOINT = "the Megatron-LM checkpoint"
"""What a full disk's line says the conversion to Megatron-LM was writing."""


def _write_optimizer(
    folder: Path, state: dict[str, dict[str, torch.Tensor]], params: dict[str, Any], ckpt: MegatronCheckpoint
) -> None:
    """paratron's optimizer files (one process's: whole tensors) from converted Megatron state, and
    the checksums in meta.json brought up to date."""
    kept = {key: per for key, per in state.items() if key != "step"}
    tensors = {f"{key}/{name}": t.float().contiguous() for key, per in kept.items() for name, t in per.items()}
    shapes = {name: list(p.shape) for name, p in params.items()}
    lacking = [n for n in params if f"exp_avg/{n}" not in tensors]
    if lacking:
        raise CheckpointError(f"{ckpt.folder}: its optimizer state lacks {lacking[0]}; convert with --finetune")
    file = optimizer_file(0, 0, 0)
    save_tensors(tensors, folder / file, {"format": "pt"})
    write_index(folder, {file: list(tensors)}, shapes, float(_optimizer_step(ckpt, state.get("step", {}))))
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["files"].update({name: file_sha256(folder / name) for name in (file, OPTIMIZER_INDEX)})
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")


def _optimizer_step(ckpt: MegatronCheckpoint, steps: dict[str, torch.Tensor]) -> int:
    """Adam's step count: what the saved optimizer state records, else the iteration."""
    values = [int(t.reshape(-1)[0]) for t in steps.values() if t.numel()]
    return max(values) if values else ckpt.iteration


def paratron_to_megatron(source: Path, destination: Path, tp: int = 1, pp: int = 1) -> Path:
    """Write a Megatron-LM legacy (`torch`) checkpoint of a paratron checkpoint's weights at
    tensor-parallel size `tp` and pipeline-parallel size `pp`, local layer-spec names, with the
    tracker file and an `args` Namespace of the model's architecture; the checkpoint's tokenizer, if it
    has one, goes into DST/tokenizer, which the args name (HuggingFaceTokenizer). Returns the iteration folder."""
    _refuse_existing(destination)
    info = read_checkpoint(source)
    m = info.config.model
    if tp < 1 or pp < 1:
        raise CheckpointError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1")
    if m.num_experts or m.lora_rank is not None or m.attention_type != "causal":
        raise CheckpointError(f"{info.path}: MoE, LoRA and non-causal attention models are not written to Megatron-LM")
    s = Shapes.of(m)
    if s.groups % tp or m.num_attention_heads % tp or m.ffn_hidden_size % tp:
        raise CheckpointError(
            f"--target-tensor-parallel-size {tp} must divide the query groups ({s.groups}), heads and FFN width"
        )
    if m.num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} must divide the {m.num_layers} layers")
    padded = padded_vocab(m.vocab_size or 0, m.make_vocab_size_divisible_by, tp)
    with weight_catalog(info) as catalog:
        state = {name: catalog.whole(name) for name in catalog.boxes}
    whole = from_paratron(state, m, padded)
    args = megatron_args(info.config, tp, pp, padded, info.iteration, info.consumed_samples)
    per_stage = m.num_layers // pp
    needed = tensor_bytes(whole) + FOLDER_SLACK * tp * pp
    with new_folder(MEGATRON_CHECKPOINT, destination, needed, CONVERT_FIX) as tmp:
        folder = tmp / f"iter_{info.iteration:07d}"
        if (info.path / "tokenizer.json").is_file():  # as Megatron-LM's HuggingFaceTokenizer reads a folder
            (tmp / "tokenizer").mkdir()
            export_tokenizer(info.path, tmp / "tokenizer")
            args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", str(destination.resolve() / "tokenizer")
        for stage in range(pp):
            stage_state = _stage(whole, m, stage, pp, per_stage)
            for rank in range(tp):
                model = {}
                for name, tensor in stage_state.items():
                    if name.endswith("._extra_state"):
                        model[name] = None
                    else:
                        model[name] = split_tp(name, tensor, tp, s.gated)[rank].clone()
                name = f"mp_rank_{rank:02d}_{stage:03d}" if pp > 1 else f"mp_rank_{rank:02d}"
                (folder / name).mkdir(parents=True)
                content = {"args": args, "checkpoint_version": 3.0, "iteration": info.iteration, "model": model}
                save_object(content, folder / name / MEGATRON_FILE)
        (tmp / TRACKER).write_text(f"{info.iteration}\n", encoding="utf-8")
    return destination / folder.name


def _stage(whole: dict[str, torch.Tensor], m: ModelConfig, stage: int, pp: int, per_stage: int) -> dict[str, Any]:
    """One pipeline stage's tensors under its local layer numbers, with the local spec's (empty)
    `_extra_state` entries of each linear layer, in megatron-core's state_dict order."""
    first, last = stage == 0, stage == pp - 1
    out: dict[str, Any] = {}
    if first:
        out.update({k: v for k, v in whole.items() if k.startswith("embedding.")})
    for local in range(per_stage):
        prefix = f"decoder.layers.{stage * per_stage + local}."
        for name, tensor in whole.items():
            if name.startswith(prefix):
                out[f"decoder.layers.{local}." + name[len(prefix) :]] = tensor
        for linear in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"):
            out[f"decoder.layers.{local}.{linear}._extra_state"] = None
    if last:
        out.update({k: v for k, v in whole.items() if k.startswith("decoder.final_layernorm.")})
        if m.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = whole["output_layer.weight"]
        elif pp > 1:  # (megatron-core's last stage keeps its own copy of the tied embedding)
            out["output_layer.weight"] = whole["embedding.word_embeddings.weight"]
        out["output_layer._extra_state"] = None
    return out


def megatron_args(config: Config, tp: int, pp: int, padded: int, iteration: int, consumed: int) -> argparse.Namespace:
    """The `args` Namespace of a written checkpoint: the model's architecture and the layout."""
    m = config.model
    heads = m.num_attention_heads
    groups = Shapes.of(m).groups
    extra = {name: getattr(m, name, None) for name in ("apply_layernorm_1p", "rotary_percent", "rotary_interleaved")}
    return argparse.Namespace(
        **{name: value for name, value in extra.items() if value is not None},
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=m.kv_channels,
        max_position_embeddings=m.max_position_embeddings,
        seq_length=config.data.seq_length,
        vocab_size=m.vocab_size,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,
        normalization=m.normalization,
        norm_epsilon=m.norm_epsilon,
        swiglu=m.activation == "swiglu",
        openai_gelu=m.openai_gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        transformer_impl="local",
        ckpt_format="torch",
        use_dist_ckpt=False,
        iteration=iteration,
        consumed_train_samples=consumed,
        consumed_valid_samples=0,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
    )


def _refuse_existing(destination: Path) -> None:
    if destination.exists() and any(destination.iterdir()):
        raise CheckpointError(f"{destination}: already exists and is not empty; choose a new directory")


# ---------------------------------------------------------------- --load of a Megatron-LM directory


def cache_name(source: Path, finetune: bool) -> str:
    """The name of `paratron train --load`'s converted copy of Megatron-LM checkpoint `source`
    in the data cache: its path, the iteration its tracker names (and when that was written), and
    whether only the weights are wanted."""
    folder = _iteration_folder(source)
    stamp = folder.stat().st_mtime_ns
    key = hashlib.sha256(f"{source.resolve()}|{folder.name}|{stamp}|{finetune}".encode()).hexdigest()[:16]
    return f"megatron-{folder.name}-{key}"


def check_load(path: Path, declared: str | None) -> str:
    """The format of --load `path` (cheap: no tensors read), checked against --ckpt-format."""
    found = detect_format(path)
    if declared is not None and declared != found:
        raise CheckpointError(f"--ckpt-format {declared}: {path} holds a {found} checkpoint; drop --ckpt-format")
    if found == "paratron":
        read_checkpoint(path, verify=False)
    elif found == "torch":
        folder = _iteration_folder(path)
        _rank_file(folder, 0, 0, _legacy_pp(folder) > 1)
    return found


def load_converted_optimizer(folder: Path, optimizer: Any, model: Any) -> bool:
    """Fill `optimizer` from a converted checkpoint's optimizer state, when it has any (a converted
    checkpoint has no random-generator state: the run's generators start from its seed)."""
    if not (folder / OPTIMIZER_INDEX).is_file():
        return False
    with weight_catalog(read_checkpoint(folder, verify=False)) as weights:
        load_optimizer(folder, optimizer, model, weights)
    return True


def model_recipe(config: Config) -> dict[str, Any]:
    """The model section of a converted checkpoint's config, for `model.yaml`."""
    return {"model": {k: v for k, v in config_to_dict(config)["model"].items() if v is not None}}
