"""Context parallelism: step time at CP 2 and 4 against CP 1 on the same sequence, the share of the
ring's communication hidden behind attention, and PyTorch's own context-parallel API.

    python bench/context_parallel.py --output bench/results/context_parallel.json
    python bench/context_parallel.py --budget-gb 2 --long-sequence 131072 \
        --output bench/results/context_parallel_budget.json
    python bench/context_parallel.py --smoke  # 256 tokens at CP 1 and 2 (ring): does it still run?

1. Step time: paratron's trainer on mock data (fp32, gloo on the CPU, the machine's cores shared
   by the processes), one sequence of --seq-length tokens per step split over CP ranks (CP 1: one
   process); median of the logged steps after warm-up.
2. Hidden communication, on one causal attention call split over 2 and 4 ranks (forward +
   backward, after a warm-up, the ranks aligned by a barrier before each round): the time spent
   waiting for the ring's transfers after the attention each overlaps (the exposed part), and the
   same transfers (recorded sizes, same order) replayed alone, back to back. Hidden share =
   1 - exposed / alone (rank 0's).
3. `torch.distributed.tensor.experimental.context_parallel` on the same attention call (its ring
   over SDPA under a DeviceMesh) against paratron's ring; where it cannot run on this device its
   error is reported.
4. With --budget-gb: a sequence that does not fit one process's memory cap (RLIMIT_DATA) trains
   at CP 4, each rank under the same cap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import LLAMA_STYLE, NO_DROPOUT, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks

MODEL = dict(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=256,
    **LLAMA_STYLE,
    vocab_size=1024,
    **NO_DROPOUT,
)


def _settings(seq_length: int, cp: int, steps: int, run_dir: str, **extra: Any) -> dict[str, Any]:
    """The trainer's settings: MODEL on one mock sequence of `seq_length` tokens per step."""
    return dict(
        MODEL,
        max_position_embeddings=seq_length,
        seq_length=seq_length,
        mock_data=True,
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=steps,
        eval_iters=0,
        context_parallel_size=cp,
        run_dir=run_dir,
        progress_bar=False,
        tensorboard=False,
        log_interval=1,
        **extra,
    )


def train(seq_length: int, cp: int, steps: int, comm_type: str, run_dir: str) -> dict[str, Any]:
    """Median step time of paratron's trainer at this context-parallel size."""
    from paratron.config import build_config
    from paratron.distributed.init import initialize
    from paratron.training.run import run_training

    if cp > 1:
        initialize("gloo")
    run_training(build_config(_settings(seq_length, cp, steps, run_dir, cp_comm_type=comm_type)))
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {"cp": cp, "comm": comm_type, "step_s": statistics.median(seq_length / r["tokens_per_s"] for r in rows[2:])}


