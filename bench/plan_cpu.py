"""The planner's step-time ranking against measured step times, on this machine.

    python bench/plan_cpu.py --output bench/results/plan_cpu.json                 # measure, then predict
    python bench/plan_cpu.py --rounds 1 --steps 3 --only w1 dp2 pp2-1f1b          # a quick look
    python bench/plan_cpu.py --from-json bench/results/plan_cpu.json --output ... # predict again, no training
    python bench/plan_cpu.py --from-json X.json --rounds 2 --output X.json      # two more rounds, then predict
    python bench/plan_cpu.py --smoke                                              # one step of two 1-process layouts

One small GPT (fp32, mock data; `MODEL` below) is trained with `paratron train --nproc N` in
each of the layouts of `LAYOUTS` (world 1, 2 and 4 on this machine's cores: data, tensor,
sequence and pipeline parallelism, pipeline schedules, ZeRO stages, full recomputation,
micro-batch sizes), always with the same global batch, so every layout does the same work per
step. Each run's step time is the median of its timed steps (after `--warmup` untimed ones, read
from `metrics.jsonl` with `--log-interval 1`: global batch x sequence / tokens_per_s). Rounds visit
the layouts in alternating order (forward, then backward); this machine is shared, so each run
waits for the cores to be quiet, records the share of them other processes used meanwhile
(/proc/stat less this run's own CPU time), and a layout's measured time is its fastest run among
those with less than `--clean-below` other load (layouts without one get `--extra-rounds` more
tries).

Each layout's step time is then predicted by the planner's cost model on the `cpu` hardware
preset (`paratron.planning.hardware`, `paratron.planning.cost.predict_step`), and the two
orders are compared by Spearman's rank correlation (ties share their mean rank). The json
keeps, per layout, the command, every step time, the prediction and its breakdown, and both
ranks; `--markdown` writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from common import NO_DROPOUT, add_smoke_argument, apply_smoke, spawn
from paratron.storage import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]

MODEL: dict[str, Any] = {
    "num_layers": 8,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "seq_length": 128,
    "max_position_embeddings": 128,
    "vocab_size": 4096,
    "untie_embeddings_and_output_weights": True,
    "global_batch_size": 16,
    **NO_DROPOUT,
}
"""The model and batch every layout trains (7.4M parameters; 2,048 tokens per step)."""
SMOKE_SHAPE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "vocab_size": 512,
    "global_batch_size": 8,
}
"""--smoke's model instead (it checks that measuring and predicting run, not what they find)."""

