"""`paratron inspect A --diff B`: two checkpoints of any formats compared tensor by tensor under single-device names
(names only in one, shape and dtype differences, the largest absolute and relative difference of the values),
configuration by configuration (every setting that differs) and by step and consumed samples.

Memory stays bounded by one tensor of each: each pair is read (a tensor stored whole, memory-mapped), compared in
float32 (float64 where either is) one chunk at a time and let go before the next.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from paratron.config.loading import config_to_dict
from paratron.config.schema import Config
from paratron.debugging.checkpoint_view import NOT_CHECKED, CheckpointView

SAME, VALUES, SHAPE, DTYPE, ONLY_A, ONLY_B = (
    "same",
    "values differ",
    "shape differs",
    "dtype differs",
    "only A",
    "only B",
)


@dataclass
class TensorDifference:
    """How one tensor of A compares with B's tensor of the same name."""

    name: str
    status: str
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    """max |a - b| / max |a|: the difference relative to the tensor's scale."""


@dataclass
class CheckpointDiff:
    """Everything that differs between two checkpoints (empty lists: none)."""

    tensors: list[TensorDifference] = field(default_factory=list)
    """Every tensor of either, in name order."""
    settings: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(section.setting, A's value, B's value) for every setting that differs."""
    counters: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(iteration | consumed_samples, A's, B's) where they differ."""

    @property
    def differing(self) -> list[TensorDifference]:
        return [t for t in self.tensors if t.status != SAME]

    @property
    def identical(self) -> bool:
        return not (self.differing or self.settings or self.counters)


CHUNK = 1 << 22
"""Elements compared at once (16 MiB of float32 per operand)."""


