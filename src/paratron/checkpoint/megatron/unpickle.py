"""Restricted unpickling of Megatron-LM's files: `torch.load(weights_only=True)` with an explicit
allow-list (`ALLOWED_GLOBALS`; Megatron's enums and config classes are rebuilt as inert stand-ins),
and torch_dist's `.metadata` through an unpickler that knows only torch.distributed.checkpoint's
metadata classes. Anything else is a one-line error.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratron.errors import CheckpointError

try:  # (numpy 2's place of the array rebuild that pickled numpy arrays name)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # (numpy < 2)
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]


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
        raise _refusal(str(path), exc) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable ({str(exc).splitlines()[0][:120]})") from None


def safe_load_bytes(data: bytes, where: str) -> Any:
    """`safe_load` of an object stored as bytes (torch.distributed.checkpoint's non-tensor entries)."""
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(where, exc) from None
    except (RuntimeError, EOFError, OSError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{where}: unreadable ({reason})") from None


def _refusal(where: str, exc: pickle.UnpicklingError) -> CheckpointError:
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = f"the class {found.group(1)}" if found else "an object"
    return CheckpointError(
        f"{where}: holds {what}, which paratron does not unpickle (only tensors, plain values and "
        "Megatron-LM's args are allowed)"
    )


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_DCP_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # (StorageMeta.checkpoint_id of newer torch)
}


class MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` pickle, allowed to build only its own metadata
    classes, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _DCP_MODULES or (module, name) in _DCP_NAMES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def dcp_reader(folder: Path) -> Any:
    """A torch.distributed.checkpoint reader of `folder` whose `.metadata` goes through `MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader  # (start-up speed, docs/architecture.md)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                with open(folder / ".metadata", "rb") as f:
                    metadata = MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"{folder / '.metadata'}: holds {str(exc).replace('GLOBAL ', 'the class ')}, which paratron "
                    "does not unpickle"
                ) from None
            except (EOFError, OSError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{folder / '.metadata'}: unreadable ({exc})") from None
            from torch.distributed.checkpoint.metadata import StorageMeta  # (start-up speed, docs/architecture.md)

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))
