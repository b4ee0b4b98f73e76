"""A training step's time on given hardware, from FLOPs, bytes and the pipeline schedule.

Each model stage's forward (F), backward (B) and deferred weight-gradient (W) operation for one
micro-batch is priced in `operations`: its compute plus the communication it cannot hide.

The pipeline schedule is then simulated with these per-stage costs (`timing.rank_times`, as `schedules.simulate`), which
gives the bubble of the actual schedule with its uneven first and last stages. After its last
backward each pipeline rank reduces its gradients over the data-parallel group (hidden behind that
backward with --overlap-grad-reduce, all but the last bucket), steps the optimizer (memory bound),
and, with the distributed optimizer, gathers the parameters behind the next forward. Those
collectives are priced on the link level they run over, as `operations` describes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from paratron.config.layout import Layout
from paratron.config.schema import Config
from paratron.parallel.pipeline.timing import FlatSchedule, flatten, rank_times
from paratron.planning.activations import WIDTHS, grad_width
from paratron.planning.hardware import Hardware, all_gather_time, all_reduce_time, link, reduce_scatter_time
from paratron.planning.live import pipeline_schedule
from paratron.planning.memory_prediction import RankMemory
from paratron.planning.operations import PARTS, rank_stages, stage_operations, stage_parameters
from paratron.training.flops import training_flops_per_token, vision_flops_per_image

OPTIMIZER_BYTES_PER_PARAMETER = 34
"""Adam over fp32 masters, memory bound: read master, gradient and both moments, write them back,
write the 16-bit weight, read the gradient again for its norm."""


# ---------------------------------------------------------------- the prediction


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    model_tflops_per_device: float
    """Model FLOPs (`training_flops_per_token`, and a vision model's `vision_flops_per_image`; recomputation not
    counted) per second per device."""
    mfu: float
    bubble_fraction: float
    """The idle share of the pipeline phase on the rank that finishes last."""


@dataclass(frozen=True)
class StepPrediction:
    """A step's predicted time in seconds (`total`) on the rank that finishes last, split into what
    that rank spends it on (the parts add up to `total`), and the throughput that follows."""

    total: float
    compute: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_p2p: float
    data_parallel: float
    bubble: float
    optimizer: float
    throughput: Throughput
    stages: tuple[tuple[float, float, float], ...] = ()
    """Per model stage, one micro-batch's (F, B, W) seconds, as simulated."""

    @property
    def step_time(self) -> float:
        return self.total

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds per part: compute, the exposed communication of each kind, bubble, optimizer."""
        return {name: getattr(self, name) for name in (*PARTS, "bubble", "optimizer")}

    @property
    def tokens_per_s(self) -> float:
        return self.throughput.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.throughput.mfu

    @property
    def model_tflops_per_device(self) -> float:
        return self.throughput.model_tflops_per_device


def predict_step(
    config: Config, layout: Layout, hardware: Hardware, memory: Sequence[RankMemory] | None = None
) -> StepPrediction:
    """The step time of `config` laid out as `layout` on `hardware`. With `memory` (the planner's
    per-stage prediction), the optimizer step reads the state sizes it predicts."""
    ops, parts = stage_operations(config, layout, hardware)
    finish, busy = _pipeline(layout, ops)
    if hardware.processes_per_core > 1 and layout.pp > 1:
        finish = _lent_cores(finish, busy, hardware.processes_per_core)
    ranks, after = _after_pipeline(config, layout, hardware, ops, memory)
    ends = [finish[r] + sum(after[r]) for r in range(layout.pp)]
    rank = max(range(layout.pp), key=ends.__getitem__)
    spent = {name: layout.num_micro_batches * sum(parts[s][name] for s in ranks[rank]) for name in PARTS}
    spent["data_parallel"] += after[rank][0]
    tokens = layout.global_batch_size * config.data.seq_length
    flops = training_flops_per_token(config.model, config.data.seq_length) * tokens
    flops += vision_flops_per_image(config.model) * layout.global_batch_size * config.planning.plan_images_per_sample
    per_device = flops / ends[rank] / layout.world_size
    bubble = max(0.0, ends[rank] - sum(spent.values()) - after[rank][1])  # (= finish - busy, to rounding)
    return StepPrediction(
        total=ends[rank],
        bubble=bubble,
        optimizer=after[rank][1],
        throughput=Throughput(
            tokens / ends[rank],
            per_device / 1e12,
            per_device / (hardware.peak_tflops * 1e12),
            bubble / finish[rank] if finish[rank] else 0.0,
        ),
        stages=tuple((op["F"], op["B"], op["W"]) for op in ops),
        **spent,
    )


def step_bound(config: Config, layout: Layout, hardware: Hardware, tail: bool = True) -> float:
    """A lower bound of `predict_step(...).total` without simulating the schedule, for the planner
    to price exactly only what could compete. A rank cannot start before the forwards of the stages
    below its first have run, is busy for all its operations, and (unless weight gradients are
    deferred) its last backward still has to pass down those stages; then (`tail`) what follows the
    pipeline. Exact for 1F1B and interleaved schedules with equal stages."""
    ops, _ = stage_operations(config, layout, hardware)
    ranks = [rank_stages(layout, r) for r in range(layout.pp)]
    after = _after_pipeline(config, layout, hardware, ops, None)[1] if tail else [(0.0, 0.0)] * layout.pp
    split = layout.pipeline.schedule in ("zb-h1", "zb-v")
    fill = [0.0]  # forwards (and backwards) of the stages below each stage
    for op in ops:
        fill.append(fill[-1] + op["F"] + (0.0 if split else op["B"]))
    m, bound = layout.num_micro_batches, 0.0
    for rank, stages in enumerate(ranks):
        busy = m * sum(ops[s]["F"] + ops[s]["B"] + ops[s]["W"] for s in stages)
        bound = max(bound, fill[min(stages)] + busy + sum(after[rank]))
    return bound


def _after_pipeline(
    config: Config,
    layout: Layout,
    hardware: Hardware,
    ops: list[dict[str, float]],
    memory: Sequence[RankMemory] | None,
) -> tuple[list[list[int]], list[tuple[float, float]]]:
    """Each pipeline rank's model stages, and its (exposed data-parallel traffic, optimizer step)."""
    params = stage_parameters(config, layout)
    ranks = [rank_stages(layout, r) for r in range(layout.pp)]
    after, seen = [], {}
    for r, stages in enumerate(ranks):
        mine = (sum(params[s][0] for s in stages), sum(params[s][1] for s in stages))
        key = (mine, tuple(id(ops[s]) for s in stages))  # (ranks alike in stages and operations: once)
        if key not in seen or memory is not None:
            seen[key] = sum(data_parallel_tail(config, layout, hardware, mine, [ops[s] for s in stages]))
        after.append((seen[key], _optimizer_time(config, layout, hardware, mine, memory, r)))
    return ranks, after


