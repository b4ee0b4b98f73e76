"""Pipeline parallelism benchmark: paratron's schedules against `torch.distributed.pipelining`.

    python bench/pipeline.py step --pp 2 --microbatches 8 --rounds 10 --steps 2 --output bench/results/pipeline.json
    python bench/pipeline.py step --pp 4 --microbatches 8 --rounds 10 --steps 2 --output bench/results/pipeline.json
    python bench/pipeline.py step --pp 2 --layers 4 --hidden 64 --vocab 256 --seq 32 --rounds 1 --steps 1  # smoke
    python bench/pipeline.py step --pp 2 --only 1f1b --profile /tmp/pp-profile  # cProfile of every rank, both sides
    python bench/pipeline.py step --pp 2 --only 1f1b zb-h1 --first-layers 5 --last-layers 3  # uneven stages
    python bench/pipeline.py bubble --pp 2 --rounds 8 --output bench/results/pipeline.json  # even vs balanced stages

`step` runs one global batch (forward and backward of every micro-batch, gradients accumulated;
no optimizer step on either side) of the same model (paratron's GPT code, same seed, untied
embeddings, fp32, no dropout) on the same `--pp` gloo processes, cut into the same stages, in
three pairings:

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

`bubble` runs paratron alone, 1f1b and zb-h1, with the even split and with the balanced one the
planner chooses (`planning.search.balanced_ends`; `--balance-from flops` or a missing planner:
`flop_balanced_split`), and records `--rounds` steps after `--warmup` ones. Per split: the measured
bubble (median of the steps) against the closed-form theory, the schedule simulated with the
planner's predicted stage costs and with this run's own mean operation times, the steps replayed
with every operation's own time, and the idle time split by what it waited for (`idle_breakdown`).
It first waits for the shared machine's cores to be quiet and records the other processes' load.
Results go under `bubble_pp<N>` (plus the settings that differ from the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratron.storage import write_text_atomic

if TYPE_CHECKING:
    from paratron.config.schema import Config

PAIRINGS = (
    ("1f1b", "Schedule1F1B"),
    ("interleaved", "ScheduleInterleaved1F1B"),
    ("zb-h1", "ScheduleInterleavedZeroBubble"),
    ("zb-v", "ScheduleZBVZeroBubble"),
)


def _model_settings(args: dict) -> dict:
    return dict(
        num_layers=args["layers"],
        hidden_size=args["hidden"],
        num_attention_heads=args["heads"],
        ffn_hidden_size=args["ffn"],
        vocab_size=args["vocab"],
        max_position_embeddings=args["seq"],
        make_vocab_size_divisible_by=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    )  # tied weights would add an all-reduce on one side only


def _config(args: dict, schedule: str) -> Config:
    from paratron.config import build_config

    pp, m = args["pp"], args["microbatches"]
    parallel: dict[str, Any] = dict(pipeline_model_parallel_size=pp, pipeline_schedule=schedule)
    if schedule == "interleaved":
        parallel["num_layers_per_virtual_pipeline_stage"] = args["layers"] // (2 * pp)
    elif schedule != "zb-v":  # one chunk per rank: the end stages may take other layer counts
        parallel["decoder_first_pipeline_num_layers"] = args.get("first_layers")
        parallel["decoder_last_pipeline_num_layers"] = args.get("last_layers")
    return build_config(
        dict(
            _model_settings(args),
            **parallel,
            mock_data=True,
            seq_length=args["seq"],
            micro_batch_size=args["micro_batch_size"],
            global_batch_size=args["micro_batch_size"] * m,
            seed=args["seed"],
        )
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
    config = _config(args, name)
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    ours = parallelize(meta, config, topology, torch.device("cpu"))
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


def _run_settings(args: dict) -> dict:
    """The model and batch a result was measured with, for its json."""
    return _model_settings(args) | {
        "seq_length": args["seq"],
        "micro_batch_size": args["micro_batch_size"],
        "microbatches": args["microbatches"],
        "precision": "fp32",
        "seed": args["seed"],
    }


def _torchrun_environment(rank: int, world: int, port: int) -> None:
    """What torchrun would set for this spawned worker."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _step_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    _torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.batch import Batch

    ctx = initialize("gloo")
    # initialize shares os.cpu_count() among the processes; set it explicitly for this 2-core budget
    torch.set_num_threads(max(1, args["cores"] // world))
    topology = Topology(ParallelDims(world, pp=world), ctx.rank)
    topology.create_groups()
    mb, m, seq = args["micro_batch_size"], args["microbatches"], args["seq"]
    ids = torch.randint(0, args["vocab"], (mb * m, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    batches = [Batch(inputs[i : i + mb], labels[i : i + mb]) for i in range(0, mb * m, mb)]
    results = {}
    for name, schedule_class in PAIRINGS:
        if name in args["only"]:
            results[name] = _pairing(args, topology, name, schedule_class, batches, inputs, labels)
    if rank == 0:
        results["threads_per_process"] = torch.get_num_threads()
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def step(args: dict) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from multiprocess import free_port

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_step_worker, args=(args["pp"], free_port(), args, out.name), nprocs=args["pp"])
        results = json.loads(Path(out.name).read_text())
    results["model"] = _run_settings(args)
    results["timing"] = {
        "rounds": args["rounds"],
        "steps_per_round": args["steps"],
        "cores": args["cores"],
        "step": "forward + backward of one global batch, no optimizer step",
    }
    return results


# ---------------------------------------------------------------- uneven stages: the bubble


def stage_flops(args: dict, counts: list[int]) -> list[float]:
    """Forward FLOPs per token of each pipeline stage: its layers' matmuls and attention scores (over
    the keys a causal kernel computes, about half the sequence), the output layer on the last stage
    (2 h V) and the loss (a few passes over the V logits); the embedding is a lookup (0)."""
    h, ffn, seq, vocab = args["hidden"], args["ffn"], args["seq"], args["vocab"]
    layer = 2 * 4 * h * h + 2 * 2 * h * ffn + 4 * (seq / 2) * h
    head = 2 * h * vocab + 5 * vocab
    return [n * layer + (head if i == len(counts) - 1 else 0.0) for i, n in enumerate(counts)]


def flop_balanced_split(args: dict) -> tuple[int, int]:
    """First and last stage layer counts (the stages between share the rest evenly) that make the
    largest stage's FLOPs smallest, then the spread between stages."""
    from paratron.config.layout import layer_counts

    layers, pp = args["layers"], args["pp"]
    best: tuple[tuple[float, float], tuple[int, int]] | None = None
    for first in range(1, layers):
        for last in range(1, layers - first + 1):
            try:
                counts = layer_counts(layers, pp, first, last)
            except ValueError:
                continue
            costs = stage_flops(args, counts)
            key = (max(costs), max(costs) - min(costs))
            if best is None or key < best[0]:
                best = (key, (first, last))
    assert best is not None
    return best[1]


def planner_balanced_split(args: dict, schedule: str) -> tuple[int | None, int | None] | None:
    """The first and last stage layer counts the planner's search gives this model
    (`planning.search.balanced_ends` over the output layer's work in layers, `output_ratio`), as
    `paratron plan` would set them; None when the planner is not importable. (None, None) inside
    means the even split."""
    try:
        from paratron.planning.search import balanced_ends, output_ratio
    except ImportError:
        return None
    config = _config(args, schedule)
    return balanced_ends(args["layers"], args["pp"], round(output_ratio(config, 1, 1), 1))


def planner_bubble(args: dict, schedule: str, first: int | None, last: int | None) -> float:
    """The bubble (`Timeline.bubble_fraction`, the measured bubble's definition) of the schedule
    simulated with the per-stage operation times the planner's cost model predicts on the `cpu`
    preset for --pp processes; NaN when the cost model is not importable."""
    try:
        from paratron.config import resolve_layout
        from paratron.parallel.pipeline.schedules import build_schedule, simulate
        from paratron.planning.cost import predict_step
        from paratron.planning.hardware import measure_cpu

        config = _config(dict(args, first_layers=first, last_layers=last), schedule)
        stages = predict_step(config, resolve_layout(config, args["pp"]), measure_cpu(args["pp"])).stages
        costs = [dict(zip("FBW", stage)) for stage in stages]
        return simulate(build_schedule(schedule, args["pp"], args["microbatches"]), stage_costs=costs).bubble_fraction()
    except (ImportError, AttributeError, NotImplementedError, TypeError):  # (the cost model mid-change)
        return float("nan")


def _recorded_steps(ours: Any, batches: list, steps: int) -> list[list[list[Any]]]:
    """`steps` paratron steps recorded with `pipeline.record` (ranks aligned by a barrier before each);
    every rank's spans of each step on rank 0 (empty elsewhere)."""
    import torch.distributed as dist

    rank, pp = dist.get_rank(), dist.get_world_size()
    out = []
    ours.pipeline.record = True
    gc.collect()
    gc.disable()  # (a collection inside a recorded step is one rank's pause, not the schedule's)
    for _ in range(steps):
        ours.zero_grad()
        dist.barrier()
        ours.forward_backward(batches, backward=lambda loss: loss.backward())
        spans: list[Any] = [None] * pp
        dist.gather_object(ours.pipeline.spans, spans if rank == 0 else None, dst=0)
        out.append(spans)
    gc.enable()
    ours.pipeline.record = False
    return out if rank == 0 else []


def _p2p_one_way_ms(shape: tuple[int, ...], repeats: int = 20) -> float:
    """Half the median round trip of one activation message between pipeline ranks 0 and 1 (blocking
    gloo send and receive, after a warm-up exchange); on rank 0 (NaN elsewhere)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    message = torch.zeros(shape)
    trips = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        elif rank == 1:
            dist.recv(message, 0)
            dist.send(message, 0)
        trips.append(time.perf_counter() - start)
    return 1e3 * statistics.median(trips[1:]) / 2 if rank == 0 else float("nan")


def idle_breakdown(steps: list[list[list[Any]]]) -> dict[str, float]:
    """The measured bubble split by what each idle stretch of a rank waited for, as shares of ranks x
    step time (they add up to the bubble), mean over the recorded steps:

    - `compute`: the other rank's work, until the message's producer (the forward of the stage
      before, the input-gradient backward of the stage after) ended, and the end of the step after
      this rank's last operation (the schedule's fill and drain, stage imbalance, jitter);
    - `messages`: from the producer's end until the operation started (the transfer, posting it,
      waking the waiting rank);
    - `gaps`: before operations that waited for no message (the runtime's own bookkeeping).

    Also the median delay of one message (ms). Each rank's times count from its own start, after a
    common barrier."""
    parts = {"compute": 0.0, "messages": 0.0, "gaps": 0.0}
    delays = []
    for spans in steps:
        first = min(s for row in spans for _, s, _ in row)
        last = max(e for row in spans for _, _, e in row)
        total = len(spans) * (last - first)
        ends = {(a.kind, a.microbatch, stage): e for stage, row in enumerate(spans) for a, _, e in row}
        for stage, row in enumerate(spans):
            previous = first
            for action, start, end in row:
                producer = None
                if action.kind == "F" and stage > 0:
                    producer = ends.get(("F", action.microbatch, stage - 1))
                elif action.kind == "B" and stage < len(spans) - 1:
                    producer = ends.get(("B", action.microbatch, stage + 1))
                if producer is not None and producer > previous:
                    parts["compute"] += (min(producer, start) - previous) / total
                    parts["messages"] += max(0.0, start - producer) / total
                    delays.append(start - producer)
                else:
                    parts["gaps"] += max(0.0, start - previous) / total
                previous = end
            parts["compute"] += (last - previous) / total
    out = {k: v / len(steps) for k, v in parts.items()}
    out["message_delay_ms"] = statistics.median(delays) if delays else float("nan")
    out["messages_waited_per_step"] = len(delays) / len(steps)
    return out


def replayed_bubble(steps: list[list[list[Any]]]) -> float:
    """The bubble of the recorded steps replayed with each operation's own measured duration and no
    time between operations beyond the dependencies (a message arrives the moment its producer
    ends): what the schedule, the stage costs and their step-to-step jitter alone give. Mean over
    the steps."""
    bubbles = []
    for spans in steps:
        ranks = len(spans)
        done: dict[tuple[str, int, int], float] = {}
        clock, position = [0.0] * ranks, [0] * ranks
        while any(position[r] < len(spans[r]) for r in range(ranks)):
            progressed = False
            for stage, row in enumerate(spans):
                while position[stage] < len(row):
                    action, start, end = row[position[stage]]
                    need = None
                    if action.kind == "F" and stage > 0:
                        need = ("F", action.microbatch, stage - 1)
                    elif action.kind == "B" and stage < ranks - 1:
                        need = ("B", action.microbatch, stage + 1)
                    if need is not None and need not in done:
                        break
                    begin = max(clock[stage], done[need] if need is not None else 0.0)
                    clock[stage] = begin + (end - start)
                    done[(action.kind, action.microbatch, stage)] = clock[stage]
                    position[stage] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("the recorded operations cannot be replayed in order")
        busy = sum(e - s for row in spans for _, s, e in row)
        bubbles.append(1.0 - busy / (ranks * max(clock)))
    return statistics.mean(bubbles)


def _fitted_latency(schedule: Any, costs: list[dict[str, float]], bubble: float) -> float:
    """The per-message delay (ms) that makes the schedule simulated with these operation times give
    the measured bubble (bisection; 0 if the simulation without delay already reaches it)."""
    from paratron.parallel.pipeline.schedules import simulate

    def simulated(latency: float) -> float:
        return simulate(schedule, stage_costs=costs, p2p_latency=latency).bubble_fraction()

    low, high = 0.0, max(max(c.values()) for c in costs)
    if simulated(low) >= bubble:
        return 0.0
    if simulated(high) < bubble:
        return float("inf")
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < bubble else (low, middle)
    return (low + high) / 2


# glibc hands freed blocks over 128 KiB back to the kernel and maps the next ones afresh, so every
# step page-faults its activations in again, at a cost that varies from one operation to the next;
# keeping them in the heap makes an operation's time the same from step to step.
STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


def _per_microbatch_ms(steps: list[list[list[Any]]], kinds: tuple[str, ...]) -> list[dict[str, list[float]]]:
    """Each stage's median duration of each kind of operation per micro-batch (over the recorded
    steps): where the run's times differ from their mean systematically (a step's first backward
    allocating the gradients, say) rather than by jitter."""
    table: dict[tuple[int, str, int], list[float]] = {}
    for spans in steps:
        for stage, row in enumerate(spans):
            for action, start, end in row:
                table.setdefault((stage, action.kind, action.microbatch), []).append(end - start)
    stages = len(steps[0])
    microbatches = 1 + max(m for _, _, m in table)
    return [
        {k: [round(statistics.median(table[(s, k, i)]), 2) for i in range(microbatches)] for k in kinds}
        for s in range(stages)
    ]


def _bubble_run(args: dict, topology: Any, name: str, split: str, batches: list) -> dict:
    """Build paratron's pipeline of schedule `name` with the given split, warm it up, record
    --rounds steps; the measured bubble against the theory and against the schedule simulated with
    this run's own operation times per stage."""
    import torch.distributed as dist

    from paratron.config import resolve_layout
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize
    from paratron.parallel.pipeline.profile import measured_bubble
    from paratron.parallel.pipeline.schedules import build_schedule, simulate, theoretical_bubble

    pp, m = args["pp"], args["microbatches"]
    config = _config(args, name)
    counts = list(resolve_layout(config, pp).pipeline.counts)
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    ours = parallelize(meta, config, topology, torch.device("cpu"))
    for _ in range(args["warmup"]):
        ours.zero_grad()
        ours.forward_backward(batches, backward=lambda loss: loss.backward())
    steps = _recorded_steps(ours, batches, args["rounds"])
    p2p_ms = _p2p_one_way_ms(batches[0].input_ids.shape + (args["hidden"],))
    result: dict[str, Any] = {}
    if dist.get_rank() == 0:
        bubbles = [measured_bubble(spans) for spans in steps]
        # mean duration of each (stage, kind) over every micro-batch of every recorded step (so the
        # simulation keeps the busy time the ranks measured)
        durations: dict[tuple[int, str], list[float]] = {}
        for spans in steps:
            for stage, row in enumerate(spans):
                for action, start, end in row:
                    durations.setdefault((stage, action.kind), []).append(end - start)
        schedule = build_schedule(name, pp, m)
        kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
        op_ms = [{k: statistics.mean(durations[(s, k)]) for k in kinds} for s in range(pp)]
        theory = theoretical_bubble(name, pp, m)
        bubble = statistics.median(bubbles)
        costs = [{**{"W": 0.0}, **op} for op in op_ms]
        try:
            simulated = simulate(schedule, stage_costs=costs).bubble_fraction()
            latency = _fitted_latency(schedule, costs, bubble)
        except TypeError:  # (a simulate without per-stage costs)
            simulated = latency = float("nan")
        step_ms = [
            max(e for row in spans for _, _, e in row) - min(s for row in spans for _, s, _ in row) for spans in steps
        ]
        busy = [[sum(e - s for _, s, e in row) for row in spans] for spans in steps]
        result = {
            "schedule": name,
            "split": split,
            "layers_per_stage": counts,
            "bubble_measured": bubble,
            "bubble_measured_steps": bubbles,
            "bubble_theoretical": theory,
            "relative_to_theory": (bubble - theory) / theory,
            "within_10_percent": abs(bubble - theory) <= 0.1 * theory,
            "bubble_simulated_measured_ops": simulated,
            "bubble_replayed": replayed_bubble(steps),
            "fitted_p2p_latency_ms": latency,
            "p2p_one_way_ms": p2p_ms,
            "step_ms": statistics.median(step_ms),
            "busy_ms_per_rank": [statistics.median(b[r] for b in busy) for r in range(pp)],
            "op_ms_per_stage": op_ms,
            "op_ms_per_microbatch": _per_microbatch_ms(steps, kinds),
            "stage_forward_flops_per_token": stage_flops(args, counts),
            "idle": idle_breakdown(steps),
        }
    dist.barrier()
    return result


