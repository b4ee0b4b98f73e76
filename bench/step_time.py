"""Training-step time: paratron's loop against a plain hand-written PyTorch loop, side by side.

Both train the same model (paratron's GPT, same seed) with the same AdamW settings, the
same gradient clipping, the same learning-rate schedule and the same synthetic samples,
in one process. Rounds alternate (paratron, plain, paratron, ...) so drift in the
machine's speed hits both; the reported time is the median over rounds.

    python bench/step_time.py                 # defaults below, fp32 on CPU
    python bench/step_time.py --steps 20 --rounds 5 --hidden-size 512
    python bench/step_time.py --smoke         # tiny: does it still run?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import NO_DROPOUT, add_smoke_argument, apply_smoke
from paratron.config import Config, build_config, resolve_layout
from paratron.data.build import build_data
from paratron.distributed.init import initialize
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.gpt import GPT, build_model
from paratron.optim import build_optimizer, parameter_groups
from paratron.optim.lr_schedule import LRSchedule
from paratron.parallel.parallelize import parallelize
from paratron.training.flops import training_flops_per_token
from paratron.training.loop import Trainer
from paratron.training.metrics import MetricsWriter


def paratron_round(config, ctx, warmup: int, steps: int) -> float:
    topology = Topology(ParallelDims(1))
    with torch.device("meta"):
        meta = GPT(config.model)
    layout = resolve_layout(config, 1)
    model = parallelize(meta, config, topology, ctx.device, layout)
    optimizer = build_optimizer(model, config.optimizer)
    data = build_data(config, layout.global_batch_size)
    trainer = Trainer(
        config,
        ctx,
        topology,
        layout,
        model,
        optimizer,
        data,
        MetricsWriter.disabled(),
        training_flops_per_token(config.model, config.data.seq_length),
        peak_flops=1.0,
    )
    trainer.fit(stop_after=warmup)
    start = time.perf_counter()
    trainer.fit(stop_after=warmup + steps)
    return (time.perf_counter() - start) / steps


def plain_round(config, ctx, warmup: int, steps: int) -> float:
    """What a user would write by hand around the same model."""
    t, o = config.training, config.optimizer
    model = build_model(config.model, ctx.device, seed=t.seed)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps
    )
    batch = t.micro_batch_size
    samples = build_data(config, batch).train
    schedule = LRSchedule.of(config, batch)

    def step(i: int) -> None:
        schedule.apply(optimizer.param_groups, i * batch)
        tokens = torch.from_numpy(np.stack([samples[k] for k in range(i * batch, (i + 1) * batch)])).to(ctx.device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a hand-written loop looks at its loss too

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    return (time.perf_counter() - start) / steps


SMOKE = dict(
    steps=2, warmup=1, rounds=1, num_layers=2, hidden_size=64, seq_length=32, micro_batch_size=2, vocab_size=256
)
"""--smoke: a model of seconds."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's rounds and model, shared with bench/megatron_step.py."""
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def bench_config(args: argparse.Namespace) -> Config:
    """A GPT-2-style model on synthetic tokens, fp32, without dropout, evaluation or logging."""
    return build_config(
        dict(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.hidden_size // 64,
            vocab_size=args.vocab_size,
            seq_length=args.seq_length,
            max_position_embeddings=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            mock_data=True,
            train_iters=1000,
            lr=3e-4,
            lr_warmup_iters=10,
            lr_decay_iters=1000,
            **NO_DROPOUT,
            log_interval=10**9,
            eval_iters=0,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, **SMOKE)
    config = bench_config(args)
    # (the rounds stop early, after warmup + steps; both loops follow this one schedule)
    ctx = initialize()
    times: dict[str, list[float]] = {"paratron": [], "plain": []}
    for _ in range(args.rounds):
        times["paratron"].append(paratron_round(config, ctx, args.warmup, args.steps))
        times["plain"].append(plain_round(config, ctx, args.warmup, args.steps))
    paratron_s, plain_s = statistics.median(times["paratron"]), statistics.median(times["plain"])
    tokens = args.micro_batch_size * args.seq_length
    result = {
        "model": f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
        f"micro-batch {args.micro_batch_size}, vocab {args.vocab_size}, fp32",
        "threads": torch.get_num_threads(),
        "paratron_ms_per_step": 1000 * paratron_s,
        "plain_ms_per_step": 1000 * plain_s,
        "ratio": paratron_s / plain_s,
        "paratron_tokens_per_s": tokens / paratron_s,
        "rounds": times,
    }
    print(f"model: {result['model']} on {ctx.device.type} with {result['threads']} threads")
    print(f"paratron   {1000 * paratron_s:8.1f} ms/step  ({tokens / paratron_s:,.0f} tok/s)")
    print(f"plain loop {1000 * plain_s:8.1f} ms/step  ({tokens / plain_s:,.0f} tok/s)")
    print(
        f"ratio paratron / plain = {result['ratio']:.3f}  (median of {args.rounds} alternating rounds "
        f"of {args.steps} steps)"
    )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
