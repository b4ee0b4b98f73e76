"""Expert parallelism, two and four processes: the same MoE model at EP = world against EP 1
(plain data parallelism), the bytes the token dispatchers send against their formulas, and the
alltoall dispatcher against allgather; then MoE parallel folding under tensor parallelism: TP 2
with the experts split like the dense MLP (expert TP 2, EP 1 at two processes, EP 2 at four)
against the folded TP 2 x EP = world x expert TP 1 (whole experts, EP over the TP ranks).

    python bench/expert_parallel.py --output bench/results/expert_parallel.json
    python bench/expert_parallel.py --smoke  # a few short steps on two processes: does it still run?

Each run is paratron's trainer on mock data (fp32, gloo on the CPU, the machine's cores shared by
the processes), one micro-batch per rank per step; tokens/s is the median of the logged steps
after warm-up. Bytes are counted in every rank by wrapping torch.distributed's all-to-all,
all-gather and reduce-scatter (the dispatchers' only uses of them here: no tensor parallelism,
no ZeRO) and summing what leaves each rank for the others.

Formulas, per MoE layer, micro-batch and rank, for N tokens of hidden size H, top-k, E experts:
  alltoall   R = N k (EP - 1) / EP routed copies leave for other ranks when routing is even: the
             tokens (R H fp32), their probs (R fp32) and the outputs back (R H), and the same again
             in backward, plus the counts (E int64 x (EP - 1) / EP): 2 (2 R H + R) 4 + 8 E (EP - 1) / EP
  allgather  every rank's N tokens, probs [N, E] and routing map [N, E] (uint8) gathered, the
             outputs [EP N, H] reduce-scattered, and the duals in backward:
             (EP - 1) N (16 H + 8 E + E) bytes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import LLAMA_STYLE, NO_DROPOUT, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks

MODEL = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    **LLAMA_STYLE,
    vocab_size=4096,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=512,
    moe_aux_loss_coeff=1e-2,
    **NO_DROPOUT,
)
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=256)
SMOKE_MODEL |= dict(num_experts=4, moe_ffn_hidden_size=64)
"""--smoke's shape instead (4 experts: EP 2 still holds two per rank)."""


def model_settings(smoke: bool) -> dict[str, Any]:
    """The MoE model of the runs: MODEL, or its smoke shape."""
    return MODEL | SMOKE_MODEL if smoke else MODEL


def _count_bytes(sent: list[int]) -> None:
    """Wrap the collectives the dispatchers use so that each call adds the bytes this rank sends
    to the other ranks to sent[0]."""
    import torch.distributed as dist

    def size_of(group: Any) -> tuple[int, int]:
        return dist.get_world_size(group), dist.get_rank(group)

    original_all_to_all = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        size, me = size_of(group)
        rows = input_split_sizes or [input.size(0) // size] * size
        row_bytes = input[0].numel() * input.element_size() if input.size(0) else 0
        sent[0] += (sum(rows) - rows[me]) * row_bytes
        return original_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    original_gather = dist.all_gather_single

    def all_gather_single(output, input, group=None, **kw):
        size, _ = size_of(group)
        sent[0] += input.numel() * input.element_size() * (size - 1)
        return original_gather(output, input, group=group, **kw)

    original_scatter = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, group=None, **kw):
        size, _ = size_of(group)
        sent[0] += input.numel() * input.element_size() * (size - 1) // size
        return original_scatter(output, input, group=group, **kw)

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_single = all_gather_single
    dist.reduce_scatter_single = reduce_scatter_single


def _worker(args: dict, layout: dict, run_dir: str) -> int:
    """One rank's run; returns the bytes it sent to the other ranks."""
    from paratron.config import build_config
    from paratron.training.run import run_training

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    sent = [0]
    _count_bytes(sent)
    settings = dict(
        model_settings(args["smoke"]),
        mock_data=True,
        seq_length=args["seq"],
        micro_batch_size=args["batch"],
        global_batch_size=args["batch"] * world,
        train_iters=args["steps"],
        lr=1e-4,
        eval_iters=0,
        run_dir=run_dir,
        log_interval=1,
        progress_bar=False,
        tensorboard=False,
        **layout,
    )
    run_training(build_config(settings))
    return sent[0]


def _run(args: argparse.Namespace, world: int, layout: dict, folder: Path, name: str) -> dict[str, Any]:
    """`world` processes of one layout; tokens/s and the bytes every rank sent per step."""
    settings = {key: value for key, value in vars(args).items() if key != "output"}
    sent = run_ranks(_worker, world, settings, layout, str(folder / name), timeout=900)
    records = [json.loads(line) for line in open(folder / name / "metrics.jsonl")][args.warmup :]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "bytes_per_step_per_rank": sum(sent) / args.steps / world,
    }