# name -> (processes, settings beyond MODEL). Micro-batch 2 unless said; the global batch is
# MODEL's everywhere, so data parallelism runs fewer micro-batches per rank.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "w1": (1, {"micro_batch_size": 2}),
    "w1-mb8": (1, {"micro_batch_size": 8}),
    "w1-recompute": (1, {"micro_batch_size": 2, "recompute_granularity": "full", "recompute_method": "uniform"}),
    "dp2": (2, {"micro_batch_size": 2}),
    "dp2-zero1": (2, {"micro_batch_size": 2, "zero_stage": 1}),
    "dp2-zero3": (2, {"micro_batch_size": 2, "zero_stage": 3}),
    "tp2": (2, {"micro_batch_size": 2, "tensor_model_parallel_size": 2}),
    "tp2-sp": (2, {"micro_batch_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2-1f1b": (2, {"micro_batch_size": 2, "pipeline_model_parallel_size": 2, "pipeline_schedule": "1f1b"}),
    "pp2-1f1b-mb8": (2, {"micro_batch_size": 8, "pipeline_model_parallel_size": 2, "pipeline_schedule": "1f1b"}),
    "pp2-interleaved": (
        2,
        {"micro_batch_size": 2, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2},
    ),
    "pp2-zb-h1": (2, {"micro_batch_size": 2, "pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"}),
    "dp4": (4, {"micro_batch_size": 2}),
    "tp2-dp2": (4, {"micro_batch_size": 2, "tensor_model_parallel_size": 2}),
    "tp2-pp2": (4, {"micro_batch_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    "pp4-1f1b": (4, {"micro_batch_size": 2, "pipeline_model_parallel_size": 4, "pipeline_schedule": "1f1b"}),
}

SMOKE_LAYOUTS = ["w1", "w1-recompute"]
"""--smoke's layouts: two, for a ranking to compare, of one process each (`paratron train --nproc 2`
starts three interpreters that each import torch; measuring and predicting run alike at any count)."""

QUIET: dict[str, Any] = {
    "mock_data": True,
    "eval_iters": 0,
    "log_interval": 1,
    "progress_bar": False,
    "tensorboard": False,
    "seed": 1234,
}


def _flags(settings: dict[str, Any]) -> list[str]:
    """Settings as `paratron train` flags (a False boolean as its --no- form)."""
    out: list[str] = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        if value is True:
            out.append(name)
        elif value is False:
            out.append("--no-" + name[2:])
        else:
            out += [name, str(value)]
    return out


def command(name: str, steps: int, run_dir: Path) -> list[str]:
    nproc, extra = LAYOUTS[name]
    settings = {**MODEL, **extra, **QUIET, "train_iters": steps, "run_dir": str(run_dir)}
    exe = ".venv/bin/paratron" if (ROOT / ".venv" / "bin" / "paratron").exists() else "paratron"  # (run in ROOT)
    return [exe, "train", *_flags(settings), "--nproc", str(nproc)]


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat) since boot."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return float("nan")
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit: float, timeout: float, window: float = 3.0) -> float:
    """Wait (at most `timeout` seconds) until the machine's cores were busy less than `limit` of a
    `window`-second sample (other people's processes: this machine is shared); the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        busy = busy_seconds()
        time.sleep(window)
        if (busy_seconds() - busy) / (window * (os.cpu_count() or 1)) < limit:
            break
    return time.perf_counter() - start


def measure(name: str, warmup: int, steps: int) -> dict[str, Any]:
    """Train `name` for warmup + steps steps; its timed step times (ms) and the machine's other load."""
    with tempfile.TemporaryDirectory(prefix=f"plan-cpu-{name}-") as tmp:
        cmd = command(name, warmup + steps, Path(tmp))
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy, start = busy_seconds(), time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        other = (busy_seconds() - busy - ours) / (wall * (os.cpu_count() or 1))
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}):\n{shlex.join(cmd)}\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line]
    tokens = MODEL["global_batch_size"] * MODEL["seq_length"]
    times = [1e3 * tokens / r["tokens_per_s"] for r in records if r["step"] > warmup]
    return {"step_ms": times, "wall_s": wall, "other_load": max(0.0, other), "loss_last": records[-1]["loss"]}


# ---------------------------------------------------------------- calibration: what the cpu preset should see


def _calibrate_worker(rank: int, world: int, port: int, sizes: list[int], out: str) -> None:
    """One of `world` gloo processes with the threads `paratron train` gives it: the fp32 matmul rate
    of this model's layer shapes while every process computes at once, then each collective's time."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # (torch 2.13 renames the tensor collectives)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    h, tokens = MODEL["hidden_size"], 2 * MODEL["seq_length"]
    a, w = torch.randn(tokens, h), torch.randn(4 * h, h)
    rates = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            a @ w.t()
        rates.append(20 * 2 * tokens * h * 4 * h / (time.perf_counter() - start))
    times: dict[str, dict[str, float]] = {}
    for size in sizes:
        x = torch.zeros(size // 4)
        shard = torch.zeros(size // 4 // world)
        ops = {
            "all_reduce": (dist.all_reduce, (x,)),
            "all_gather": (dist.all_gather_into_tensor, (x, shard)),
            "reduce_scatter": (dist.reduce_scatter_tensor, (shard, x)),
        }
        for name, (op, tensors) in ops.items():
            runs = []
            for _ in range(21):
                dist.barrier()
                start = time.perf_counter()
                op(*tensors)
                runs.append(time.perf_counter() - start)
            times.setdefault(name, {})[str(size)] = 1e3 * min(runs[1:])  # (others' jobs only slow it down)
    # the same all-reduces between layer-shaped matmuls, as tensor parallelism issues them: what each
    # adds to the step (gloo's threads compete with the compute for the cores, and every collective
    # waits for the slowest rank), against the matmuls alone
    in_step: dict[str, float] = {}
    for size in sizes:
        x = torch.zeros(size // 4)
        best = {}
        for with_collective in (False, True):
            runs = []
            for _ in range(3):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    a @ w.t()
                    if with_collective:
                        dist.all_reduce(x)
                dist.barrier()
                runs.append((time.perf_counter() - start) / 20)
            best[with_collective] = min(runs)
        in_step[str(size)] = 1e3 * max(0.0, best[True] - best[False])
    times["all_reduce_between_matmuls"] = in_step
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rate": max(rates), "times": times})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def calibrate(
    worlds: tuple[int, ...] = (1, 2, 4), sizes: tuple[int, ...] = (2**16, 2**18, 2**20, 2**22)
) -> dict[str, Any]:
    """Per process count: each process's matmul rate (GFLOP/s, all computing at once: N processes
    share the cores) and the gloo collectives' times (ms) for messages of `sizes` bytes."""
    out: dict[str, Any] = {}
    for world in worlds:
        ranks = spawn(_calibrate_worker, world, list(sizes))
        out[str(world)] = {
            "matmul_gflops_per_process": statistics.median(r["rate"] for r in ranks) / 1e9,
            "collective_ms": ranks[0]["times"] if world > 1 else {},
        }
    return out


