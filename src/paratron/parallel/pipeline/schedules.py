"""Pipeline schedules as data: for every pipeline rank, the ordered list of operations it runs.

A schedule is generated first and executed afterwards (`runtime.py`), so it can be printed,
checked for deadlocks, simulated and drawn (`paratron schedule`) without any process.

Operations, per micro-batch `m` and model chunk `c` of this rank:

    F(m, c)   forward of chunk c on micro-batch m
    B(m, c)   backward; the whole backward, or only the input gradients when the schedule
              splits the weight gradients out (zero-bubble schedules)
    W(m, c)   the weight gradients of B(m, c), deferred to fill the bubble

Chunk c on rank r is model stage `c * pp + r` (Megatron's interleaved layout; one chunk per
rank unless virtual stages are asked for), except under ZB-V, whose two chunks per rank form
a V: rank r holds stages r and 2 pp - 1 - r, so the first rank holds the first and the last
stage and the middle two stages sit on the last rank. Communication follows from the data dependencies:
the runtime receives a stage's input before F and its output gradient before B, and sends as
soon as they are produced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from paratron.config.layout import check_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Schedule:
    name: str
    pp: int
    microbatches: int
    chunks: int = 1
    """Model chunks (virtual stages) per rank."""
    split_backward: bool = False
    """B computes input gradients only and W the weight gradients."""
    ranks: list[list[Action]] = field(default_factory=list)
    v_shape: bool = False
    """Two chunks per rank placed as a V (ZB-V) rather than interleaved."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.pp, self.v_shape)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding model stage `stage`."""
        if self.v_shape:
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp

    def __str__(self) -> str:
        width = max(len(str(a)) for actions in self.ranks for a in actions)
        return "\n".join(
            f"rank {r}: " + " ".join(f"{str(a):<{width}}" for a in actions) for r, actions in enumerate(self.ranks)
        )


def stage_of(rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Model stage of chunk `chunk` on pipeline rank `rank`."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def build_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The operation lists of every rank for `name` (one of SCHEDULES). ZB-V always runs two
    chunks per rank (`chunks` 1 is taken to mean that)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    check_schedule(name, pp, microbatches, chunks)
    if name == "zb-v":
        return Schedule(
            name, pp, microbatches, 2, split_backward=True, ranks=_zero_bubble_v(pp, microbatches), v_shape=True
        )
    schedule = Schedule(name, pp, microbatches, chunks, split_backward=name == "zb-h1")
    if name == "zb-h1":
        schedule.ranks = _zero_bubble_h1(pp, microbatches)
    else:
        maker = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[name]
        schedule.ranks = maker(pp, microbatches, chunks)
    return schedule


def _gpipe(pp: int, m: int, chunks: int) -> list[list[Action]]:
    """All forwards, then all backwards: m micro-batches of activations alive at once."""
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]


def _one_f_one_b(pp: int, m: int, chunks: int) -> list[list[Action]]:
    """Warm up with pp - rank - 1 forwards, then alternate one forward and one backward."""
    forwards, backwards = [Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)]
    return [_warm_then_alternate(forwards, backwards, min(pp - rank - 1, m)) for rank in range(pp)]


