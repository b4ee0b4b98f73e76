"""Generation throughput: paratron's inference engine against transformers' `generate`, one process.

Both continue the same prompts with the same model: a random Hugging Face Llama (saved by transformers, converted
for paratron), fp32, greedy, every prompt of the same length and every completion of the same number of new tokens
(end tokens ignored), at batch 1 and batch 16 (all prompts at once: transformers as one batch, which needs no
padding; paratron as 16 requests the engine batches itself). Throughput counts generated tokens per second of a
whole run (prefill and decode), each side's best of `--rounds` runs after one warm-up; the ratio is the median of
the rounds' paired ratios (the sides run in turn, so that the shared machine's busy spells weigh on both). The greedy
outputs of the two sides are compared token by token.

    python bench/generate.py --output bench/results/generate.json
    python bench/generate.py --profile      # also: where each side spends its time (cProfile)
    python bench/generate.py --smoke        # tiny model, one round
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from common import RESULTS, SEED, add_smoke_argument, apply_smoke
from llama_common import save_random_llama
from paratron.checkpoint.formats import hf_to_paratron
from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config.inference import InferenceConfig
from paratron.inference.engine import Engine
from paratron.inference.loading import engine_for_model
from paratron.inference.params import SamplingParams


def build_models(folder: Path, args: argparse.Namespace) -> tuple[transformers.PreTrainedModel, Engine]:
    """The random Llama in transformers and, converted, in paratron's engine (KV cache for every sequence)."""
    positions = args.prompt_tokens + args.new_tokens
    save_random_llama(folder / "hf", args, args.vocab, positions, args.kv_heads, seed=SEED)
    hf_to_paratron(folder / "hf", folder / "paratron")
    reference = transformers.LlamaForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32).eval()
    model = model_from_checkpoint(read_checkpoint(folder / "paratron"), torch.device("cpu")).eval()
    batch = max(args.batches)
    settings = InferenceConfig(
        kv_cache_tokens=batch * (args.prompt_tokens + args.new_tokens + 16),
        max_running_requests=batch,
        max_batch_tokens=max(2048, batch * args.prompt_tokens),
    )
    return reference, engine_for_model(model, None, settings, owns_model=True)


def transformers_side(model: transformers.PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, prompts.size(1) :].tolist()


def paratron_side(engine: Engine, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outputs = engine.generate(prompts.tolist(), params)
    return [output.completions[0].token_ids for output in outputs]


def paired(runs: dict[str, Any], rounds: int) -> tuple[dict[str, list[float]], float, dict[str, list[list[int]]]]:
    """Each side once to warm up, then `rounds` rounds of each side in turn (so that a busy spell of the machine
    weighs on both): the seconds of each side's rounds, the median of the rounds' ratios (peer / paratron, above 1:
    paratron faster), and the tokens of each side's last run."""
    tokens = {name: run() for name, run in runs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            seconds[name].append(time.perf_counter() - start)
    ratios = [peer / ours for peer, ours in zip(seconds["transformers"], seconds["paratron"])]
    return seconds, statistics.median(ratios), tokens


def compare(reference: Any, engine: Engine, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both sides on `batch` prompts: tokens/s, the ratio, and whether the greedy tokens agree."""
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=generator)
    runs = {
        "transformers": lambda: transformers_side(reference, prompts, args.new_tokens),
        "paratron": lambda: paratron_side(engine, prompts, args.new_tokens),
    }
    rounds, ratio, tokens = paired(runs, args.rounds)
    seconds = {name: min(s) for name, s in rounds.items()}  # (the least disturbed round of each side)
    ours, theirs = tokens["paratron"], tokens["transformers"]
    generated = batch * args.new_tokens
    parting = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, theirs)]
    return {
        "batch": batch,
        "paratron_tokens_per_s": generated / seconds["paratron"],
        "transformers_tokens_per_s": generated / seconds["transformers"],
        "ratio": ratio,
        "ratio_of_best_rounds": seconds["transformers"] / seconds["paratron"],
        "paratron_rounds_s": rounds["paratron"],
        "transformers_rounds_s": rounds["transformers"],
        "identical_sequences": sum(a == b for a, b in zip(ours, theirs)),
        "first_parting_token": [i for i in parting if i is not None],
    }


def profile(run: Any, rows: int = 15) -> str:
    """cProfile of one run (after a warm-up): the functions that take the most time of their own."""
    run()
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def profiles(reference: Any, engine: Engine, args: argparse.Namespace) -> str:
    """Where each side's time goes at batch 1 and at the largest batch."""
    out = []
    for batch in sorted({1, max(args.batches)}):
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
        ours = profile(lambda p=prompts: paratron_side(engine, p, args.new_tokens))
        theirs = profile(lambda p=prompts: transformers_side(reference, p, args.new_tokens))
        out += [f"== paratron, batch {batch}\n{ours}", f"== transformers, batch {batch}\n{theirs}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=1536)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="Also print where the engine's time goes.")
    parser.add_argument("--output", type=Path, default=RESULTS / "generate.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(vocab=256, hidden_size=64, ffn_hidden_size=128, num_layers=2, heads=4, kv_heads=2)
    apply_smoke(args, parser, **tiny, prompt_tokens=16, new_tokens=8, batches=[1, 4], rounds=1)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        reference, engine = build_models(Path(tmp), args)
        results = [compare(reference, engine, batch, args) for batch in args.batches]
        report = profiles(reference, engine, args) if args.profile else None
    for r in results:
        print(
            f"batch {r['batch']:3}: paratron {r['paratron_tokens_per_s']:8,.1f} tokens/s, transformers "
            f"{r['transformers_tokens_per_s']:8,.1f} tokens/s (best rounds), ratio {r['ratio']:.2f}x (median of paired "
            f"rounds; of the best rounds {r['ratio_of_best_rounds']:.2f}x); greedy tokens identical in "
            f"{r['identical_sequences']}/{r['batch']} sequences"
        )
    if args.smoke:  # (a tiny model's logits are far apart: any parting is a bug)
        assert all(r["identical_sequences"] == r["batch"] for r in results), results
    if report is not None:
        print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "smoke", "profile")}
    args.output.write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