def config_of(name: str) -> Any:
    """The paratron `Config` of a layout, as the command builds it."""
    from paratron.config import build_config

    _, extra = LAYOUTS[name]
    return build_config({**MODEL, **extra, "mock_data": True, "train_iters": 10})


def cpu_presets(names: list[str]) -> dict[int, Any]:
    """The `cpu` preset as `paratron plan --hardware cpu` measures it, for each process count of
    `names` (one probe per count, so the layouts of one world size share it)."""
    import dataclasses

    from paratron.planning.hardware import hardware_from

    counts = sorted({LAYOUTS[name][0] for name in names})
    planning = dataclasses.replace(config_of(names[0]).planning, hardware="cpu")
    return {n: hardware_from(planning, gpus_per_node=n) for n in counts}


def predict(names: list[str], machines: dict[int, Any]) -> dict[str, Any]:
    """The planner's predicted step time (ms) and its breakdown for every layout, on the hardware
    of its process count."""
    import dataclasses

    from paratron.config import resolve_layout
    from paratron.planning.cost import predict_step

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        nproc = LAYOUTS[name][0]
        config = config_of(name)
        layout = resolve_layout(config, nproc)
        estimate = predict_step(config, layout, machines[nproc])
        out[name] = {
            "predicted_ms": 1e3 * estimate.total,
            "breakdown_ms": {k: 1e3 * v for k, v in estimate.breakdown.items()},
            "stage_fbw_ms": [[1e3 * t for t in stage] for stage in estimate.stages],
        }
    hardware = {str(n): dataclasses.asdict(h) for n, h in sorted(machines.items())}
    return {"hardware_by_processes": hardware, "layouts": out}


LAYER_EFFICIENCY = 0.7
"""The share of a lone layer-shaped matmul's rate (the calibration's) that a whole Transformer layer's
forward and backward reach on this CPU: from bench/pipeline_bubble.py's stage times (a PP 2 stage of 4
layers, 8 micro-batches of 2 x 128 tokens, about 40 GFLOP in about 0.63 s on one thread, against
about 90 GFLOP/s for the lone matmul)."""


def corrected_hardware(preset: Any, nproc: int, calibration: dict[str, Any]) -> Any:
    """The `cpu` preset as this report proposes to measure it: the compute rate of one process from
    a layer-shaped matmul timed while all `nproc` processes compute at once (best of a few tries,
    so another job's burst does not become the machine's speed; processes beyond the cores share
    them), at LAYER_EFFICIENCY; and gloo's latency and bandwidth fitted to what an all-reduce adds
    between layer-shaped matmuls, as tensor parallelism issues them (ring model:
    2 (n-1) (bytes / n / bandwidth + latency)); alone, on idle cores, an all-reduce is several
    times faster than that."""
    import dataclasses

    rate = calibration[str(nproc)]["matmul_gflops_per_process"] * 1e9
    changes: dict[str, float] = {"peak_tflops": rate / 1e12, "matmul_efficiency": LAYER_EFFICIENCY}
    times = calibration[str(nproc)]["collective_ms"].get("all_reduce_between_matmuls", {})
    if nproc > 1 and len(times) >= 2:
        latency, per_byte = fit_ring(times, nproc)
        changes |= {"intra_node_gbps": 1 / per_byte / 1e9, "intra_node_latency_us": latency * 1e6}
    return dataclasses.replace(preset, **changes)