def attention(seq_length: int, rounds: int) -> dict[str, Any]:
    """One causal attention call (8 heads x 64) split over every rank: paratron's ring forward +
    backward with the waits for its transfers timed, the same transfers alone, and PyTorch's
    context_parallel on the same call."""
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import RankGroup
    from paratron.model.attention import Causal, TokenPlaces
    from paratron.parallel.context import comm
    from paratron.parallel.context.attention import ContextParallelAttention
    from paratron.parallel.context.split import token_index

    initialize("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, seq_length, 64) for _ in range(3))
    group = RankGroup.world()
    index = token_index(seq_length, world, rank)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    core = ContextParallelAttention(Causal(), group, "p2p")

    sizes: list[tuple[tuple[int, ...], torch.dtype]] = []
    exposed = [0.0]
    shift, wait = comm.Ring.shift, comm.PendingShift.wait

    def timed_shift(self, tensor):
        sizes.append((tuple(tensor.shape), tensor.dtype))
        return shift(self, tensor)

    def timed_wait(self):
        start = time.perf_counter()
        out = wait(self)
        exposed[0] += time.perf_counter() - start
        return out

    times = []
    for r in range(rounds + 1):
        if r == 1:  # (after warm-up)
            comm.Ring.shift, comm.PendingShift.wait = timed_shift, timed_wait
        dist.barrier()
        start = time.perf_counter()
        core(*mine, TokenPlaces(index)).sum().backward()
        if r:
            times.append(time.perf_counter() - start)
    comm.Ring.shift, comm.PendingShift.wait = shift, wait
    ring = comm.Ring(group)
    tensors = [torch.randn(shape).to(dtype) for shape, dtype in sizes]
    dist.barrier()
    start = time.perf_counter()
    for t in tensors:
        ring.shift(t).wait()
    alone = (time.perf_counter() - start) / rounds
    result: dict[str, Any] = {
        "world": world,
        "seq_length": seq_length,
        "paratron_s": statistics.median(times),
        "transfers_alone_s": alone,
        "exposed_wait_s": exposed[0] / rounds,
        "hidden_share": 1 - exposed[0] / rounds / alone,
    }
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(q.device.type, (world,))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            shards = [t.detach().requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(*shards, is_causal=True).sum().backward()
            result["torch_s"] = time.perf_counter() - start
        result["ratio"] = result["paratron_s"] / result["torch_s"]
    except Exception as error:  # (reported as it is: the API's own message)
        result["torch_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    return result


def under_budget(seq_length: int, cp: int, budget_gb: float, run_dir: str) -> dict[str, Any]:
    """Two training steps of one `seq_length` sequence with this process's memory capped at
    `budget_gb` (RLIMIT_DATA: what the allocator may map), sliding-window attention (W 1024)."""
    import resource

    from paratron.config import build_config
    from paratron.distributed.init import initialize
    from paratron.training.run import run_training

    initialize("gloo")
    budget = int(budget_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
    settings = _settings(seq_length, cp, 2, run_dir, attention_type="sliding-window", window_size=1024, log_memory=True)
    try:
        run_training(build_config(settings))
    except (RuntimeError, MemoryError) as error:
        return {"cp": cp, "trained": False, "error": str(error).splitlines()[0][:200]}
    report = json.loads((Path(run_dir) / "memory.json").read_text())["ranks"]
    losses = [json.loads(line)["loss"] for line in open(Path(run_dir) / "metrics.jsonl")]
    return {"cp": cp, "trained": True, "losses": losses, "activations_mb": report[0]["activations_peak"] / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--budget-gb", type=float, help="instead: train --long-sequence tokens at CP 1 and 4 under this cap"
    )
    parser.add_argument("--long-sequence", type=int, default=131072)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="context-parallel sizes")
    parser.add_argument("--comms", nargs="+", default=["p2p", "all_gather"], choices=["p2p", "all_gather"])
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, seq_length=256, steps=3, worlds=[2], comms=["p2p"])
    if args.budget_gb:
        with tempfile.TemporaryDirectory() as root:
            rows = [
                run_ranks(under_budget, cp, args.long_sequence, cp, args.budget_gb, f"{root}/cp{cp}", timeout=3000)[0]
                for cp in (1, 4)
            ]
        for row in rows:
            print(json.dumps(row))
        if args.output:
            args.output.write_text(
                json.dumps({"budget_gb": args.budget_gb, "seq_length": args.long_sequence, "runs": rows}, indent=1)
                + "\n"
            )
        return
    results: dict[str, Any] = {"model": MODEL, "seq_length": args.seq_length, "runs": []}
    with tempfile.TemporaryDirectory() as root:
        results["runs"].append(train(args.seq_length, 1, args.steps, "p2p", f"{root}/cp1"))
        for cp, comm_type in ((cp, comm) for cp in args.worlds for comm in args.comms):
            run_dir = f"{root}/cp{cp}-{comm_type}"
            results["runs"].append(run_ranks(train, cp, args.seq_length, cp, args.steps, comm_type, run_dir)[0])
    base = results["runs"][0]["step_s"]
    for run in results["runs"]:
        run["speedup_vs_cp1"] = base / run["step_s"]
        print(json.dumps(run))
    rounds = 1 if args.smoke else 5
    results["attention"] = [run_ranks(attention, world, args.seq_length, rounds)[0] for world in args.worlds]
    for row in results["attention"]:
        print(json.dumps(row))
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
