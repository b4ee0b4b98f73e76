"""Mixture of experts, one process: paratron's MoE layer against transformers' Mixtral block, and a
whole MoE model's training step against a dense model with the same active parameters.

    python bench/moe.py --output bench/results/moe.json
    python bench/moe.py --smoke  # tiny: does it still run and match Mixtral's block?

1. Layer: forward + backward of `model.moe.MoELayer` (loop over experts, and `--moe-grouped-gemm`)
   and of `transformers.MixtralSparseMoeBlock` with the same weights (so the same routing), on
   the same tokens; median over rounds, alternating sides.
2. Model: steps of paratron's trainer on mock data for a Mixtral-shaped MoE model and for the
   dense model whose MLP is as wide as top-k experts (the same active parameters), median step
   time after warm-up.
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
import transformers

from common import LLAMA_STYLE, NO_DROPOUT, add_smoke_argument, apply_smoke
from paratron.config import build_config
from paratron.config.schema import ModelConfig
from paratron.model.moe import MoELayer
from paratron.training.run import run_training


def layer_pair(args: argparse.Namespace, grouped: bool) -> tuple[MoELayer, torch.nn.Module]:
    config = ModelConfig(
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        activation="swiglu",
        add_bias_linear=False,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_grouped_gemm=grouped,
        **NO_DROPOUT,
    )
    ours = MoELayer(config)
    hf_config = transformers.MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_local_experts=args.experts,
        num_experts_per_tok=args.topk,
    )
    theirs = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.05)
        ours.router.weight.copy_(theirs.gate.weight)
        experts = theirs.experts
        ours.experts.w_in.copy_(experts.gate_up_proj)  # [E, 2F, H]: gate rows, then up rows
        ours.experts.w_out.copy_(experts.down_proj)  # [E, H, F]
    return ours, theirs


def time_layer(module: torch.nn.Module, x: torch.Tensor, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        inputs = x.detach().requires_grad_()
        start = time.perf_counter()
        out = module(inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def layer_bench(args: argparse.Namespace) -> dict[str, Any]:
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    result = {}
    for grouped in (False, True):
        ours, theirs = layer_pair(args, grouped)
        with torch.no_grad():
            ours_out, theirs_out = ours(x), theirs(x)
            theirs_out = theirs_out[0] if isinstance(theirs_out, tuple) else theirs_out
        difference = float((ours_out - theirs_out).abs().max())
        ours_s, theirs_s = [], []
        for _ in range(args.rounds):  # alternate, so drift hits both
            ours_s.append(time_layer(ours, x, 3))
            theirs_s.append(time_layer(theirs, x, 3))
        name = "grouped" if grouped else "loop"
        result[name] = {
            "paratron_s": statistics.median(ours_s),
            "transformers_s": statistics.median(theirs_s),
            "ratio": statistics.median(ours_s) / statistics.median(theirs_s),
            "max_output_difference": difference,
        }
    return result


def model_step(args: argparse.Namespace, folder: Path, name: str, **model: Any) -> float:
    settings = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        **LLAMA_STYLE,
        vocab_size=4096,
        **NO_DROPOUT,
        mock_data=True,
        seq_length=args.seq,
        micro_batch_size=args.batch,
        train_iters=args.steps + 2,
        lr=1e-4,
        eval_iters=0,
        run_dir=str(folder / name),
        log_interval=1,
        progress_bar=False,
        tensorboard=False,
    )
    run_training(build_config({**settings, **model}))
    records = [json.loads(line) for line in open(folder / name / "metrics.jsonl")][2:]
    return statistics.median(args.batch * args.seq / r["tokens_per_s"] for r in records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(hidden=64, ffn=128, experts=4, batch=2, seq=32, layers=2, rounds=1, steps=1)
    apply_smoke(args, parser, **tiny)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "layer": layer_bench(args)}
    with tempfile.TemporaryDirectory() as tmp:
        moe = dict(
            ffn_hidden_size=args.ffn, num_experts=args.experts, moe_router_topk=args.topk, moe_aux_loss_coeff=1e-2
        )
        dense = dict(ffn_hidden_size=args.ffn * args.topk)  # the same active parameters
        result["model"] = {
            "moe_step_s": model_step(args, Path(tmp), "moe", **moe),
            "dense_step_s": model_step(args, Path(tmp), "dense", **dense),
        }
    result["model"]["ratio"] = result["model"]["moe_step_s"] / result["model"]["dense_step_s"]
    if args.smoke:
        differences = {k: v["max_output_difference"] for k, v in result["layer"].items()}
        assert all(d < 1e-5 for d in differences.values()), f"paratron's MoE layer and Mixtral's part: {differences}"
    print(json.dumps({"layer": result["layer"], "model": result["model"]}, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
