"""Tensor parallelism benchmarks.

    python bench/tensor_parallel.py step      # TP=2 step time: paratron vs PyTorch DTensor TP, 2 gloo processes
    python bench/tensor_parallel.py memory    # parameter bytes per rank at TP 1/2/4/8 (meta device, no processes)
    python bench/tensor_parallel.py all --smoke  # both, tiny: does it still run and agree with DTensor?

`step` trains the same model (a Llama-shaped GPT from paratron's model code, same seed) in
two ways on the same two processes: paratron's tensor-parallel layers, and PyTorch's own
DTensor tensor parallelism (`parallelize_module` with ColwiseParallel / RowwiseParallel /
SequenceParallel and `loss_parallel`, the torchtitan plan), rounds alternating. It also
counts paratron's collectives per layer per step against the theoretical count.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from common import DATA_SEED, LLAMA_SMALL, PRECISION, SEED, add_smoke_argument, apply_smoke, spawn
from paratron.distributed.local_ranks import torchrun_environment

MODEL = LLAMA_SMALL
SEQ_LENGTH, MICRO_BATCH = 256, 4
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
SMOKE_MODEL |= dict(vocab_size=256, seq_length=32, micro_batch_size=2)


def _config(sequence_parallel: bool, tp: int, model: dict):
    from paratron.config import build_config

    return build_config(
        dict(
            model,
            tensor_model_parallel_size=tp,
            sequence_parallel=sequence_parallel,
            mock_data=True,
            seq_length=model["seq_length"],
            micro_batch_size=model["micro_batch_size"],
            seed=SEED,
        )
    )


def _paratron_model(config, topology):
    from paratron.config.layout import resolve_layout
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize

    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    return parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))


def _dtensor_model(config, mesh, sequence_parallel: bool):
    """The same model, parallelized by PyTorch's DTensor plan (as torchtitan does for Llama)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from paratron.model.gpt import build_model

    model = build_model(config.model, seed=config.training.seed)
    seq = Shard(1) if sequence_parallel else Replicate()
    # the block hands attention x and then its other arguments (rotary tables, cache, ...): only x moves
    others = (None,) * (len(inspect.signature(model.layers[0].attention.forward).parameters) - 1)
    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["final_norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        plan.update(
            {
                f"{p}.attention.in_proj.q": ColwiseParallel(),
                f"{p}.attention.in_proj.k": ColwiseParallel(),
                f"{p}.attention.in_proj.v": ColwiseParallel(),
                f"{p}.attention.out_proj": RowwiseParallel(output_layouts=seq),
                f"{p}.mlp.in_proj.gate": ColwiseParallel(),
                f"{p}.mlp.in_proj.up": ColwiseParallel(),
                f"{p}.mlp.out_proj": RowwiseParallel(output_layouts=seq),
            }
        )
        if sequence_parallel:
            plan.update(
                {
                    f"{p}.attention_norm": SequenceParallel(),
                    f"{p}.mlp_norm": SequenceParallel(),
                    f"{p}.attention": PrepareModuleInput(
                        input_layouts=(Shard(1), *others), desired_input_layouts=(Replicate(), *others)
                    ),
                    f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
    return parallelize_module(model, mesh, plan)


def _time_steps(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _step_worker(rank: int, world: int, port: int, rounds: int, steps: int, model: dict, out: str) -> None:
    torchrun_environment(rank, world, port)
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from paratron.distributed import comm
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology

    ctx = initialize("gloo")
    topology = Topology(ParallelDims(world, tp=world), ctx.rank)
    topology.create_groups()
    mesh = init_device_mesh("cpu", (world,))
    shape = (model["micro_batch_size"], model["seq_length"] + 1)
    ids = torch.randint(0, model["vocab_size"], shape, generator=torch.Generator().manual_seed(DATA_SEED))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    results = {}
    for sequence_parallel in (False, True):
        config = _config(sequence_parallel, world, model)
        ours = _paratron_model(config, topology)
        ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
        theirs = _dtensor_model(config, mesh, sequence_parallel)
        theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

        def paratron_step(ours=ours, ours_opt=ours_opt) -> float:
            ours.zero_grad()
            loss = ours.loss_function(ours(inputs), labels)
            loss.backward()
            ours.finish_grad_sync()
            ours_opt.step()
            return loss.item()

        def dtensor_step(theirs=theirs, theirs_opt=theirs_opt) -> float:
            theirs_opt.zero_grad(set_to_none=True)
            logits = theirs(inputs)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
            theirs_opt.step()
            return loss.full_tensor().item()

        first_losses = paratron_step(), dtensor_step()  # warm-up; both start from the same weights
        assert abs(first_losses[0] - first_losses[1]) < 1e-4 * first_losses[1], first_losses
        times: dict[str, list[float]] = {"paratron": [], "dtensor": []}
        for _ in range(rounds):
            times["paratron"].append(_time_steps(paratron_step, steps))
            times["dtensor"].append(_time_steps(dtensor_step, steps))
        key = "tp2_sp" if sequence_parallel else "tp2"
        results[key] = {
            "first_loss": first_losses,
            "paratron_s": statistics.median(times["paratron"]),
            "dtensor_s": statistics.median(times["dtensor"]),
            "rounds": times,
        }
        results[key]["ratio"] = results[key]["paratron_s"] / results[key]["dtensor_s"]

        # collectives per layer per step: the difference between 2-layer and 1-layer models
        counts = []
        for layers in (1, 2):
            small = _paratron_model(_config(sequence_parallel, world, dict(model, num_layers=layers)), topology)
            with comm.count_collectives() as counted:
                small.loss_function(small(inputs), labels).backward()
                small.finish_grad_sync()
            counts.append(dict(counted))
        results[key]["collectives_per_layer"] = {
            k: counts[1].get(k, 0) - counts[0].get(k, 0) for k in set(counts[0]) | set(counts[1])
        }
        results[key]["collectives_outside_layers"] = {
            k: 2 * counts[0].get(k, 0) - counts[1].get(k, 0) for k in counts[0]
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def step(rounds: int, steps: int, model: dict, forked: bool = False) -> dict:
    results = spawn(_step_worker, 2, rounds, steps, model, forked=forked)
    results["model"] = model | {"precision": PRECISION}
    return results


def memory(device_gb: float, degrees: tuple[int, ...]) -> dict:
    """Parameter bytes per rank by TP degree, and the largest model whose training state fits a device."""
    from paratron.model.gpt import GPT
    from paratron.model.registry import model_config
    from paratron.parallel.tensor.apply import apply_tensor_parallel
    from paratron.parallel.tensor.layers import TPContext

    def per_rank(config, tp: int) -> int:
        with torch.device("meta"):
            model = GPT(config)
        if tp > 1:
            apply_tensor_parallel(model, TPContext(tp, 0), None, 128)
        return sum(p.numel() for p in model.parameters())

    rows = []
    base = model_config("llama3-8b")
    for tp in degrees:
        n = per_rank(base, tp)
        rows.append({"tp": tp, "params_per_rank": n, "bf16_weights_gb": 2 * n / 1e9, "training_state_gb": 16 * n / 1e9})

    # GPT-3-shaped family (Brown et al.): hidden h = 128 x heads, layers = h / 128, 4h MLP.
    largest = []
    for tp in degrees:
        best = None
        for heads in range(tp, 513, tp):  # every head count the TP degree divides
            h = 128 * heads
            config = dataclasses.replace(
                model_config("gpt3-175b"), hidden_size=h, num_attention_heads=heads, num_layers=h // 128
            )
            if 16 * per_rank(config, tp) > device_gb * 1e9:
                break
            with torch.device("meta"):
                best = {"hidden": h, "layers": h // 128, "params": sum(p.numel() for p in GPT(config).parameters())}
        largest.append({"tp": tp, **(best or {})})
    return {
        "llama3-8b": rows,
        "device_gb": device_gb,
        "largest_gpt3_shaped": largest,
        "bytes_per_param": "16 (mixed-precision Adam: bf16 weights and gradients, fp32 master, two moments)",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["step", "memory", "all"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device-gb", type=float, default=80.0)
    parser.add_argument("--output", type=Path, default=None)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, rounds=1, steps=1, device_gb=1.0)
    model = MODEL | {"seq_length": SEQ_LENGTH, "micro_batch_size": MICRO_BATCH}
    if args.smoke:
        model |= SMOKE_MODEL
    results = {}
    if args.what in ("memory", "all"):
        results["memory"] = memory(args.device_gb, (1, 2) if args.smoke else (1, 2, 4, 8))
        print(json.dumps(results["memory"], indent=2), flush=True)
    if args.what in ("step", "all"):
        results["step"] = step(args.rounds, args.steps, model, forked=args.smoke)
        print(json.dumps({k: v for k, v in results["step"].items() if k != "model"}, indent=2), flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
