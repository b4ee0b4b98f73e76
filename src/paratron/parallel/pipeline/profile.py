"""`--profile-pipeline`: what one real step of the schedule looked like.

Every pipeline rank (of the first tensor- and data-parallel replica) writes a Chrome trace
of its operations (open it in Perfetto or chrome://tracing); the main rank gathers all of
them into one PNG timeline and measures the bubble: the share of the step that the ranks
spent waiting rather than computing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from paratron.distributed.topology import Axis, RankGroup, Topology
from paratron.parallel.pipeline.draw import draw_timeline, write_chrome_trace
from paratron.parallel.pipeline.runtime import PipelineRuntime
from paratron.parallel.pipeline.schedules import Span, theoretical_bubble


def measured_bubble(spans: list[list[Span]]) -> float:
    """1 - (time in operations) / (ranks x step time), the step running from the first start to
    the last end over all ranks."""
    start = min(s for row in spans for _, s, _ in row)
    end = max(e for row in spans for _, _, e in row)
    busy = sum(e - s for row in spans for _, s, e in row)
    return 1.0 - busy / (len(spans) * (end - start))


def save_profile(
    spans: list[Span], run_dir: Path, pp_rank: int, pp_group: RankGroup, main: bool, title: str
) -> tuple[float, list[Path]] | None:
    """Write this rank's trace; on the main rank also the timeline. Collective over `pp_group`
    (the first replica's pipeline ranks). Returns (measured bubble, files) on the main rank."""
    trace = write_chrome_trace(run_dir / f"pipeline-trace-rank{pp_rank}.json", {pp_rank: spans})
    everyone: list[Any] = [None] * pp_group.size
    dist.gather_object(spans, everyone if main else None, dst=0, group=pp_group.process_group)
    if not main:
        return None
    png = draw_timeline(everyone, run_dir / "pipeline-timeline.png", title, unit="ms")
    return measured_bubble(everyone), [trace, png]


def profile_step(
    pipeline: PipelineRuntime, iteration: int, run_dir: Path, topology: Topology, main: bool
) -> str | None:
    """Save the profile of step `iteration`, which `pipeline` recorded (collective over the first
    replica's pipeline ranks; other ranks do nothing). Returns the line that reports it on the
    main rank, None elsewhere."""
    if topology.dp_rank != 0 or topology.tp_rank != 0:
        return None
    schedule = pipeline.schedule
    title = (
        f"step {iteration}: {schedule.name}, {schedule.pp} stages x {schedule.chunks} chunk(s), "
        f"{schedule.microbatches} micro-batches (measured)"
    )
    result = save_profile(pipeline.spans, run_dir, topology.pp_rank, topology.group(Axis.PP), main, title)
    if result is None:
        return None
    bubble, files = result
    theory = theoretical_bubble(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks)
    return (
        f"pipeline profile of step {iteration}: bubble {bubble:.1%} of the step measured "
        f"({theory:.1%} in theory); rank 0 held at most {pipeline.peak_live} micro-batch "
        f"activations at once; {', '.join(str(f) for f in files)}"
    )
