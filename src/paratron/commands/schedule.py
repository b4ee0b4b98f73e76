"""`paratron schedule`: a pipeline schedule built, simulated with fixed operation times, reported (its bubble, the
activations it keeps alive) and drawn as a timeline; no model or process is started.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratron.config.arguments import ArgumentParser
from paratron.config.schema import LoggingConfig
from paratron.errors import ConfigError
from paratron.parallel.pipeline.draw import draw_timeline
from paratron.parallel.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    build_schedule,
    peak_live_activations,
    simulate,
    theoretical_bubble,
)


def parser() -> argparse.ArgumentParser:
    """The schedule and its sizes, where the timeline goes, whether every rank's operations are printed."""
    parser = ArgumentParser(
        prog="paratron schedule",
        allow_abbrev=False,
        description="Build a pipeline schedule, simulate it with forward 1 and backward 2 time units "
        "(input and weight gradients 1 each for zb-h1), and "
        "draw which operation every rank runs when; no model or process is started.",
    )
    parser.add_argument("--pp", type=int, required=True, metavar="N", help="Pipeline-parallel size (ranks).")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="Micro-batches per step.")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="Schedule (default: 1f1b).")
    parser.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="V",
        help="Model chunks (virtual stages) per rank; only for interleaved (default: 1).",
    )
    run_dir = LoggingConfig().run_dir
    parser.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="PNG to write (default: schedule-NAME-ppN-mM[-vV].png in --run-dir).",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path(run_dir),
        metavar="DIR",
        help=f"Folder of the default --output, as train's run folder (default: {run_dir}).",
    )
    parser.add_argument("--print", action="store_true", dest="show", help="Also print every rank's operations.")
    return parser


def run(argv: list[str]) -> int:
    """`paratron schedule ARGV`: the bubble and peak live activations printed, the timeline drawn."""
    args = parser().parse_args(argv)
    name, pp, m = args.schedule, args.pp, args.microbatches
    schedule = _build(args)
    timeline = simulate(schedule)
    v = schedule.chunks
    chunks = f", {v} chunks per rank" if v > 1 else ""
    held = "micro-batch activations" if v == 1 else f"micro-batch chunk activations (1/{v} of a stage's each)"
    if args.show:
        print(schedule)
    print(
        f"{name}: pp {pp}, {m} micro-batches{chunks}: bubble {timeline.bubble_fraction():.1%} of the step "
        f"({_against_theory(name, pp, m, args.vpp)}); peak live {held} per rank: "
        + " ".join(map(str, peak_live_activations(schedule)))
    )
    output = args.output or args.run_dir / (f"schedule-{name}-pp{pp}-m{m}" + (f"-v{v}" if v > 1 else "") + ".png")
    title = f"{name} schedule: pp {pp}, {m} micro-batches{chunks}; bubble {timeline.bubble_fraction():.1%}"
    print(f"timeline: {draw_timeline(timeline.spans, output, title, '(forward = 1)')}")
    return 0


def _build(args: argparse.Namespace) -> Schedule:
    """The schedule the flags name; one line for sizes it cannot have."""
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--vpp", args.vpp)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    name, pp, m, v = args.schedule, args.pp, args.microbatches, args.vpp
    try:
        return build_schedule(name, pp, m, v)
    except ValueError as exc:
        raise ConfigError(f"--schedule {name} --pp {pp} --microbatches {m} --vpp {v}: {exc}") from None


def _against_theory(name: str, pp: int, m: int, v: int) -> str:
    """What the simulated bubble is compared with: the schedule's closed form (`theoretical_bubble`), if any."""
    if name == "zb-v":
        return "no closed form"
    formula = {"interleaved": "((p-1)/v)/(m+(p-1)/v)", "zb-h1": "(p-1)/(3m+p-1)"}.get(name, "(p-1)/(m+p-1)")
    caveat = ", which assumes m >= p" if name == "zb-h1" and m < pp else ""
    return f"theory {formula} = {theoretical_bubble(name, pp, m, v):.1%}{caveat}"