def formula(args: argparse.Namespace, ep: int, dispatcher: str) -> float:
    """Bytes each rank sends per step by the module docstring's formulas (even routing)."""
    model = model_settings(args.smoke)
    N, H, k, E = args.seq * args.batch, model["hidden_size"], model["moe_router_topk"], model["num_experts"]
    if dispatcher == "alltoall":
        routed = N * k * (ep - 1) / ep
        per_layer = 2 * (2 * routed * H + routed) * 4 + 8 * E * (ep - 1) / ep
    else:
        per_layer = (ep - 1) * N * (16 * H + 8 * E + E)
    return per_layer * model["num_layers"]


FOLDINGS = {
    # world -> (unfolded: experts split over the TP ranks as the dense MLP, folded: whole experts, EP over TP ranks)
    2: (dict(expert_model_parallel_size=1), dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
    4: (dict(expert_model_parallel_size=2), dict(expert_model_parallel_size=4, expert_tensor_parallel_size=1)),
}
TENSOR_PARALLEL = dict(tensor_model_parallel_size=2, sequence_parallel=True, moe_token_dispatcher_type="alltoall")


def folding(args: argparse.Namespace, world: int, folder: Path) -> dict[str, Any]:
    """The folded layout against the unfolded one at TP 2 on `world` processes."""
    unfolded, folded = (_run(args, world, dict(TENSOR_PARALLEL, **f), folder, f"w{world}-{n}")
                        for f, n in zip(FOLDINGS[world], ("unfolded", "folded")))  # fmt: skip
    folded["ratio_vs_unfolded"] = folded["tokens_per_s"] / unfolded["tokens_per_s"]
    return {"unfolded": unfolded, "folded": folded}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, seq=32, batch=2, steps=2, warmup=1, worlds=[2])
    model = model_settings(args.smoke)
    results: dict[str, Any] = {"settings": {**vars(args), "output": None, **model}, "torch": torch.__version__}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            base = _run(args, world, {}, Path(tmp), f"w{world}-ep1")
            results[f"world{world}"] = {"ep1": base}
            for dispatcher in ("alltoall", "allgather"):
                layout = dict(expert_model_parallel_size=world, moe_token_dispatcher_type=dispatcher)
                ours = _run(args, world, layout, Path(tmp), f"w{world}-ep{world}-{dispatcher}")
                ours["ratio_vs_ep1"] = ours["tokens_per_s"] / base["tokens_per_s"]
                ours["formula_bytes"] = formula(args, world, dispatcher)
                ours["measured_over_formula"] = ours["bytes_per_step_per_rank"] / ours["formula_bytes"]
                results[f"world{world}"][dispatcher] = ours
                rows.append((world, dispatcher, ours, base))
            results[f"world{world}"]["folding"] = folding(args, world, Path(tmp))
    results["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        "| world | EP | dispatcher | tokens/s | EP 1 tokens/s | ratio "
        "| MB sent per rank and step | formula | measured / formula |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world, dispatcher, ours, base in rows:
        print(
            f"| {world} | {world} | {dispatcher} | {ours['tokens_per_s']:,.0f} | {base['tokens_per_s']:,.0f} | "
            f"**{ours['ratio_vs_ep1']:.2f}** | {ours['bytes_per_step_per_rank'] / 1e6:.2f} | "
            f"{ours['formula_bytes'] / 1e6:.2f} | {ours['measured_over_formula']:.3f} |"
        )
    print("\n| world | unfolded (TP 2, expert TP 2) | tokens/s | folded (TP 2, expert TP 1) | tokens/s | ratio "
          "| MB sent per rank and step, unfolded / folded |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        pair = results[f"world{world}"]["folding"]
        plain, fold = pair["unfolded"], pair["folded"]
        ep_plain, ep_fold = (f["expert_model_parallel_size"] for f in FOLDINGS[world])
        print(
            f"| {world} | EP {ep_plain} | {plain['tokens_per_s']:,.0f} | EP {ep_fold} | {fold['tokens_per_s']:,.0f} | "
            f"**{fold['ratio_vs_unfolded']:.2f}** | {plain['bytes_per_step_per_rank'] / 1e6:.2f} / "
            f"{fold['bytes_per_step_per_rank'] / 1e6:.2f} |"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