def data_parallel_tail(
    config: Config,
    layout: Layout,
    hardware: Hardware,
    params: tuple[float, float],
    ops: list[dict[str, float]],
) -> tuple[float, float]:
    """What a pipeline rank (`params`: its trained elements, `ops`: its stages' operations) adds
    after its last backward: the exposed part of its gradient reduction (behind that backward with
    --overlap-grad-reduce, all but the last bucket; ZeRO-2 reduced every micro-batch already) and
    the exposed parameter all-gather of ZeRO-1/2 (behind the next forward with
    --overlap-param-gather)."""
    p, (dense, expert) = config.parallel, params
    stage, ep = p.zero_stage, p.expert_model_parallel_size
    groups = [
        (dense, layout.dp * layout.cp, link(hardware, layout.tp, layout.dp * layout.cp)),
        (expert, layout.dp // ep, link(hardware, layout.tp * layout.cp * ep, layout.dp // ep)),
    ]
    bucket = p.gradient_bucket_size(layout.dp)
    collective, g = (all_reduce_time if stage == 0 else reduce_scatter_time), grad_width(config)
    reduce = 0.0
    if stage != 2:
        total = sum(collective(n_params * g, n, over) for n_params, n, over in groups)
        last = collective(min(bucket, dense) * g, *groups[0][1:])
        window = sum(op["B"] + op["W"] for op in ops)
        hidden = (p.overlap_grad_reduce or stage == 3) and hardware.overlaps_communication
        reduce = max(last, total - window) if hidden else total
    gather = 0.0
    if stage in (1, 2):
        act = WIDTHS[config.training.precision]
        total = sum(all_gather_time(n_params * act, n, over) for n_params, n, over in groups)
        first = all_gather_time(min(bucket, dense) * act, *groups[0][1:])
        window = sum(op["F"] for op in ops)
        hidden = p.overlap_param_gather and hardware.overlaps_communication
        gather = max(first, total - window) if hidden else total
    return reduce, gather


def _optimizer_time(
    config: Config,
    layout: Layout,
    hardware: Hardware,
    params: tuple[float, float],
    memory: Sequence[RankMemory] | None,
    rank: int,
) -> float:
    """The optimizer step: memory bound, over this rank's shard of the state."""
    mine = [m for m in memory or () if m.stage == rank]
    if mine:
        state = mine[0]
        read_write = 3.5 * state.master + 2 * state.optimizer_state if state.master else 3 * state.parameters
        return (read_write + (2 * state.optimizer_state if not state.master else 0)) / (hardware.memory_gbps * 1e9)
    p = config.parallel
    shard = layout.dp * layout.cp if p.zero_stage >= 1 else 1
    expert_shard = layout.edp if p.zero_stage >= 1 else 1
    elements = params[0] / shard + params[1] / expert_shard
    return elements * OPTIMIZER_BYTES_PER_PARAMETER / (hardware.memory_gbps * 1e9)


def _lent_cores(finish: list[float], busy: list[float], crowding: float) -> list[float]:
    """With more processes than cores, operations are priced at a share of a core; but a rank that
    waits lends its core, so the pipeline takes no less than its critical path at a whole core's
    speed and no less than the ranks' work spread over the cores (their mean busy time)."""
    spread = sum(busy) / len(busy)
    return [min(end, max(spread, end / crowding)) for end in finish]


def _pipeline(layout: Layout, ops: list[dict[str, float]]) -> tuple[list[float], list[float]]:
    """Per pipeline rank, when its last operation ends and how long it was busy, from the simulated
    schedule (no pipeline: the micro-batches back to back)."""
    m = layout.num_micro_batches
    if layout.pp == 1:
        total = m * sum(op["F"] + op["B"] + op["W"] for op in ops)
        return [total], [total]
    scale = max(max(op.values()) for op in ops) or 1.0
    key = tuple(tuple(round(op[k] / scale, 4) for k in "FBW") for op in ops)
    finish, busy = _simulated(layout.pipeline.schedule or "1f1b", layout.pp, m, layout.pipeline.chunks, key)
    return [f * scale for f in finish], [b * scale for b in busy]


Times = tuple[tuple[float, ...], tuple[float, ...]]
"""Per pipeline rank: when its last operation ends, and how long it was busy."""

STEADY_GROUPS = 4
"""Groups of `pp` micro-batches a schedule is simulated with before its steady state is trusted (`_simulated`)."""


@functools.lru_cache(maxsize=8192)
def _simulated(
    name: str, pp: int, microbatches: int, chunks: int, costs: tuple[tuple[float, float, float], ...]
) -> Times:
    """(finish, busy) per rank of one schedule under per-stage (F, B, W) costs; cached, as the
    search meets the same relative costs many times.

    A long schedule is not simulated whole. Past its warm-up a schedule repeats: every further group
    of `pp` micro-batches adds the same time to each rank's finish and busy time. So the schedule is
    simulated with k, k + pp and k + 2 pp micro-batches (k = `STEADY_GROUPS` groups or more, as many
    as `microbatches` modulo pp); when the two increments agree (to 1e-9 of the time), the times
    are extended to `microbatches` along that line, else the whole schedule is simulated. Thousands
    of micro-batches (a large global batch over few data-parallel ranks) then cost three short
    simulations instead of one of ~10^6 operations; tests/unit/test_planner.py checks the line
    against whole simulations of every schedule kind."""
    q = pp
    first = STEADY_GROUPS * pp  # (measured: every kind is steady within 2-3 groups, whatever its chunks)
    first += (microbatches - first) % q
    if microbatches < 3 * (first + 2 * q):  # (three short simulations must cost less than the whole one)
        return _whole(name, pp, microbatches, chunks, costs)
    a, b, c = (_whole(name, pp, first + i * q, chunks, costs) for i in range(3))
    groups = (microbatches - first) // q
    extended = []
    for x, y, z in zip((*a[0], *a[1]), (*b[0], *b[1]), (*c[0], *c[1])):
        step = y - x
        if abs((z - y) - step) > 1e-9 * max(abs(z), 1e-30):
            return _whole(name, pp, microbatches, chunks, costs)
        extended.append(x + groups * step)
    return tuple(extended[:pp]), tuple(extended[pp:])


def _whole(name: str, pp: int, microbatches: int, chunks: int, costs: tuple[tuple[float, float, float], ...]) -> Times:
    """(finish, busy) per rank from simulating every operation of the schedule."""
    finish, busy = rank_times(_flat_schedule(name, pp, microbatches, chunks), costs)
    return tuple(finish), tuple(busy)


@functools.lru_cache(maxsize=64)
def _flat_schedule(name: str, pp: int, microbatches: int, chunks: int) -> FlatSchedule:
    """The schedule in dependency order, for `_simulated`'s passes under different costs."""
    return flatten(pipeline_schedule(name, pp, microbatches, chunks))