def fit_ring(times_ms: dict[str, float], n: int) -> tuple[float, float]:
    """(latency s, s per byte) of the ring all-reduce model t = 2 (n-1) (bytes / n x per_byte + latency),
    least squares over the measured sizes (each weighted by 1 / t, so small messages count too)."""
    sizes = np.array([int(k) for k in times_ms], dtype=float)
    t = np.array(list(times_ms.values())) / 1e3
    a = 2 * (n - 1) * np.stack([np.ones_like(sizes), sizes / n], axis=1) / t[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return max(float(latency), 0.0), max(float(per_byte), 1e-12)


def ranks(values: list[float]) -> np.ndarray:
    """Ranks from 1 (smallest); tied values share their mean rank."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the two rankings."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def describe_layout(name: str) -> str:
    nproc, extra = LAYOUTS[name]
    parts = []
    tp, pp = extra.get("tensor_model_parallel_size", 1), extra.get("pipeline_model_parallel_size", 1)
    dp = nproc // (tp * pp)
    for label, size in (("TP", tp), ("PP", pp), ("DP", dp)):
        if size > 1:
            parts.append(f"{label} {size}")
    if extra.get("sequence_parallel"):
        parts.append("SP")
    if pp > 1:
        parts.append(
            "interleaved x2"
            if "num_layers_per_virtual_pipeline_stage" in extra
            else extra.get("pipeline_schedule", "1f1b")
        )
    if extra.get("zero_stage"):
        parts.append(f"ZeRO-{extra['zero_stage']}")
    if extra.get("recompute_granularity"):
        parts.append(f"{extra['recompute_granularity']} recompute")
    parts.append(f"mb {extra.get('micro_batch_size', 4)}")
    return f"{nproc} proc: " + (", ".join(parts) if parts else "one process")


def clean_rounds(row: dict[str, Any], limit: float) -> list[dict[str, Any]]:
    """The rounds of a layout during which other processes used less than `limit` of the cores; if
    there is none, the round they loaded least."""
    clean = [rnd for rnd in row["rounds"] if rnd["other_load"] < limit]
    return clean or [min(row["rounds"], key=lambda rnd: rnd["other_load"])]


def summarize(results: dict[str, Any], clean_below: float) -> None:
    """Medians, ranks and rho into `results` (in place). A layout's measured time is the fastest of
    its clean rounds (`clean_rounds`), each round counted by the median of its timed steps: other
    people's jobs on this shared machine only ever slow a run down."""
    layouts = results["layouts"]
    results["clean_below"] = clean_below
    for row in layouts.values():
        used = clean_rounds(row, clean_below)
        medians = [statistics.median(rnd["step_ms"]) for rnd in used]
        row["measured_ms"] = min(medians)
        row["rounds_used"] = [row["rounds"].index(rnd) for rnd in used]
        row["round_medians_ms"] = [statistics.median(rnd["step_ms"]) for rnd in row["rounds"]]
        row["spread"] = (max(medians) - min(medians)) / row["measured_ms"]
    names = list(layouts)
    measured = ranks([layouts[n]["measured_ms"] for n in names])
    for n, r in zip(names, measured):
        layouts[n]["rank_measured"] = float(r)
    predicted = results.get("prediction", {}).get("layouts", {})
    if predicted and all(n in predicted for n in names):
        for n, r in zip(names, ranks([predicted[n]["predicted_ms"] for n in names])):
            layouts[n].update(predicted[n], rank_predicted=float(r))
        results["spearman_rho"] = spearman(
            [layouts[n]["measured_ms"] for n in names], [layouts[n]["predicted_ms"] for n in names]
        )
    corrected = results.get("prediction_corrected", {}).get("layouts", {})
    if corrected and all(n in corrected for n in names):
        times = [corrected[n]["predicted_ms"] for n in names]
        for n, t, r in zip(names, times, ranks(times)):
            layouts[n].update(predicted_corrected_ms=t, rank_predicted_corrected=float(r))
        results["spearman_rho_corrected"] = spearman([layouts[n]["measured_ms"] for n in names], times)


def markdown(results: dict[str, Any]) -> str:
    layouts = results["layouts"]
    names = sorted(layouts, key=lambda n: layouts[n]["measured_ms"])
    has_prediction = "spearman_rho" in results
    corrected = "spearman_rho_corrected" in results
    head = "| layout | measured ms | spread | other load | predicted ms | rank measured | rank predicted |"
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if corrected:
        head += " predicted ms, corrected preset | its rank |"
        rule += "---:|---:|"
    lines = [head, rule]
    for n in names:
        row = layouts[n]
        pred = f"{row['predicted_ms']:.0f}" if has_prediction else "-"
        rank_p = f"{row['rank_predicted']:g}" if has_prediction else "-"
        load = max(row["rounds"][i]["other_load"] for i in row["rounds_used"])
        line = (
            f"| `{n}`: {describe_layout(n)} | {row['measured_ms']:.0f} | {100 * row['spread']:.0f}% | "
            f"{100 * load:.0f}% | {pred} | {row['rank_measured']:g} | {rank_p} |"
        )
        if corrected:
            line += f" {row['predicted_corrected_ms']:.0f} | {row['rank_predicted_corrected']:g} |"
        lines.append(line)
    if has_prediction:
        lines += ["", f"Spearman's rho over {len(names)} layouts: **{results['spearman_rho']:.3f}**"]
    if corrected:
        lines[-1] += f"; with the corrected preset: **{results['spearman_rho_corrected']:.3f}**"
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds over the layouts (default 2; with --from-json 0: add rounds)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.1,
        help="before each run, wait until other processes use less than this share of the cores (1: never wait)",
    )
    parser.add_argument(
        "--clean-below",
        type=float,
        default=0.1,
        help="rounds during which other processes used this share of the cores or more are set aside",
    )
    parser.add_argument(
        "--extra-rounds",
        type=int,
        default=2,
        help="up to this many more runs of each layout that has no clean round yet",
    )
    parser.add_argument("--quiet-timeout", type=float, default=300.0, help="the longest wait for quiet, seconds")
    parser.add_argument("--from-json", type=Path, default=None, help="take the measurements from this output")
    parser.add_argument("--no-predict", action="store_true", help="measure only")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also measure each process's matmul rate at 1, 2 and 4 processes and gloo's collectives",
    )
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="default: --output with .md")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, only=SMOKE_LAYOUTS, rounds=1, warmup=0, steps=1, quiet_below=1.0, extra_rounds=0)
    if args.smoke:
        MODEL.update(SMOKE_SHAPE)

    if args.from_json:
        results = json.loads(args.from_json.read_text())
        results["layouts"] = {n: {"rounds": row["rounds"]} | _keep(row) for n, row in results["layouts"].items()}
    else:
        results = {"model": MODEL, "layouts": {}, "timing": {"warmup_steps": args.warmup, "timed_steps": args.steps}}
    for name in args.only:
        results["layouts"].setdefault(name, {"rounds": []})
    rounds = args.rounds if args.rounds is not None else (0 if args.from_json else 2)
    done = max((len(row["rounds"]) for row in results["layouts"].values()), default=0)
    for r in range(rounds):
        order = args.only if (done + r) % 2 == 0 else list(reversed(args.only))
        for name in order:
            run(results["layouts"][name], name, f"round {done + r + 1}", args)
    for extra in range(args.extra_rounds if rounds else 0):
        for name in args.only:
            row = results["layouts"][name]
            if not any(rnd["other_load"] < args.clean_below for rnd in row["rounds"]):
                run(row, name, f"extra {extra + 1}", args)
    for name in args.only:
        # the exact command, as run (minus the temporary run directory)
        cmd = command(name, args.warmup + args.steps, Path("RUN_DIR"))
        results["layouts"][name].update(command=shlex.join(cmd), description=describe_layout(name))
    results["cores"] = os.cpu_count()
    if args.calibrate:
        results["calibration"] = calibrate()
        print(json.dumps(results["calibration"], indent=1))
    if not args.no_predict:
        try:
            if args.quiet_below < 1:  # (the cpu preset probes the matmul rate now)
                wait_for_quiet(args.quiet_below, args.quiet_timeout)
            names = list(results["layouts"])
            presets = cpu_presets(names)
            results["prediction"] = predict(names, presets)
            if "calibration" in results:
                corrected = {n: corrected_hardware(h, n, results["calibration"]) for n, h in presets.items()}
                results["prediction_corrected"] = predict(names, corrected)
        except (ImportError, AttributeError, NotImplementedError) as exc:
            print(f"no prediction: the planner's cost model is not there yet ({exc!r})", file=sys.stderr)
    summarize(results, args.clean_below)
    table = markdown(results)
    print(table)
    if args.output:
        write_text_atomic(args.output, json.dumps(results, indent=2) + "\n")
        write_text_atomic(args.markdown or args.output.with_suffix(".md"), table)


def run(row: dict[str, Any], name: str, label: str, args: argparse.Namespace) -> None:
    """One more run of layout `name` (after waiting for quiet), appended to its rounds."""
    waited = wait_for_quiet(args.quiet_below, args.quiet_timeout) if args.quiet_below < 1 else 0.0
    got = measure(name, args.warmup, args.steps) | {"waited_for_quiet_s": waited}
    row["rounds"].append(got)
    print(
        f"{label} {name:<16} {statistics.median(got['step_ms']):8.1f} ms/step "
        f"(other load {got['other_load']:.0%}, waited {waited:.0f} s for quiet)",
        flush=True,
    )


def _keep(row: dict[str, Any]) -> dict[str, Any]:
    """What a re-prediction keeps of a measured row (the command and description)."""
    return {k: row[k] for k in ("command", "description") if k in row}


if __name__ == "__main__":
    main()
