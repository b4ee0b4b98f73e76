"""Training-step time: paratron's loop against megatron-core's GPTModel, one process, fp32 on CPU.

The peer a Megatron-LM user would otherwise keep is Megatron-LM itself; its training loop needs
CUDA, so the comparison is its model: megatron-core 0.16.1's GPTModel (local layer spec, fusions
off, CUDA calls redirected to the CPU as in the tests, tests/megatron_oracle.py) trained by a plain
loop with torch's AdamW (foreach) and gradient clipping, against `paratron train`'s loop on the same
GPT-2-style model, samples and settings. Rounds alternate so that drift hits both; the median
round is reported.

    python bench/megatron_step.py
    python bench/megatron_step.py --hidden-size 512 --rounds 5
    python bench/megatron_step.py --smoke  # tiny: does megatron-core still build and train beside it?
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from common import add_smoke_argument, apply_smoke, test_helper
from paratron.data.build import build_data
from paratron.distributed.init import initialize
from step_time import SMOKE, add_model_arguments, bench_config, paratron_round

oracle = test_helper("megatron_oracle")  # the megatron-core builder the tests use


def megatron_round(config, warmup: int, steps: int) -> float:
    """megatron-core's GPTModel with a hand-written loop: the same samples, AdamW and clipping."""
    m, t, o = config.model, config.training, config.optimizer
    with oracle.cpu_megatron():
        model, _ = oracle.oracle_gpt(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size,
            vocab_size=m.vocab_size,
            max_sequence_length=m.max_position_embeddings,
            init_method_std=m.init_method_std,
            seed=t.seed,
        )
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True
        )
        batch = t.micro_batch_size
        samples = build_data(config, batch).train
        seq = config.data.seq_length
        positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)

        def step(i: int) -> None:
            tokens = torch.from_numpy(np.stack([samples[k] for k in range(i * batch, (i + 1) * batch)]))
            losses = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:])
            loss = losses.float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()

        for i in range(warmup):
            step(i)
        start = time.perf_counter()
        for i in range(warmup, warmup + steps):
            step(i)
        elapsed = (time.perf_counter() - start) / steps
        oracle.destroy_oracle()
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    add_smoke_argument(parser)
    parser.set_defaults(steps=10, rounds=3)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, **SMOKE)
    config = bench_config(args)
    ctx = initialize()
    times: dict[str, list[float]] = {"paratron": [], "megatron_core": []}
    for _ in range(args.rounds):
        times["paratron"].append(paratron_round(config, ctx, args.warmup, args.steps))
        times["megatron_core"].append(megatron_round(config, args.warmup, args.steps))
    paratron_s, megatron_s = statistics.median(times["paratron"]), statistics.median(times["megatron_core"])
    result = {
        "model": f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
        f"micro-batch {args.micro_batch_size}, vocab {args.vocab_size}, fp32",
        "threads": torch.get_num_threads(),
        "paratron_ms_per_step": 1000 * paratron_s,
        "megatron_core_ms_per_step": 1000 * megatron_s,
        "ratio": paratron_s / megatron_s,
        "rounds": times,
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