def _bubble_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    """`bubble`: paratron alone, each schedule of --only at each split of args["splits"]."""
    _torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.batch import Batch

    initialize("gloo")
    torch.set_num_threads(max(1, args["cores"] // world))
    if args["pin"] and world <= args["cores"] and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % args["cores"]})  # one core per stage: no migrations between cores
    topology = Topology(ParallelDims(world, pp=world), rank)
    topology.create_groups()
    mb, m, seq = args["micro_batch_size"], args["microbatches"], args["seq"]
    ids = torch.randint(0, args["vocab"], (mb * m, seq + 1), generator=torch.Generator().manual_seed(0))
    batches = [Batch(ids[i : i + mb, :-1].contiguous(), ids[i : i + mb, 1:].contiguous()) for i in range(0, mb * m, mb)]
    runs = []
    for name in args["only"]:
        for split, (first, last) in args["splits"][name].items():
            runs.append(_bubble_run(dict(args, first_layers=first, last_layers=last), topology, name, split, batches))
    if rank == 0:
        Path(out).write_text(json.dumps({"runs": runs, "threads_per_process": torch.get_num_threads()}))
    dist.destroy_process_group()


def bubble(args: dict) -> dict:
    """Measured bubble of paratron's one-chunk schedules with the even split and the balanced one."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from multiprocess import free_port

    splits: dict[str, dict[str, tuple[int | None, int | None]]] = {}
    sources: dict[str, str] = {}
    for name in args["only"]:
        splits[name] = {"even": (None, None)} if args["layers"] % args["pp"] == 0 else {}  # (none: not a multiple)
        if args["first_layers"] is not None or args["last_layers"] is not None:
            splits[name]["given"] = (args["first_layers"], args["last_layers"])
            continue
        planned = planner_balanced_split(args, name) if args["balance_from"] == "planner" else None
        sources[name] = "planner" if planned is not None else "flops"
        balanced = planned if planned is not None else flop_balanced_split(args)
        if balanced != (None, None):
            splits[name]["balanced"] = balanced
    from plan_cpu import busy_seconds, wait_for_quiet  # (bench/, this script's folder)

    waited = wait_for_quiet(args["quiet_below"], args["quiet_timeout"]) if args["quiet_below"] < 1 else 0.0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, start = busy_seconds(), time.perf_counter()
    if args["steady_malloc"]:
        os.environ.update(STEADY_MALLOC)  # (read by each spawned process's C library at its start)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_bubble_worker, args=(args["pp"], free_port(), dict(args, splits=splits), out.name), nprocs=args["pp"])
        results = json.loads(Path(out.name).read_text())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for run in results["runs"]:
        first, last = splits[run["schedule"]][run["split"]]
        run["bubble_planner"] = planner_bubble(args, run["schedule"], first, last)
    ours = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    other = (busy_seconds() - busy - ours) / ((time.perf_counter() - start) * (os.cpu_count() or 1))
    results["other_load"] = max(0.0, other)
    results["waited_for_quiet_s"] = waited
    results["balanced_split_from"] = sources
    results["model"] = _run_settings(args)
    results["timing"] = {
        "warmup_steps": args["warmup"],
        "recorded_steps": args["rounds"],
        "cores": args["cores"],
        "pinned": args["pin"],
        "steady_malloc": args["steady_malloc"],
    }
    return results


def bubble_table(pp: int, results: dict) -> str:
    """Markdown rows of one `bubble` run."""
    lines = [
        "| PP | schedule | split (layers per stage) | busy ms per rank | bubble measured | theory | measured / "
        "theory | within 10% | planner's prediction | simulated with the run's mean op times | replayed with "
        "every op's own time | idle: waiting for compute / messages / gaps |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        counts = " / ".join(str(c) for c in r["layers_per_stage"])
        busy = " / ".join(f"{b:.0f}" for b in r["busy_ms_per_rank"])
        lines.append(
            f"| {pp} | `{r['schedule']}` | {r['split']} ({counts}) | {busy} | {r['bubble_measured']:.3f} | "
            f"{r['bubble_theoretical']:.3f} | {r['bubble_measured'] / r['bubble_theoretical']:.2f} | "
            f"{'yes' if r['within_10_percent'] else 'no'} | {r.get('bubble_planner', float('nan')):.3f} | "
            f"{r['bubble_simulated_measured_ops']:.3f} | {r['bubble_replayed']:.3f} | "
            f"{r['idle']['compute']:.3f} / {r['idle']['messages']:.3f} / "
            f"{r['idle']['gaps']:.3f} |"
        )
    p2p = statistics.median(r["p2p_one_way_ms"] for r in results["runs"])
    lines.append("")
    lines.append(
        f"One activation message alone (blocking gloo send, half a round trip): {p2p:.2f} ms. Other processes "
        f"used {results['other_load']:.0%} of the cores meanwhile."
    )
    return "\n".join(lines)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["step", "bubble"])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cores", type=int, default=2, help="CPU cores shared by the processes")
    parser.add_argument(
        "--torch-zb-stages", type=int, default=1, choices=[1, 2], help="stages per rank of torch's zero-bubble schedule"
    )
    parser.add_argument(
        "--only", nargs="+", default=[name for name, _ in PAIRINGS], choices=[name for name, _ in PAIRINGS]
    )
    parser.add_argument(
        "--profile", default=None, help="a folder: cProfile every rank over the timed steps of each side (slows both)"
    )
    parser.add_argument(
        "--first-layers",
        type=int,
        default=None,
        help="layers of the first pipeline stage (1f1b, zb-h1; as --decoder-first-pipeline-num-layers)",
    )
    parser.add_argument(
        "--last-layers",
        type=int,
        default=None,
        help="layers of the last pipeline stage (as --decoder-last-pipeline-num-layers)",
    )
    parser.add_argument(
        "--balance-from",
        choices=["planner", "flops"],
        default="planner",
        help="bubble: where the balanced split comes from (the planner's cost model; FLOPs where it is missing)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="bubble: untimed steps before the recorded ones")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.1,
        help="bubble: first wait until other processes use less than this share of the cores (1: never wait)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bubble: pin each process to its own core when there are as many cores as processes",
    )
    parser.add_argument(
        "--steady-malloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bubble: keep freed memory in each process's heap (glibc settings) so operations do not page-fault",
    )
    parser.add_argument("--quiet-timeout", type=float, default=300.0, help="bubble: the longest wait for quiet, s")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    uneven = args.first_layers is not None or args.last_layers is not None
    if args.what == "bubble":
        if "--only" not in sys.argv:
            args.only = ["1f1b", "zb-h1"]
        if set(args.only) - {"1f1b", "zb-h1"}:
            parser.error("bubble measures the one-chunk schedules: --only 1f1b and/or zb-h1")
    elif "interleaved" in args.only and args.layers % (2 * args.pp):
        parser.error(f"--layers {args.layers} must split into 2 x --pp {args.pp} stages for the interleaved pairing")
    elif uneven and set(args.only) & {"interleaved", "zb-v"}:
        parser.error("--first-layers / --last-layers apply to the one-chunk schedules: add --only 1f1b zb-h1")
    settings = {k: v for k, v in vars(args).items() if k not in ("what", "output")}
    if args.what == "bubble":
        results = bubble(settings)
        print(json.dumps({k: v for k, v in results.items() if k != "model"}, indent=2), flush=True)
        print(bubble_table(args.pp, results), flush=True)
        changed = [
            n
            for n in ("layers", "hidden", "ffn", "vocab", "seq", "micro_batch_size", "microbatches")
            if getattr(args, n) != parser.get_default(n)
        ]
        key = f"bubble_pp{args.pp}" + "".join(f"_{n}{getattr(args, n)}" for n in changed)
    else:
        results = step(settings)
        print(json.dumps({k: v for k, v in results.items() if k != "model"}, indent=2), flush=True)
        print(table(args.pp, results), flush=True)
        key = f"pp{args.pp}" + (f"_first{args.first_layers}_last{args.last_layers}" if uneven else "")
    if args.output:
        merged = json.loads(args.output.read_text()) if args.output.exists() else {}
        merged[key] = {**merged.get(key, {}), **results}  # (--only keeps the other pairings)
        write_text_atomic(args.output, json.dumps(merged, indent=2))


if __name__ == "__main__":
    main()
