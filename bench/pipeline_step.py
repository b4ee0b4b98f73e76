"""Pipeline parallelism: paratron's schedules against `torch.distributed.pipelining`, step time and gradients.

    python bench/pipeline_step.py --pp 2 --microbatches 8 --rounds 10 --steps 2 --output bench/results/pipeline.json
    python bench/pipeline_step.py --pp 4 --microbatches 8 --rounds 10 --steps 2 --output bench/results/pipeline.json
    python bench/pipeline_step.py --pp 2 --only 1f1b --profile /tmp/pp-profile  # cProfile of every rank, both sides
    python bench/pipeline_step.py --pp 2 --only 1f1b zb-h1 --first-layers 5 --last-layers 3  # uneven stages
    python bench/pipeline_step.py --smoke  # tiny: does it still run and agree with torch?

It runs one global batch (forward and backward of every micro-batch, gradients accumulated;
no optimizer step on either side) of the same model (paratron's GPT code, same seed, untied
embeddings, fp32, no dropout: bench/common.py) on the same `--pp` gloo processes, cut into the
same stages, in four pairings:

    paratron 1f1b                      vs  torch Schedule1F1B
    paratron interleaved, 2 chunks     vs  torch ScheduleInterleaved1F1B, 2 stages per rank
    paratron zb-h1                     vs  torch ScheduleInterleavedZeroBubble, 1 stage per rank
    paratron zb-v, 2 chunks in a V     vs  torch ScheduleZBVZeroBubble, 2 stages per rank in a V

Chunk c of rank r is model stage c * pp + r on both sides. PyTorch has no schedule named
ZB-H1; its `ScheduleInterleavedZeroBubble` (the paper's ZB1P) accepts a single stage per rank,
and then its operation lists are ZB-H1's: 1F1B with the backward split into input and weight
gradients and rank r holding back r weight gradients. That is the closest match (`ScheduleZBVZeroBubble`
and `ScheduleDualPipeV` need two stages per rank in a V layout). `--torch-zb-stages 2` gives
torch's zero-bubble schedule two stages per rank instead (then the layer split differs from
paratron's zb-h1, which runs one chunk per rank).

Each pairing runs one warm-up step on each side, then alternates `--rounds` rounds of `--steps`
timed steps (a barrier before and after each round; rounds take turns at going first; the
median round is reported), records one paratron step with `pipeline.record` set to measure its
bubble (beside the schedule's theoretical and simulated bubble and its peak of live activations
per rank), and finally runs one more torch step and compares the two sides' loss and every
gradient, gathered by parameter name (relative to torch's largest magnitude).
Results merge into `--output` under the key `pp<N>`, pairing by pairing. `--first-layers` /
`--last-layers` give the first and last stage those layer counts on both sides (one-chunk schedules).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common import apply_smoke, spawn
from paratron.distributed.local_ranks import torchrun_environment
from pipeline_common import SMOKE, add_arguments, build, merge_into, microbatches, run_settings

if TYPE_CHECKING:
    from paratron.config.schema import Config


PAIRINGS = (
    ("1f1b", "Schedule1F1B"),
    ("interleaved", "ScheduleInterleaved1F1B"),
    ("zb-h1", "ScheduleInterleavedZeroBubble"),
    ("zb-v", "ScheduleZBVZeroBubble"),
)


class TorchStage(nn.Module):
    """One model stage as `torch.distributed.pipelining` wants it: token ids (first stage) or hidden
    states in, hidden states or logits (last stage) out. It runs the single-device GPT's own
    `embed` / `rotary_tables` / `layers` / `head`, the code paratron's stages run, and registers
    just the pieces it uses so that its `parameters()` are exactly the stage's (torch scales
    and splits the gradients of those)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        if first:
            self.embedding = model.embedding
            self.position_embedding = model.position_embedding
        if last:
            self.final_norm = model.final_norm
            self.output = model.output
        self._plan = (model, layers, first, last)  # a tuple, so the whole model is not registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model, layers, first, last = self._plan
        positions = torch.arange(x.size(1), device=x.device)
        if first:
            x = model.embed(x, positions)
        x = model.layers(x, layers, model.rotary_tables(positions))
        return model.head(x) if last else x


