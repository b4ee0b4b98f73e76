"""The search over parallel layouts: every valid way to run a model on a world of devices, its
memory and its predicted step time, ranked by throughput.

A layout is tensor x context x expert x data x pipeline parallel sizes, virtual stages or the
first and last stage's layer counts, the micro-batch size, recomputation (none, selective, full,
or the fewest layers per chunk that fit), the ZeRO stage and the pipeline schedule (1f1b,
interleaved, zb-h1, zb-v). Tensor parallelism, and expert x tensor parallelism, stay inside a
node; sequence parallelism is on wherever tensor parallelism is (the same traffic, less memory),
and so are gradient-reduction overlap and, with the distributed optimizer, parameter-gather
overlap. Each candidate (enumerated in `candidates`) passes `config.validation.validate`, then
`memory_prediction.predict_memory` (the numbers `paratron train --dry-run` prints) against the device memory,
then `cost.predict_step`.

Pruning, so that thousands of devices plan in seconds: candidates are priced in the order of a
bound of their step time that needs no schedule simulation (`cost.step_bound`), and only while the
bound is within `within` of the best plan found so far; memory only shrinks with more
recomputation, a higher ZeRO stage and a smaller micro-batch, so a layout whose most frugal variant
does not fit is dropped with its larger micro-batches; memory, bounds and simulations are cached.
A layout's variants (recomputation, ZeRO stage) share its shape, so they are bounded with it before
`validate` sees them and validated only where the bound could keep them; activations are shared
between ZeRO stages. tests/unit/test_planner.py checks the plans against pricing every variant.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from paratron.config.fields import all_fields, flag
from paratron.config.layout import Layout
from paratron.config.loading import override
from paratron.config.schema import Config
from paratron.config.validation import validate
from paratron.errors import ConfigError
from paratron.planning.activations import KERNELS
from paratron.planning.candidates import (
    MAX_MICRO_BATCH,
    Shape,
    dividing_worlds,
    micro_batch_sizes,
    shapes,
    zero_bubble_too_long,
    zero_stages,
)
from paratron.planning.cost import StepPrediction, predict_step, step_bound
from paratron.planning.dry_run import with_vocabulary
from paratron.planning.hardware import Hardware
from paratron.planning.launch_line import launch_command, slurm_command
from paratron.planning.memory_prediction import RankMemory, predict_memory

LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "pipeline_schedule",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "micro_batch_size",
    "sequence_parallel",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "zero_stage",
    "overlap_grad_reduce",
    "overlap_param_gather",
)
"""The settings a plan chooses; a plan sets all of them, replacing what the config had."""

RECOMPUTE = {None: {}, "selective": {}, "full": {"recompute_method": "uniform", "recompute_num_layers": 1}}

WITHIN = 1.1
"""Plans predicted up to this factor slower than the fastest are listed (and priced exactly); the
others are dropped as soon as a bound shows they cannot come closer."""


@dataclass(frozen=True)
class Plan:
    """One feasible layout: its settings (flat config fields), memory and predicted step."""

    settings: dict[str, Any]
    layout: Layout
    memory: tuple[RankMemory, ...]
    prediction: StepPrediction
    config: Config = field(repr=False, compare=False)
    gpus_per_node: int = 8

    @property
    def peak_memory(self) -> int:
        """Bytes of the fullest rank."""
        return max(m.total for m in self.memory)

    def describe(self) -> str:
        return describe(self.settings, self.layout)

    def command(self) -> str:
        return launch_command(self.config, self.layout.world_size, self.gpus_per_node)

    def slurm_command(self) -> str | None:
        return slurm_command(self.config, self.layout.world_size, self.gpus_per_node)


@dataclass(frozen=True)
class Unpriced:
    """A layout the search enumerated but did not price: the fastest variant of a layout whose step
    time bound (`cost.step_bound`, no schedule simulated) already exceeds `within` x the fastest
    plan; one that does not fit even with full recomputation and the highest ZeRO stage; one a
    priced variant exceeded; or one `validate` refuses. plans.json lists these beside the plans,
    so every layout considered is on record with what is known of it."""

    settings: dict[str, Any]
    layout: Layout | None
    reason: str
    """slower | out of memory | refused | schedule too long"""
    detail: str
    step_time_s: float | None = None
    """Exact when priced (a variant slower than `within`), else None."""
    step_time_bound_s: float | None = None
    """A lower bound of the step time: no variant of the layout is faster."""
    memory: tuple[RankMemory, ...] | None = None
    """Per-stage memory where the search computed it (the most frugal variant for out of memory)."""
    config: Config | None = field(default=None, repr=False, compare=False)
    gpus_per_node: int = 8

    def describe(self) -> str:
        return describe(self.settings, self.layout) if self.layout is not None else str(self.settings)

    def command(self) -> str | None:
        if self.config is None or self.layout is None:
            return None
        return launch_command(self.config, self.layout.world_size, self.gpus_per_node)

    def slurm_command(self) -> str | None:
        if self.config is None or self.layout is None:
            return None
        return slurm_command(self.config, self.layout.world_size, self.gpus_per_node)


def describe(settings: dict[str, Any], layout: Layout) -> str:
    """A layout's short name: TP8 CP1 PP8 v2 DP64 mbs1 interleaved ZeRO-1 selective; first and
    last stage layer counts in brackets, (7/7), or (embedding/loss counted) when those count as
    layers of the end stages, block recomputation as `recompute 2/chunk`."""
    s, pipeline = settings, layout.pipeline
    pipe = f" v{pipeline.chunks}" if pipeline.chunks > 1 else ""
    ends = s["decoder_first_pipeline_num_layers"], s["decoder_last_pipeline_num_layers"]
    pipe += f" ({ends[0]}/{ends[1]})" if ends[0] is not None else ""
    pipe += " (embedding/loss counted)" if s.get("account_for_embedding_in_pipeline_split") else ""
    ep = f" EP{s['expert_model_parallel_size']}" if s["expert_model_parallel_size"] > 1 else ""
    schedule = f" {pipeline.schedule}" if layout.pp > 1 else ""
    recompute = f" {s['recompute_granularity']}" if s["recompute_granularity"] else ""
    if s["recompute_method"] == "block":
        recompute = f" recompute {s['recompute_num_layers']}/chunk"
    return (
        f"TP{layout.tp} CP{layout.cp}{ep} PP{layout.pp}{pipe} DP{layout.dp} mbs{layout.micro_batch_size}{schedule}"
        f" ZeRO-{s['zero_stage']}{recompute}"
    )


def plan(
    config: Config,
    world_size: int,
    hardware: Hardware,
    global_batch: int | None = None,
    seq_length: int | None = None,
    top: int | None = None,
    within: float = WITHIN,
) -> list[Plan]:
    """The feasible layouts of `config`'s model on `world_size` devices of `hardware` predicted
    within a factor `within` of the fastest, fastest first (`top`: only the first so many).
    ConfigError (one line) when no layout divides the world and batch, or none fits the memory."""
    plans, _ = search(config, world_size, hardware, global_batch, seq_length, within)
    return plans[:top] if top else plans


def search(
    config: Config,
    world_size: int,
    hardware: Hardware,
    global_batch: int | None = None,
    seq_length: int | None = None,
    within: float = WITHIN,
) -> tuple[list[Plan], list[Unpriced]]:
    """`plan`'s plans (all of them) and every other layout the search enumerated, with why it is
    not among them, fastest bound first."""
    given = _request(config, global_batch, seq_length)
    run = _Search(with_vocabulary(given), world_size, hardware, within, given)
    plans = run.run()
    if not plans:
        raise ConfigError(run.failure())
    plans.sort(key=lambda p: (-p.prediction.tokens_per_s, p.peak_memory))
    return plans, run.unpriced


def _request(config: Config, global_batch: int | None, seq_length: int | None) -> Config:
    """`config` with the batch and sequence asked for (a longer sequence raises the position limit)."""
    values: dict[str, Any] = {}
    if global_batch is not None:
        values["global_batch_size"] = global_batch
    if seq_length is not None:
        values["seq_length"] = seq_length
        values["max_position_embeddings"] = max(seq_length, config.model.max_position_embeddings)
    base = override(config, **values) if values else config
    if base.training.global_batch_size is None:
        raise ConfigError(f"planning a layout needs {flag.global_batch_size} (the samples of one step)")
    return base


def apply(config: Config, settings: dict[str, Any], made: dict[tuple, Any] | None = None) -> Config:
    """`config` with flat settings replaced (fast: no re-checking; `validate` checks the result). `made`: sections
    already replaced, by their values (candidates share most of them), to reuse and add to."""
    sections: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        sections.setdefault(all_fields()[name].section, {})[name] = value
    replaced = {}
    for section, values in sections.items():
        key = (id(config), section, *values.items())
        if made is None or key not in made:
            found = dataclasses.replace(getattr(config, section), **values)
            if made is None:
                replaced[section] = found
                continue
            made[key] = found
        replaced[section] = made[key]
    return dataclasses.replace(config, **replaced)


class _Search:
    """One planning run: candidates, their memory (cached) and predictions."""

    def __init__(
        self, base: Config, world_size: int, hardware: Hardware, within: float = WITHIN, given: Config | None = None
    ) -> None:
        """`base`: the config to price (its vocabulary known); `given`: the one plans are told as."""
        self.base, self.world, self.hardware = base, world_size, hardware
        self.given = given or base
        self.kernels = KERNELS["cpu" if hardware.name == "cpu" else "cuda"]
        self.limit = hardware.device_memory_bytes
        self.memory_cache: dict[tuple, list[RankMemory]] = {}
        self.sections: dict[tuple, Any] = {}  # config sections with a candidate's settings, by them (`apply`)
        self.layouts: dict[tuple, tuple[Config, Layout] | None] = {}
        self.bounds: dict[tuple, float] = {}
        self.unchecked: dict[tuple, tuple[float, Layout]] = {}  # bounds before `validate`, with their layout
        self.activations: dict[tuple, list[int]] = {}  # per rank, by the settings less the ZeRO stage and overlap
        self.within = within
        self.frugal: tuple[float, str] | None = None  # least memory seen: (bytes, description)
        self.divides = False
        self.refusal: str | None = None  # the first reason validation refused a candidate
        self.refusals: dict[tuple, str] = {}
        self.unpriced: list[Unpriced] = []

    def run(self) -> list[Plan]:
        """Price layouts in the order of their bound (the fastest variant of each, not simulated),
        exactly where the bound is within `within` of the best plan found so far."""
        groups = []
        for shape in shapes(self.base, self.world, self.hardware.gpus_per_node):
            for mbs in micro_batch_sizes(self.base, self.world, shape):
                self.divides = True
                fastest = self._fastest(shape, mbs)
                found = self._layout(fastest)
                if found is None:
                    self._skip(fastest, "refused", self.refusals[tuple(fastest.values())])
                elif zero_bubble_too_long(self.base, self.world, shape, mbs):
                    self._skip(fastest, "schedule too long", "too many operations to simulate a zero-bubble order")
                else:
                    groups.append((step_bound(*found, self.hardware, tail=False), len(groups), shape, mbs))
        groups.sort()
        plans: list[Plan] = []
        best, too_big = float("inf"), set()
        for rank, (bound, _, shape, mbs) in enumerate(groups):
            if bound > best * self.within:
                for later_bound, _, later_shape, later_mbs in groups[rank:]:
                    self._skip_slower(later_shape, later_mbs, later_bound, best)
                break
            if (shape, mbs) in too_big or not self._fits(self._frugal(shape, mbs)):
                self._skip_too_big(shape, mbs, bound)
                too_big.update((shape, b) for b in range(mbs, MAX_MICRO_BATCH + 1))
                continue
            tried, priced = 0, 0
            for zero in zero_stages(self.base, self.world, shape):
                for settings in self._variants(shape, mbs, zero, best * self.within):
                    tried += 1
                    found = self._evaluate(settings)
                    if found is not None:
                        plans.append(found)
                        priced += 1
                        best = min(best, found.prediction.total)
            if not priced:  # the variants within the cutoff do not fit (or there were none): the rest are slower
                slower = self._slowest_bound(shape, mbs, best * self.within)
                if slower is not None:
                    self._skip_slower(shape, mbs, slower, best, fitting=bool(tried))
                else:
                    self._skip_too_big(shape, mbs, bound, "no variant fits")
        for p in plans:
            if p.prediction.total > best * self.within:
                self._skip(p.settings, "slower", f"{p.prediction.total / best:.2f}x the fastest", p.prediction.total)
        self.unpriced.sort(key=lambda u: u.step_time_s or u.step_time_bound_s or float("inf"))
        return [p for p in plans if p.prediction.total <= best * self.within]

    def _skip(
        self,
        settings: dict[str, Any],
        reason: str,
        detail: str,
        time: float | None = None,
        bound: float | None = None,
        memory: list[RankMemory] | None = None,
    ) -> None:
        found = self._layout(settings)
        config, layout = (apply(self.given, settings, self.sections), found[1]) if found is not None else (None, None)
        self.unpriced.append(
            Unpriced(
                dict(settings),
                layout,
                reason,
                detail,
                time,
                bound,
                tuple(memory) if memory is not None else None,
                config,
                self.hardware.gpus_per_node,
            )
        )

    def _skip_slower(self, shape: Shape, mbs: int, bound: float, best: float, fitting: bool = False) -> None:
        fastest = self._fastest(shape, mbs)
        detail = f"at least {bound / best:.2f}x the fastest plan's step time"
        if fitting:
            detail += f" in the variants that fit (those within {self.within:g}x do not)"
        self._skip(fastest, "slower", detail, bound=bound, memory=self.memory_cache.get(_memory_key(fastest)))

    def _skip_too_big(self, shape: Shape, mbs: int, bound: float, detail: str | None = None) -> None:
        frugal = self._frugal(shape, mbs)
        memory = self.memory_cache.get(_memory_key(frugal))
        if detail is None and memory is not None:
            need = max(m.total for m in memory)
            detail = f"needs {need / 1e9:.1f} GB with full recomputation and ZeRO-{frugal['zero_stage']}"
        self._skip(
            frugal,
            "out of memory",
            detail or "a smaller micro-batch of this layout already does not fit",
            bound=bound,
            memory=memory,
        )

    def _variants(self, shape: Shape, mbs: int, zero: int, cutoff: float) -> Iterator[dict[str, Any]]:
        """The recomputation variants whose bound is within `cutoff`: none, selective, full, and
        where keeping every layer does not fit but recomputing all of them does, the fewest
        recomputed layers per chunk that fit (the block method, between none and full in time)."""
        options = self._options(shape, mbs, zero)
        for settings in options:
            if self._within(settings, shape, mbs, cutoff):
                yield settings
        if (
            self._within(options[0], shape, mbs, cutoff)
            and self._within(self._block(shape, mbs, zero, 1), shape, mbs, cutoff)  # (more layers: slower still)
            and not self._fits(options[0])
            and self._fits(options[-1])
        ):
            partial = self._fewest_recomputed(shape, mbs, zero)
            if partial is not None and self._bound(partial) <= cutoff:
                yield partial

    def _within(self, settings: dict[str, Any], shape: Shape, mbs: int, cutoff: float) -> bool:
        """`_bound(settings) <= cutoff`, validating the settings only when their unchecked bound is within."""
        return self._unchecked_bound(settings, shape, mbs) <= cutoff and self._bound(settings) <= cutoff

    def _unchecked_bound(self, settings: dict[str, Any], shape: Shape, mbs: int) -> float:
        """`_bound` of a variant of a layout priced with the layout of its fastest variant, before `validate`
        sees it: recomputation, ZeRO stage and overlap leave the layout as it was, so where `validate` accepts
        the variant this is its bound (where it refuses, `_bound` is infinite). The fastest variant of a layout
        the search prices was accepted."""
        key = tuple(settings.values())
        if key in self.bounds:
            return self.bounds[key]
        if key not in self.unchecked:
            fastest = self.layouts.get(tuple(self._fastest(shape, mbs).values()))
            if fastest is None:
                return self._bound(settings)
            config = apply(self.base, settings, self.sections)
            self.unchecked[key] = (step_bound(config, fastest[1], self.hardware), fastest[1])
        return self.unchecked[key][0]

    def _slowest_bound(self, shape: Shape, mbs: int, cutoff: float) -> float | None:
        """The least `_bound` above `cutoff` among a layout's variants (infinite for refused ones); None
        when every variant is accepted and within it."""
        variants = [v for z in zero_stages(self.base, self.world, shape) for v in self._options(shape, mbs, z)]
        above = sorted((self._unchecked_bound(v, shape, mbs), i) for i, v in enumerate(variants))
        if any(self._layout(variants[i]) is None for unchecked, i in above if unchecked <= cutoff):
            return min((self._bound(variants[i]) for unchecked, i in above if unchecked > cutoff), default=math.inf)
        for unchecked, i in above:
            if unchecked > cutoff and self._layout(variants[i]) is not None:
                return unchecked
        return math.inf if any(unchecked > cutoff for unchecked, _ in above) else None

    def _fastest(self, shape: Shape, mbs: int) -> dict[str, Any]:
        """The variant of a layout with the shortest bound: no recomputation, the lowest ZeRO stage."""
        return self._settings(shape, mbs, None, min(zero_stages(self.base, self.world, shape)))

    def _options(self, shape: Shape, mbs: int, zero: int) -> list[dict[str, Any]]:
        """The layout's settings at each recomputation of RECOMPUTE (none, selective, full)."""
        return [self._settings(shape, mbs, recompute, zero) for recompute in RECOMPUTE]

    def _fewest_recomputed(self, shape: Shape, mbs: int, zero: int) -> dict[str, Any] | None:
        """Block recomputation of the fewest layers per chunk that fit (memory shrinks as they grow)."""
        found = self._layout(self._settings(shape, mbs, None, zero))
        if found is None:
            return None
        lo, hi, best = 1, max(found[1].pipeline.counts) - 1, None
        while lo <= hi:
            k = (lo + hi) // 2
            settings = self._block(shape, mbs, zero, k)
            if self._fits(settings):
                best, hi = settings, k - 1
            else:
                lo = k + 1
        return best

    def _block(self, shape: Shape, mbs: int, zero: int, layers: int) -> dict[str, Any]:
        """Block recomputation of `layers` layers per chunk."""
        return self._settings(shape, mbs, "full", zero) | {"recompute_method": "block", "recompute_num_layers": layers}

    def _bound(self, settings: dict[str, Any]) -> float:
        key = tuple(settings.values())
        if key not in self.bounds:
            found, unchecked = self._layout(settings), self.unchecked.get(key)
            if found is None:
                self.bounds[key] = float("inf")
            elif unchecked is not None and unchecked[1] == found[1]:  # (the same config and layout: the same bound)
                self.bounds[key] = unchecked[0]
            else:
                self.bounds[key] = step_bound(*found, self.hardware)
        return self.bounds[key]

    def _layout(self, settings: dict[str, Any]) -> tuple[Config, Layout] | None:
        """The settings' config and layout; None if `validate` refuses them."""
        key = tuple(settings.values())
        if key not in self.layouts:
            config = apply(self.base, settings, self.sections)
            try:
                self.layouts[key] = (config, validate(config, self.world, check_data=False))
            except ConfigError as exc:
                self.layouts[key] = None
                self.refusals[key] = str(exc)
                self.refusal = self.refusal or str(exc)
        return self.layouts[key]

    def _frugal(self, shape: Shape, mbs: int) -> dict[str, Any]:
        """The variant of a layout that needs the least memory: full recomputation, the highest ZeRO stage."""
        return self._settings(shape, mbs, "full", max(zero_stages(self.base, self.world, shape)))

    def _settings(self, shape: Shape, mbs: int, recompute: str | None, zero: int) -> dict[str, Any]:
        sp = shape.tp > 1
        dp_cp = self.world // (shape.tp * shape.pp)
        return {
            "tensor_model_parallel_size": shape.tp,
            "context_parallel_size": shape.cp,
            "expert_model_parallel_size": shape.ep,
            "pipeline_model_parallel_size": shape.pp,
            "virtual_pipeline_model_parallel_size": shape.chunks if shape.schedule == "interleaved" else None,
            "num_layers_per_virtual_pipeline_stage": None,
            "pipeline_schedule": shape.schedule,
            "decoder_first_pipeline_num_layers": shape.first,
            "decoder_last_pipeline_num_layers": shape.last,
            "account_for_embedding_in_pipeline_split": shape.ends_counted,
            "account_for_loss_in_pipeline_split": shape.ends_counted,
            "micro_batch_size": mbs,
            "sequence_parallel": sp,
            "recompute_granularity": recompute,
            "recompute_method": None,
            "recompute_num_layers": None,
            **RECOMPUTE[recompute],
            "zero_stage": zero,
            "overlap_grad_reduce": dp_cp > 1,
            "overlap_param_gather": zero in (1, 2) and dp_cp > 1,
        }

    def _memory(self, settings: dict[str, Any]) -> tuple[Config, Layout, list[RankMemory]] | None:
        """The settings' config, layout and memory (cached); None if `validate` refuses them."""
        found = self._layout(settings)
        if found is None:
            return None
        key = _memory_key(settings)
        if key not in self.memory_cache:
            same = tuple(v for k, v in settings.items() if k != "zero_stage" and not k.startswith("overlap"))
            memory = predict_memory(found[0], self.world, self.kernels, found[1], self.activations.get(same))
            self.activations[same] = [m.activations for m in memory]
            self.memory_cache[key] = memory
        return found[0], found[1], self.memory_cache[key]

    def _fits(self, settings: dict[str, Any]) -> bool:
        """Whether the settings' fullest rank fits the device (invalid settings: True, left to `_evaluate`)."""
        found = self._memory(settings)
        if found is None:
            return True
        need = max(m.total for m in found[2])
        if self.frugal is None or need < self.frugal[0]:
            self.frugal = (need, describe(settings, found[1]))
        return need <= self.limit

    def _evaluate(self, settings: dict[str, Any]) -> Plan | None:
        found = self._memory(settings)
        if found is None:
            return None
        config, layout, memory = found
        if max(m.total for m in memory) > self.limit:
            return None
        prediction = predict_step(config, layout, self.hardware, memory)
        told = apply(self.given, settings, self.sections)
        return Plan(settings, layout, tuple(memory), prediction, told, self.hardware.gpus_per_node)

    def failure(self) -> str:
        """The one-line reason no plan came out, with what would change that."""
        m, gb = self.base.model, self.base.training.global_batch_size
        name = m.model_name or f"the {m.num_layers}-layer model"
        if not self.divides:
            worlds = dividing_worlds(self.base, self.world, self.hardware.gpus_per_node)
            hint = f"world sizes that would: {', '.join(map(str, worlds))}" if worlds else "change the batch"
            return (
                f"no layout of {name} on {self.world} ranks divides {flag.global_batch_size} {gb} and "
                f"{flag.num_layers} {m.num_layers}; {hint}"
            )
        if self.frugal is None:  # every candidate refused: a setting outside the layout is wrong
            return f"no layout of {name} on {self.world} ranks passes validation: {self.refusal}"
        need, what = self.frugal
        world = smallest_fitting_world(self.base, self.world, self.hardware, self.kernels)
        more = f", or at least {world} ranks" if world else ""
        return (
            f"no layout of {name} fits {self.hardware.device_memory_gb:g} GB per device on {self.world} ranks: "
            f"the most frugal ({what}) needs {need / 1e9:.1f} GB; use devices of at least {need / 1e9:.1f} GB{more}"
        )


def _memory_key(settings: dict[str, Any]) -> tuple:
    """What memory depends on: the settings less the overlap switches (the same buffers either way)."""
    return tuple(v for k, v in settings.items() if not k.startswith("overlap"))


# ---------------------------------------------------------------- what would fit


def smallest_fitting_world(config: Config, world: int, hardware: Hardware, kernels: Any) -> int | None:
    """The smallest of 2, 4, ... 64 x `world` where some layout's most frugal variant fits."""
    for factor in (2, 4, 8, 16, 32, 64):
        search = _Search(config, world * factor, hardware)
        for shape in shapes(config, world * factor, hardware.gpus_per_node):
            sizes = micro_batch_sizes(config, world * factor, shape)
            if (
                sizes
                and search._memory(search._frugal(shape, sizes[0]))
                and search._fits(search._frugal(shape, sizes[0]))
            ):
                return world * factor
    return None
