"""A schedule's rank times under many cost models: its dependencies flattened once, then one pass per model.

`schedules.simulate` runs each rank's list in turns, checking before every operation whether its
inputs are done. Which operations can run in which turn depends only on the lists, not on how long
the operations take, so `flatten` records that order once, as integer arrays: every operation after
the one before it on its rank and after its inputs. `rank_times` then prices the schedule under any
per-stage (F, B, W) costs in one pass over those arrays, without checks or objects; it takes the
same maxima and sums in the same order as `simulate`, so its floats are the same, bit for bit
(tests/unit/test_schedules.py checks every schedule kind). The planner prices thousands of
candidate layouts with a few hundred of these, on schedules of up to ~10^5 operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add

from paratron.parallel.pipeline.schedules import Schedule


@dataclass(frozen=True)
class FlatSchedule:
    """A schedule's operations in an order that respects every dependency. An operation is numbered
    by (kind, micro-batch, model stage); number `zero` always reads 0 (a rank's start) and `never`
    minus infinity (an input the operation does not have)."""

    pp: int
    num_stages: int
    own: list[int]
    previous: list[int]
    """The operation before it on its rank (`zero` for the first)."""
    local: list[int]
    """An input produced on the same stage (B: its forward; W: its backward), no transfer."""
    remote: list[int]
    """An input from the neighbouring stage (F: the forward below; B: the backward above), after a transfer."""
    cost: list[int]
    """Where its duration sits in the cost table: 3 x stage + kind."""
    rank_costs: list[list[int]]
    """Per rank, the cost entries of its operations in its list's order (its busy time adds them so)."""
    last: list[int]
    """Per rank, its last operation."""
    zero: int
    never: int


def flatten(schedule: Schedule) -> FlatSchedule:
    """The schedule's operations in dependency order. Raises ValueError if the lists deadlock."""
    stages, m, pp = schedule.num_stages, schedule.microbatches, schedule.pp
    zero, never = 3 * m * stages, 3 * m * stages + 1
    ranks = [_records(schedule, rank, zero, never) for rank in range(pp)]
    done = bytearray(never + 1)
    done[zero] = done[never] = 1
    flat: tuple[list[int], ...] = ([], [], [], [], [])
    own, previous, local, remote, cost = flat
    position, last = [0] * pp, [zero] * pp
    remaining = sum(len(records) for records in ranks)
    while remaining:
        progressed = False
        for rank, records in enumerate(ranks):
            pos = first = position[rank]
            before = last[rank]
            while pos < len(records):
                number, mine, other, entry = records[pos]
                if not (done[mine] and done[other]):
                    break
                done[number] = 1
                own.append(number)
                previous.append(before)
                local.append(mine)
                remote.append(other)
                cost.append(entry)
                before = number
                pos += 1
            if pos != first:
                remaining -= pos - first
                progressed = True
                position[rank], last[rank] = pos, before
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {schedule.ranks[r][position[r]]}" for r in range(pp) if position[r] < len(ranks[r])
            )
            raise ValueError(f"schedule {schedule.name} deadlocks: {stuck}")
    rank_costs = [[entry for _, _, _, entry in records] for records in ranks]
    return FlatSchedule(pp, stages, *flat, rank_costs, last, zero, never)  # type: ignore[arg-type]


def _records(schedule: Schedule, rank: int, zero: int, never: int) -> list[tuple[int, int, int, int]]:
    """Rank `rank`'s operations in its order as (own number, local input, remote input, cost entry)."""
    stages, m = schedule.num_stages, schedule.microbatches
    stage_of_chunk = [schedule.stage(rank, chunk) for chunk in range(schedule.chunks)]
    records = []
    for action in schedule.ranks[rank]:
        stage, mb, kind = stage_of_chunk[action.chunk], action.microbatch, action.kind
        if kind == "F":
            number = mb * stages + stage
            records.append((number, zero, number - 1 if stage > 0 else never, 3 * stage))
        elif kind == "B":
            number = (m + mb) * stages + stage
            records.append((number, mb * stages + stage, number + 1 if stage < stages - 1 else never, 3 * stage + 1))
        else:
            number = (2 * m + mb) * stages + stage
            records.append((number, number - m * stages, never, 3 * stage + 2))
    return records


def rank_times(
    flat: FlatSchedule, stage_costs: Sequence[tuple[float, float, float]], p2p_latency: float = 0.0
) -> tuple[list[float], list[float]]:
    """Per rank, when its last operation ends and how long it was busy, with each model stage's
    (F, B, W) durations `stage_costs` and `p2p_latency` on every stage-to-stage dependency: what
    `simulate` gives (its makespan is the largest end), in one pass."""
    if len(stage_costs) != flat.num_stages:
        raise ValueError(f"stage_costs has {len(stage_costs)} entries for {flat.num_stages} model stages")
    table = [duration for stage in stage_costs for duration in stage]
    finish = [0.0] * (flat.never + 1)
    finish[flat.never] = float("-inf")
    for number, before, mine, other, entry in zip(flat.own, flat.previous, flat.local, flat.remote, flat.cost):
        start = finish[before]
        ready = finish[mine]
        if ready > start:
            start = ready
        ready = finish[other] + p2p_latency
        if ready > start:
            start = ready
        finish[number] = start + table[entry]
    busy = [_sum_in_order(table, entries) for entries in flat.rank_costs]
    return [finish[number] for number in flat.last], busy


def _sum_in_order(table: list[float], entries: list[int]) -> float:
    """The durations added one after another from 0, as `simulate` adds a rank's busy time."""
    return reduce(add, map(table.__getitem__, entries), 0.0)