def _interleaved(pp: int, m: int, chunks: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through the chunks in groups of pp, so
    the bubble shrinks by the number of chunks for the price of more point-to-point traffic.
    The k-th forward and the k-th backward are the same on every rank; the warm-up differs."""
    total = m * chunks
    forwards = [Action("F", (k // (pp * chunks)) * pp + k % pp, (k // pp) % chunks) for k in range(total)]
    backwards = [Action("B", (k // (pp * chunks)) * pp + k % pp, chunks - 1 - (k // pp) % chunks) for k in range(total)]

    def warmup(rank: int) -> int:
        return total if m == pp else min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)

    return [_warm_then_alternate(forwards, backwards, warmup(rank)) for rank in range(pp)]


def _warm_then_alternate(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup :]


Option = tuple[str, int, int, int]  # (kind, microbatch, chunk, priority: lower first)
Counts = dict[tuple[str, int], int]  # (kind, chunk) -> operations run so far


def _zero_bubble_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2023): 1F1B with the backward split into input gradients (B) and weight
    gradients (W). Forwards come first whenever no more than pp - rank micro-batches await
    their B (1F1B's activation memory); rank r holds back up to r weight gradients (one runs
    as soon as more wait), so that the input gradients race down the pipeline in the cool-down
    while the held-back W fill the time each rank would otherwise wait. Generated by
    simulating the pipeline with equal F, B and W costs; the bubble is a third of 1F1B's
    when micro-batches >= stages."""

    def options(rank: int, c: Counts) -> list[Option]:
        deferred = c[("B", 0)] - c[("W", 0)]
        if deferred > rank:  # as many weight gradients waiting as allowed: run one now
            return [("W", c[("W", 0)], 0, 0)]
        found = [("W", c[("W", 0)], 0, 2)] if deferred and c[("F", 0)] == m else []  # kept for the cool-down
        if c[("B", 0)] < c[("F", 0)]:
            found.append(("B", c[("B", 0)], 0, 1))
        if c[("F", 0)] < m and c[("F", 0)] - c[("B", 0)] < pp - rank:
            found.append(("F", c[("F", 0)], 0, 0))
        return found

    return _simulated_order(pp, m, chunks=1, v_shape=False, cost=1.0, options=options)


def _zero_bubble_v(pp: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al., 2024): two chunks per rank in a V, backward split into B and W.
    Generated like ZB-H1 by simulating equal F, B and W costs (half a stage's each): B first
    whenever ready (the later chunk first), then forwards while the rank holds fewer than
    2 x pp chunk activations (1F1B's first-rank memory, now on every rank), W when nothing
    else can run or when more than pp weight gradients wait."""

    def options(rank: int, c: Counts) -> list[Option]:
        held = sum(c[("F", chunk)] - c[("W", chunk)] for chunk in (0, 1))
        deferred = sum(c[("B", chunk)] - c[("W", chunk)] for chunk in (0, 1))
        found = [("B", c[("B", chunk)], chunk, 0) for chunk in (1, 0) if c[("B", chunk)] < c[("F", chunk)]]
        found += [("F", c[("F", chunk)], chunk, 1) for chunk in (1, 0) if c[("F", chunk)] < m and held < 2 * pp]
        found += [
            ("W", c[("W", chunk)], chunk, 2 if deferred <= pp else -1)
            for chunk in (1, 0)
            if c[("W", chunk)] < c[("B", chunk)]
        ]
        return found

    return _simulated_order(pp, m, chunks=2, v_shape=True, cost=0.5, options=options)


def _simulated_order(
    pp: int, m: int, chunks: int, v_shape: bool, cost: float, options: Callable[[int, Counts], list[Option]]
) -> list[list[Action]]:
    """Every rank's operation list, built by simulating the pipeline (each operation `cost` long):
    repeatedly, of the operations `options` offers each rank, the one that can start first runs
    (ties: lower priority number, then lower rank)."""
    stages = pp * chunks
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, stage) -> finish time
    lists: list[list[Action]] = [[] for _ in range(pp)]
    counts: list[Counts] = [{(kind, chunk): 0 for kind in "FBW" for chunk in range(chunks)} for _ in range(pp)]
    free = [0.0] * pp

    def ready(kind: str, mb: int, stage: int) -> float | None:
        """When the operation's inputs are available (None: not yet known)."""
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", mb, stage - 1))
        if kind == "B":
            own = done.get(("F", mb, stage))
            after = own if stage == stages - 1 else done.get(("B", mb, stage + 1))
            return None if own is None or after is None else max(own, after)
        return done.get(("B", mb, stage))

    def candidate(rank: int) -> tuple[tuple[float, int, int], str, int, int] | None:
        """The operation rank `rank` would run next, keyed by (start, priority, rank)."""
        best = None
        for kind, mb, chunk, priority in options(rank, counts[rank]):
            at = ready(kind, mb, stage_of(rank, chunk, pp, v_shape))
            if at is not None and (best is None or (max(at, free[rank]), priority, rank) < best[0]):
                best = ((max(at, free[rank]), priority, rank), kind, mb, chunk)
        return best

    def holder(stage: int) -> int:
        return (stage if stage < pp else 2 * pp - 1 - stage) if v_shape else stage % pp

    # (an operation changes only its rank's options and the readiness of its neighbour stages' operations)
    candidates = [candidate(rank) for rank in range(pp)]
    for _ in range(3 * pp * m * chunks):
        best = min((c for c in candidates if c is not None), default=None)
        assert best is not None, "schedule generation stalled"
        (start, _, rank), kind, mb, chunk = best
        counts[rank][(kind, chunk)] += 1
        free[rank] = start + cost
        stage = stage_of(rank, chunk, pp, v_shape)
        done[(kind, mb, stage)] = free[rank]
        for affected in {rank, *(holder(s) for s in (stage - 1, stage + 1) if 0 <= s < stages)}:
            candidates[affected] = candidate(affected)
        lists[rank].append(Action(kind, mb, chunk))  # type: ignore[arg-type]
    return lists


# ---------------------------------------------------------------- checking and simulating


Span = tuple[Action, float, float]
"""An operation with its start and end time."""


@dataclass
class Timeline:
    """Start and end time of every operation of every rank, under a cost model."""

    spans: list[list[Span]]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.spans[rank])

    def bubble_fraction(self) -> float:
        """Share of the ranks' time spent waiting, averaged over ranks."""
        ranks = len(self.spans)
        return 1.0 - sum(self.busy(r) for r in range(ranks)) / (ranks * self.makespan)


def default_costs(schedule: Schedule) -> dict[str, float]:
    """Forward 1, backward 2 (split: input and weight gradients 1 each), per whole stage; a chunk
    of an interleaved schedule costs 1/chunks of that."""
    scale = 1.0 / schedule.chunks
    if schedule.split_backward:
        return {"F": scale, "B": scale, "W": scale}
    return {"F": scale, "B": 2 * scale, "W": 0.0}


def simulate(
    schedule: Schedule,
    costs: dict[str, float] | None = None,
    p2p_latency: float = 0.0,
    stage_costs: Sequence[Mapping[str, float]] | None = None,
    check: bool = True,
) -> Timeline:
    """Run every rank's list in order, each operation as early as its inputs allow (sends never
    block, receives wait). Raises ValueError if the lists deadlock or miss an operation.

    `costs` gives every stage the same F/B/W durations; `stage_costs` (one mapping per model stage,
    `schedule.num_stages` of them) gives each its own, for stages that differ: the first holds the
    embedding, the last the output layer and loss, and layer counts may be uneven. The planner's
    bubble comes from the same times, computed by `timing.rank_times` in one pass. `p2p_latency`
    delays every stage-to-stage dependency. `check=False` skips checking that every operation is
    listed once (for lists `build_schedule` made)."""
    if check:
        _check_complete(schedule)
    spans: list[list[Span]] = [[] for _ in range(schedule.pp)]
    clock = _run(schedule, _compile(schedule), _cost_table(schedule, costs, stage_costs), p2p_latency, spans)
    return Timeline(spans, max(clock))


def _cost_table(
    schedule: Schedule, costs: dict[str, float] | None, stage_costs: Sequence[Mapping[str, float]] | None
) -> list[tuple[float, float, float]]:
    """(F, B, W) durations per model stage."""
    if stage_costs is not None and len(stage_costs) != schedule.num_stages:
        raise ValueError(f"stage_costs has {len(stage_costs)} entries for {schedule.num_stages} model stages")
    uniform = costs or default_costs(schedule)
    table = list(stage_costs) if stage_costs is not None else [uniform] * schedule.num_stages
    return [(c.get("F", 0.0), c.get("B", 0.0), c.get("W", 0.0)) for c in table]


_KINDS = {"F": 0, "B": 1, "W": 2}

Compiled = list[list[tuple[int, int, int, int, bool, int, bool]]]
"""Per rank, per operation: (kind, stage, its own key, first input's key, whether that one crosses
stages, second input's key (-1: none), whether it does). A key numbers (kind, micro-batch, stage)."""


def _compile(schedule: Schedule) -> Compiled:
    """The operation lists as integer records: what each operation waits for, by number."""
    stages, m = schedule.num_stages, schedule.microbatches

    def key(kind: int, mb: int, stage: int) -> int:
        return (kind * m + mb) * stages + stage

    out: Compiled = []
    for rank, actions in enumerate(schedule.ranks):
        records = []
        for action in actions:
            stage, mb, kind = schedule.stage(rank, action.chunk), action.microbatch, _KINDS[action.kind]
            if kind == 0:
                first, cross, second = (key(0, mb, stage - 1), True, -1) if stage > 0 else (-1, False, -1)
            elif kind == 1:
                first, cross = key(0, mb, stage), False
                second = key(1, mb, stage + 1) if stage < stages - 1 else -1
            else:
                first, cross, second = key(1, mb, stage), False, -1
            records.append((kind, stage, key(kind, mb, stage), first, cross, second, True))
        out.append(records)
    return out


def _run(
    schedule: Schedule,
    plan: Compiled,
    table: list[tuple[float, float, float]],
    p2p_latency: float,
    spans: list[list[Span]],
) -> list[float]:
    """The simulation: each rank runs its list in order, every operation as soon as its inputs are done."""
    finish = [-1.0] * (3 * schedule.microbatches * schedule.num_stages)
    position, clock = [0] * schedule.pp, [0.0] * schedule.pp
    remaining = sum(len(r) for r in plan)
    while remaining:
        progressed = False
        for rank, records in enumerate(plan):
            pos, now = position[rank], clock[rank]
            while pos < len(records):
                kind, stage, own, first, cross, second, second_cross = records[pos]
                start = now
                if first >= 0:
                    if finish[first] < 0:
                        break
                    start = max(start, finish[first] + (p2p_latency if cross else 0.0))
                if second >= 0:
                    if finish[second] < 0:
                        break
                    start = max(start, finish[second] + (p2p_latency if second_cross else 0.0))
                duration = table[stage][kind]
                now = finish[own] = start + duration
                spans[rank].append((schedule.ranks[rank][pos], start, now))
                pos += 1
            if pos != position[rank]:
                remaining -= pos - position[rank]
                progressed = True
            position[rank], clock[rank] = pos, now
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {schedule.ranks[r][position[r]]}"
                for r in range(schedule.pp)
                if position[r] < len(schedule.ranks[r])
            )
            raise ValueError(f"schedule {schedule.name} deadlocks: {stuck}")
    return clock


def _check_complete(schedule: Schedule) -> None:
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    for rank, actions in enumerate(schedule.ranks):
        expected = sorted(
            (k, m, c) for k in kinds for m in range(schedule.microbatches) for c in range(schedule.chunks)
        )
        got = sorted((a.kind, a.microbatch, a.chunk) for a in actions)
        if got != expected:
            raise ValueError(f"schedule {schedule.name}: rank {rank} does not run every operation exactly once")


def peak_live_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most micro-batch chunks whose forward has run and whose backward has not
    (their activations are held)."""
    peaks = []
    for actions in schedule.ranks:
        live = peak = 0
        for action in actions:
            live += {"F": 1, "B": -1, "W": 0}[action.kind]
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def theoretical_bubble(name: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble share of the step time with forward 1 and backward 2: (p-1)/(m+p-1) for GPipe and
    1F1B; (p-1)/v over m + (p-1)/v for interleaved; ZB-H1's (p-1)/3 of one forward-backward,
    (p-1)/(3m+p-1); none (NaN) for ZB-V."""
    p, m, v = pp, microbatches, chunks
    if name == "zb-v":
        return float("nan")  # no closed form: near zero once micro-batches fill the V
    if name == "interleaved":
        return ((p - 1) / v) / (m + (p - 1) / v)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