def _torch_pipeline(
    config: Config,
    reference: nn.Module,
    schedule_class: str,
    stages_per_rank: int,
    rank: int,
    pp: int,
    microbatches: int,
) -> tuple[Any, list[TorchStage]]:
    """torch's schedule over stage modules cut from `reference` (this rank's stages rank + c * pp)."""
    import torch.distributed.pipelining as pipelining

    from paratron.config.layout import layer_counts, stage_ranges
    from paratron.model.loss import language_model_loss

    num_stages = pp * stages_per_rank
    first, last = config.parallel.decoder_first_pipeline_num_layers, config.parallel.decoder_last_pipeline_num_layers
    if stages_per_rank > 1:
        first = last = None  # (torch's multi-stage schedules cut evenly, as paratron's chunks do)
    ranges = stage_ranges(layer_counts(config.model.num_layers, num_stages, first, last))
    modules, stages = [], []
    for c in range(stages_per_rank):
        index = c * pp + rank
        if schedule_class == "ScheduleZBVZeroBubble":  # rank r holds stages r and 2 pp - 1 - r
            index = rank if c == 0 else 2 * pp - 1 - rank
        module = TorchStage(reference, ranges[index], index == 0, index == num_stages - 1)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, index, num_stages, torch.device("cpu")))
    cls = getattr(pipelining, schedule_class)
    # loss: the mean over one micro-batch; scale_grads divides the accumulated gradients by the
    # micro-batch count afterwards (paratron divides each loss before backward): the same gradient
    if schedule_class == "Schedule1F1B":
        schedule = cls(stages[0], microbatches, loss_fn=language_model_loss, scale_grads=True)
    else:
        schedule = cls(stages, microbatches, loss_fn=language_model_loss, scale_grads=True)
    return schedule, modules


def _torch_peak_live(schedule, pp: int) -> list[int]:
    """Per rank, the most micro-batch stages forwarded and not yet backwarded (input gradients) in
    torch's own operation lists; counted like paratron's `peak_live_activations`."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return []
    peaks = []
    for rank in range(pp):
        live = peak = 0
        for action in order[rank]:
            if action is None:
                continue
            live += {"F": 1, "B": -1, "I": -1}.get(action.computation_type.value, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare_gradients(
    ours: nn.Module, reference: nn.Module, modules: list[TorchStage], losses: tuple[float, float] | None
) -> dict:
    """Gather both sides' gradients by single-device parameter name on rank 0 (the two sides may
    cut the layers differently) and compare them; collective. Returns the worst difference
    relative to torch's largest magnitude, on rank 0 (empty elsewhere)."""
    import torch.distributed as dist

    def by_name(named: Any) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}

    torch_named = [(n, p) for module in modules for n, p in module.named_parameters()]
    # torch's stage modules register the GPT's pieces under their own names: map back by identity
    names = {id(p): n for n, p in reference.named_parameters()}
    mine = (by_name(ours.named_parameters()), by_name((names[id(p)], p) for _, p in torch_named), losses)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    ours_all = {n: g for rank in everyone for n, g in rank[0].items()}
    torch_all = {n: g for rank in everyone for n, g in rank[1].items()}
    if set(ours_all) != set(torch_all) or set(ours_all) != set(names.values()):
        raise RuntimeError("the two sides do not hold the same parameters")
    worst, worst_name = 0.0, ""
    for name, grad in ours_all.items():
        if name.endswith("in_proj.k.bias"):
            continue  # zero in exact arithmetic (softmax ignores a shift shared by all keys): rounding noise
        if not torch_all[name].abs().max() > 0:
            raise RuntimeError(f"torch's side has a zero gradient for {name}")
        error = _rel(grad, torch_all[name])
        if error >= worst:
            worst, worst_name = error, name
    loss = next(rank[2] for rank in everyone if rank[2] is not None)
    # grads_compared counts every parameter, the key biases too (they stay out of the maximum)
    return {
        "max_grad_rel_diff": worst,
        "worst_grad": worst_name,
        "grads_compared": len(ours_all),
        "loss": loss,
        "loss_abs_diff": abs(loss[0] - loss[1]),
    }