def natural_key(name: str) -> list[Any]:
    """Sort key that puts layers.10 after layers.9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def compare_tensors(
    a: torch.Tensor, b: torch.Tensor, name: str, scratch: dict[torch.dtype, torch.Tensor] | None = None
) -> TensorDifference:
    """One pair of tensors of the same name: shape, dtype, and (same shape) the largest differences, a chunk at a
    time, in float32, or float64 where either is. `scratch` keeps the chunk buffers from one pair to the next
    (memory: the two tensors and one chunk; no fresh pages to fault in for every pair)."""
    result = TensorDifference(name, SAME, list(a.shape), list(b.shape), dtype_name(a), dtype_name(b))
    if a.shape != b.shape:
        result.status = SHAPE
        return result
    if not a.numel():
        result.status = SAME if a.dtype == b.dtype else DTYPE
        return result
    if a.dtype == b.dtype and torch.equal(a, b):  # (stops at the first difference: cheap where they differ)
        result.max_abs = result.max_rel = 0.0
        return result
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    max_abs, scale = largest_differences(a.detach().reshape(-1), b.detach().reshape(-1), wide, scratch)
    result.max_abs = max_abs
    result.max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    # (same dtype: torch.equal said they differ; else equal values differ only by dtype)
    result.status = VALUES if a.dtype == b.dtype or max_abs != 0 else DTYPE
    return result


def largest_differences(
    a: torch.Tensor, b: torch.Tensor, wide: torch.dtype, scratch: dict[torch.dtype, torch.Tensor] | None = None
) -> tuple[float, float]:
    """max |a - b| (NaN where any difference is not a number) and max |a| (over a's numbers) of two flat tensors,
    in `wide`, one chunk at a time: a's chunk (as `wide`) is subtracted into a reused buffer, and each extreme is
    the larger of -min and max (`aminmax`: one read, no temporary of |x|)."""
    scratch = {} if scratch is None else scratch
    if wide not in scratch or scratch[wide].numel() < min(CHUNK, a.numel()):
        scratch[wide] = torch.empty(min(CHUNK, a.numel()), dtype=wide, device=a.device)
    buffer = scratch[wide]
    max_abs, scale = 0.0, 0.0
    for start in range(0, a.numel(), CHUNK):
        chunk_a, chunk_b = a[start : start + CHUNK], b[start : start + CHUNK]
        chunk_b = chunk_b.to(wide) if chunk_b.dtype == torch.bool else chunk_b  # (no subtraction of booleans)
        out = buffer[: chunk_a.numel()]
        if chunk_a.dtype == wide:
            largest = _extreme(chunk_a)
            torch.sub(chunk_a, chunk_b, out=out)
        else:
            largest = _extreme(out.copy_(chunk_a))
            out.sub_(chunk_b)
        difference = _extreme(out)
        if not math.isnan(max_abs):  # (a NaN anywhere stays the answer)
            max_abs = difference if math.isnan(difference) else max(max_abs, difference)
        scale = scale if math.isnan(largest) else max(scale, largest)
    return max_abs, scale


def _extreme(values: torch.Tensor) -> float:
    """max |values|, NaN where one is not a number."""
    low, high = torch.aminmax(values)
    low, high = float(low), float(high)
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's operations on one thread inside the `with`. Comparing is bound by memory (and by reading the files):
    one thread streams about as fast as several, leaves the other cores to the checksums' thread, and never waits on
    the thread pool's barriers, which on a busy machine cost more than the work (comparing two 475 MiB checkpoints on
    a loaded 2-core machine: 0.4-0.5 s on one thread, 1.2-3.2 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def diff_views(a: CheckpointView, b: CheckpointView) -> CheckpointDiff:
    """Compare `a` with `b`: tensors one pair at a time (on one thread: `one_thread`), then settings and counters."""
    out, scratch = CheckpointDiff(), {}
    with one_thread(), a.open_tensors() as ta, b.open_tensors() as tb:
        names_a, names_b = set(ta.names()), set(tb.names())
        for name in sorted(names_a | names_b, key=natural_key):
            if name not in names_b:
                t = ta.whole(name)
                out.tensors.append(TensorDifference(name, ONLY_A, shape_a=list(t.shape), dtype_a=dtype_name(t)))
            elif name not in names_a:
                t = tb.whole(name)
                out.tensors.append(TensorDifference(name, ONLY_B, shape_b=list(t.shape), dtype_b=dtype_name(t)))
            else:
                out.tensors.append(compare_tensors(ta.whole(name), tb.whole(name), name, scratch))
    out.settings = setting_differences(a.config, b.config)
    for counter in ("iteration", "consumed_samples"):
        value_a, value_b = getattr(a, counter), getattr(b, counter)
        if value_a is not None and value_b is not None and value_a != value_b:  # (a Hugging Face folder has none)
            out.counters.append((counter, value_a, value_b))
    return out


def flat_settings(config: Config) -> dict[str, Any]:
    """Every setting as section.name -> value."""
    return {f"{section}.{k}": v for section, values in config_to_dict(config).items() for k, v in values.items()}


def setting_differences(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    flat_a, flat_b = flat_settings(a), flat_settings(b)
    return [(key, flat_a.get(key), flat_b.get(key)) for key in flat_a | flat_b if flat_a.get(key) != flat_b.get(key)]


def diff_lines(a: CheckpointView, b: CheckpointView, diff: CheckpointDiff, limit: int | None) -> list[str]:
    """The text report of a diff; at most `limit` differing tensors listed (None: all)."""
    lines = [f"A: {a.path} ({_where(a)})", f"B: {b.path} ({_where(b)})"]
    lines += [f"{side} files: {files_checked(view)}" for side, view in (("A", a), ("B", b))]
    for counter, value_a, value_b in diff.counters:
        lines.append(f"{counter.replace('_', ' ')}: {value_a} vs {value_b}")
    lines.append(f"settings: {len(diff.settings)} differ" if diff.settings else "settings: identical")
    lines += [f"  {key}: {value_a!r} vs {value_b!r}" for key, value_a, value_b in diff.settings]
    both = sum(1 for t in diff.tensors if t.status not in (ONLY_A, ONLY_B))
    only_a = sum(1 for t in diff.tensors if t.status == ONLY_A)
    only_b = sum(1 for t in diff.tensors if t.status == ONLY_B)
    differing, same = diff.differing, sum(1 for t in diff.tensors if t.status == SAME)
    lines.append(
        f"tensors: {both} in both ({same} identical), {only_a} only in A, {only_b} only in B; {len(differing)} differ"
    )
    measured = [t for t in differing if t.max_abs is not None and not math.isnan(t.max_abs)]
    if measured:
        worst = max(measured, key=lambda t: t.max_abs or 0.0)
        lines.append(f"largest difference: {worst.name} (max abs {worst.max_abs:.3e}, max rel {worst.max_rel:.3e})")
    shown = differing if limit is None else differing[:limit]
    if shown:
        width = max(len(t.name) for t in shown)
        lines.append(f"  {'name':<{width}}  {'difference':<14} {'shape / dtype':<28} {'max abs':>10} {'max rel':>10}")
        lines += [_row(t, width) for t in shown]
        if len(shown) < len(differing):
            lines.append(f"  ... and {len(differing) - len(shown)} more (--tensors all lists every one)")
    damaged = [f"{side} {f.name} ({f.status})" for side, view in (("A", a), ("B", b)) for f in view.damaged]
    lines.append(f"DAMAGED: {', '.join(damaged)}" if damaged else "")
    lines.append("identical" if diff.identical else "differ")
    return [line for line in lines if line]


def files_checked(view: CheckpointView) -> str:
    """What was verified of a checkpoint's files, in a few words."""
    if not view.recorded:
        return "no checksums recorded (not verified)"
    if view.damaged:
        return f"{len(view.damaged)} of {len(view.recorded)} DAMAGED"
    if any(f.status == NOT_CHECKED for f in view.files):
        return f"{len(view.recorded)} not checked (--no-verify)"
    return f"{view.verified} of {len(view.recorded)} verified (sha256)"


def _where(view: CheckpointView) -> str:
    return view.source + (f", iteration {view.iteration}" if view.iteration is not None else "")


def _row(t: TensorDifference, width: int) -> str:
    if t.status == SHAPE:
        what = f"{t.shape_a} vs {t.shape_b}"
    elif t.status in (ONLY_A, ONLY_B):
        what = f"{t.shape_a or t.shape_b} {t.dtype_a or t.dtype_b}"
    else:
        what = f"{t.shape_a} {t.dtype_a}" + (f" vs {t.dtype_b}" if t.dtype_a != t.dtype_b else "")
    numbers = (
        f"{t.max_abs:>10.3e} {t.max_rel:>10.3e}" if t.max_abs is not None and t.max_rel is not None else f"{'':>21}"
    )
    return f"  {t.name:<{width}}  {t.status:<14} {what:<28} {numbers}"


def _finite(value: float | None) -> float | str | None:
    """A number JSON can hold ("inf" where a tensor of zeros became non-zero, "nan" where a value is not a number)."""
    if value is not None and not math.isfinite(value):
        return str(value)
    return value


def diff_record(a: CheckpointView, b: CheckpointView, diff: CheckpointDiff) -> dict[str, Any]:
    """The diff as JSON-ready facts."""
    return {
        "a": str(a.path),
        "b": str(b.path),
        "identical": diff.identical,
        "files": {side: {f.name: f.status for f in view.files} for side, view in (("a", a), ("b", b))},
        "damaged": [f"{side} {f.name} ({f.status})" for side, view in (("A", a), ("B", b)) for f in view.damaged],
        "counters": {name: [value_a, value_b] for name, value_a, value_b in diff.counters},
        "settings": {key: [value_a, value_b] for key, value_a, value_b in diff.settings},
        "tensors": [{**vars(t), "max_abs": _finite(t.max_abs), "max_rel": _finite(t.max_rel)} for t in diff.tensors],
    }
