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

from paratron.distributed.topology import RankGroup
from paratron.parallel.pipeline.draw import draw_timeline, write_chrome_trace
from paratron.parallel.pipeline.schedules import Span


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