def _timed_round(step: Callable[[], None], steps: int, profiler: Any = None) -> float:
    """ms per step, between barriers, so every rank's last operation is inside the time."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        step()
    if profiler is not None:
        profiler.disable()
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


def _write_profile(profiler: Any, path: Path) -> None:
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())


def _pairing(
    args: dict,
    topology: Any,
    name: str,
    schedule_class: str,
    batches: list,
    inputs: torch.Tensor,
    labels: torch.Tensor,
) -> dict:
    """Build both sides of one pairing, time them, measure paratron's bubble, check the gradients agree."""
    import torch.distributed as dist

    from paratron.config.layout import resolve_layout
    from paratron.model.gpt import GPT, build_model
    from paratron.parallel.parallelize import parallelize
    from paratron.parallel.pipeline.profile import measured_bubble
    from paratron.parallel.pipeline.schedules import (
        build_schedule,
        peak_live_activations,
        simulate,
        theoretical_bubble,
    )

    rank, pp, m = dist.get_rank(), args["pp"], args["microbatches"]
    config = build(args, name)
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    ours = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    chunks = ours.pipeline.schedule.chunks
    reference = build_model(config.model, seed=config.training.seed)
    torch_stages = 2 if name in ("interleaved", "zb-v") else (args["torch_zb_stages"] if name == "zb-h1" else 1)
    theirs, modules = _torch_pipeline(config, reference, schedule_class, torch_stages, rank, pp, m)
    holds_first, holds_last = rank == 0, rank == (0 if name == "zb-v" else pp - 1)
    torch_losses: list[torch.Tensor] = []

    def paratron_step() -> torch.Tensor:
        ours.zero_grad()
        return ours.forward_backward(batches, backward=lambda loss: loss.backward())

    def torch_step() -> None:
        for module in modules:
            module.zero_grad(set_to_none=True)
        torch_losses.clear()
        extra: dict[str, Any] = dict(target=labels, losses=torch_losses) if holds_last else {}
        theirs.step(*((inputs,) if holds_first else ()), return_outputs=False, **extra)

    paratron_step()  # warm-up (torch's stages infer their shapes on their first step)
    torch_step()

    # rounds alternate which side goes first (ABBA), so neither always follows the other
    times: dict[str, list[float]] = {"paratron": [], "torch": []}
    sides = {"paratron": paratron_step, "torch": torch_step}
    profilers: dict[str, Any] = {}
    if args["profile"]:
        import cProfile

        profilers = {side: cProfile.Profile() for side in sides}
    for r in range(args["rounds"]):
        for side in ("paratron", "torch") if r % 2 == 0 else ("torch", "paratron"):
            times[side].append(_timed_round(sides[side], args["steps"], profilers.get(side)))
    for side, profiler in profilers.items():
        Path(args["profile"]).mkdir(parents=True, exist_ok=True)
        _write_profile(profiler, Path(args["profile"]) / f"pp{pp}-{name}-{side}-rank{rank}.txt")

    # one recorded paratron step for the measured bubble (ranks start together after a barrier)
    ours.pipeline.record = True
    dist.barrier()
    our_loss = paratron_step()
    ours.pipeline.record = False
    spans: list[Any] = [None] * pp
    dist.gather_object(ours.pipeline.spans, spans if rank == 0 else None, dst=0)

    # no optimizer step, so the weights never changed: the last step of each side must give the
    # same loss and gradients (checked after the timing, whose memory it would otherwise disturb)
    torch_step()
    losses = (float(our_loss.detach()), float(torch.stack(torch_losses).detach().mean())) if holds_last else None
    check = _compare_gradients(ours.module, reference, modules, losses)

    result: dict[str, Any] = {}
    if rank == 0:
        schedule = build_schedule(name, pp, m, chunks)
        paratron_ms = statistics.median(times["paratron"])
        torch_ms = statistics.median(times["torch"])
        op_ms: dict[str, list[float]] = {}
        for row in spans:
            for action, start, end in row:
                op_ms.setdefault(action.kind, []).append(end - start)
        result = {
            "paratron_schedule": name,
            "paratron_chunks_per_rank": chunks,
            "torch_schedule": schedule_class,
            "torch_stages_per_rank": torch_stages,
            "paratron_ms": paratron_ms,
            "torch_ms": torch_ms,
            "ratio": paratron_ms / torch_ms,
            # rounds run back to back, so the median of their ratios is steadier against drift
            "ratio_paired_median": statistics.median(a / b for a, b in zip(times["paratron"], times["torch"])),
            "rounds_ms": times,
            **check,
            "bubble_measured": measured_bubble(spans),
            "bubble_theoretical": theoretical_bubble(name, pp, m, chunks),
            "bubble_simulated": simulate(schedule).bubble_fraction(),
            "peak_live_activations": peak_live_activations(schedule),
            "torch_peak_live_activations": _torch_peak_live(theirs, pp),
            "recorded_step_ms": max(end for row in spans for _, _, end in row),
            "busy_ms_per_rank": [sum(end - start for _, start, end in row) for row in spans],
            "mean_op_ms": {kind: statistics.mean(v) for kind, v in sorted(op_ms.items())},
        }
    dist.barrier()
    return result


def _step_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology

    ctx = initialize("gloo")
    # initialize shares os.cpu_count() among the processes; set it explicitly for this 2-core budget
    torch.set_num_threads(max(1, args["cores"] // world))
    topology = Topology(ParallelDims(world, pp=world), ctx.rank)
    topology.create_groups()
    inputs, labels, batches = microbatches(args)
    results = {}
    for name, schedule_class in PAIRINGS:
        if name in args["only"]:
            results[name] = _pairing(args, topology, name, schedule_class, batches, inputs, labels)
    if rank == 0:
        results["threads_per_process"] = torch.get_num_threads()
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def step(args: dict, forked: bool = False) -> dict:
    results = spawn(_step_worker, args["pp"], args, forked=forked)
    results["model"] = run_settings(args)
    results["timing"] = {
        "rounds": args["rounds"],
        "steps_per_round": args["steps"],
        "cores": args["cores"],
        "step": "forward + backward of one global batch, no optimizer step",
    }
    return results


def table(pp: int, results: dict) -> str:
    """A readable summary of one `step` run."""
    lines = [
        f"PP {pp}, {results['model']['microbatches']} micro-batches "
        f"({results['threads_per_process']} thread(s) per process)",
        f"{'paratron':<16}{'torch':<32}{'paratron ms':>12}{'torch ms':>10}{'ratio':>7}{'paired':>8}"
        f"{'grad diff':>11}{'bubble meas/theory/sim':>25}  peak live (paratron | torch)",
    ]
    for name, _ in PAIRINGS:
        r = results.get(name)
        if not r:
            continue
        ours = f"{name} x{r['paratron_chunks_per_rank']}"
        theirs = f"{r['torch_schedule']} x{r['torch_stages_per_rank']}"
        bubble = f"{r['bubble_measured']:.3f}/{r['bubble_theoretical']:.3f}/{r['bubble_simulated']:.3f}"
        lines.append(
            f"{ours:<16}{theirs:<32}{r['paratron_ms']:>12.1f}{r['torch_ms']:>10.1f}{r['ratio']:>7.2f}"
            f"{r['ratio_paired_median']:>8.2f}"
            f"{r['max_grad_rel_diff']:>11.1e}{bubble:>25}  {r['peak_live_activations']} | "
            f"{r['torch_peak_live_activations']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--torch-zb-stages", type=int, default=1, choices=[1, 2], help="stages per rank of torch's zero-bubble schedule"
    )
    parser.add_argument(
        "--only", nargs="+", default=[name for name, _ in PAIRINGS], choices=[name for name, _ in PAIRINGS]
    )
    parser.add_argument(
        "--profile", default=None, help="a folder: cProfile every rank over the timed steps of each side (slows both)"
    )
    args = parser.parse_args(argv)
    apply_smoke(args, parser, **SMOKE)
    uneven = args.first_layers is not None or args.last_layers is not None
    if "interleaved" in args.only and args.layers % (2 * args.pp):
        parser.error(f"--layers {args.layers} must split into 2 x --pp {args.pp} stages for the interleaved pairing")
    if uneven and set(args.only) & {"interleaved", "zb-v"}:
        parser.error("--first-layers / --last-layers apply to the one-chunk schedules: add --only 1f1b zb-h1")
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "smoke")}
    results = step(settings, forked=args.smoke)
    print(json.dumps({k: v for k, v in results.items() if k != "model"}, indent=2), flush=True)
    print(table(args.pp, results), flush=True)
    if args.smoke:
        check(results, settings["only"])
    key = f"pp{args.pp}" + (f"_first{args.first_layers}_last{args.last_layers}" if uneven else "")
    merge_into(args.output, key, results)


def check(results: dict, pairings: list[str]) -> None:
    """--smoke: both sides computed the same loss and gradients (fp32 rounding apart)."""
    for name in pairings:
        r = results[name]
        if not (r["max_grad_rel_diff"] < 1e-4 and r["loss_abs_diff"] < 1e-4):
            raise AssertionError(f"{name}: paratron and torch disagree: {r}")


if __name__ == "__main__":
    main()
