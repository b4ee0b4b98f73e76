"""Evaluation on lm-evaluation-harness tasks: paratron's in-process model (`paratron evaluate --tasks`, the engine
scoring prompts with continuous batching) against the harness' own `hf` model, one process.

Both score the same multiple-choice task (a local YAML task over a jsonl file: a context of a few sentences, four
continuations) on the same Llama-shaped model (a random Hugging Face Llama converted for paratron, so both read the
same weights), fp32, on CPU threads. Each side is timed around `lm_eval.simple_evaluate` (the task built, every
loglikelihood request answered, the metrics computed), after a warm-up run on a few documents; the sides take turns
for `--rounds` runs each and the best run of each counts (a machine shared with other work slows some runs; the CPU
seconds the process spent are recorded too). Requests per second count the harness' loglikelihood requests
(documents x choices). The two sides must agree: the same accuracy, and each request's log-likelihood within 1e-4.

    python bench/harness.py --output bench/results/harness.json
    python bench/harness.py --smoke  # tiny model, a few documents
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from common import RESULTS, add_smoke_argument, apply_smoke
from llama_common import save_random_llama
from paratron.checkpoint import load_pretrained
from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf
from paratron.config.inference import InferenceConfig
from paratron.data.corpus import stdlib_files
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.inference.harness import ParatronLM
from paratron.inference.loading import engine_for_model
from paratron.inference.tasks import task_manager

TASK = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def words(limit: int) -> list[str]:
    """Words of the Python standard library's sources: text with a real spread of word lengths."""
    found: list[str] = []
    for path in sorted(stdlib_files()):
        found += Path(path).read_text(encoding="utf-8", errors="replace").split()
        if len(found) >= limit:
            break
    return found[:limit]


def prepare(folder: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The task folder, a paratron checkpoint and the Hugging Face folder `paratron convert --to hf` writes."""
    vocabulary = words(200_000)
    rng = random.Random(0)

    def text(n: int) -> str:
        start = rng.randrange(len(vocabulary) - n)
        return " ".join(vocabulary[start : start + n])

    tasks = folder / "tasks"
    tasks.mkdir()
    rows = [
        {"context": text(args.context_words), "choices": [text(args.choice_words) for _ in range(4)], "label": i % 4}
        for i in range(args.docs)
    ]
    (tasks / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tasks / "bench_choice.yaml").write_text(TASK.format(data=tasks / "choice.jsonl"), encoding="utf-8")
    tokenizer = train_byte_level_bpe(iter([text(200) for _ in range(500)]), args.vocab)
    made = folder / "made"
    made.mkdir()
    tokenizer.save(made / "tokenizer.json")
    (made / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8")
    save_random_llama(made, args, tokenizer.vocab_size, args.seq_length, args.kv_heads)
    checkpoint = hf_to_paratron(made, folder / "paratron")
    return tasks, checkpoint, paratron_to_hf(checkpoint, folder / "hf")


def timed(model: Any, tasks: Path, limit: int | None) -> tuple[float, dict[str, Any]]:
    """Seconds of one `simple_evaluate` of the task on `model`, and its results (with the samples and the CPU
    seconds the process spent, all threads together, as "cpu_s")."""
    manager = task_manager(["bench_choice"], tasks, ("--tasks", "--include-path"))
    start, cpu = time.perf_counter(), time.process_time()
    results = simple_evaluate(
        model=model, tasks=["bench_choice"], task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=True
    )
    results["cpu_s"] = time.process_time() - cpu
    return time.perf_counter() - start, results


def measure(models: dict[str, Any], tasks: Path, rounds: int) -> dict[str, dict[str, Any]]:
    """Each model's best of `rounds` timed runs, the sides taking turns (a machine shared with other work slows
    some runs: the best is the least disturbed), after one warm-up run each on a few documents."""
    for model in models.values():
        timed(model, tasks, 4)
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for _ in range(rounds):
        for name, model in models.items():
            seconds, results = timed(model, tasks, None)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, results)
    return {name: summary(name, seconds, results) for name, (seconds, results) in best.items()}


def summary(name: str, seconds: float, results: dict[str, Any]) -> dict[str, Any]:
    samples = sorted(results["samples"]["bench_choice"], key=lambda s: s["doc_id"])
    requests = sum(len(s["resps"]) for s in samples)
    cpu = results["cpu_s"]
    print(
        f"{name:9} {requests / seconds:8.1f} loglikelihood requests/s ({requests} in {seconds:.2f} s, "
        f"{cpu:.2f} s of CPU)"
    )
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "requests": requests,
        "requests_per_s": requests / seconds,
        "acc": results["results"]["bench_choice"]["acc,none"],
        "loglikelihoods": [r[0][0] for s in samples for r in s["resps"]],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=40, help="Documents of the task (four requests each).")
    parser.add_argument("--rounds", type=int, default=3, help="Timed runs of each side (the best counts).")
    parser.add_argument("--context-words", type=int, default=80)
    parser.add_argument("--choice-words", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=1536)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=32, help="The hf model's requests per forward pass.")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="The engine's tokens per step.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "harness.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(docs=6, context_words=12, choice_words=3, vocab=300, hidden_size=64, ffn_hidden_size=128)
    apply_smoke(args, parser, **tiny, num_layers=2, heads=4, kv_heads=2, seq_length=128, hf_batch_size=8, rounds=1)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"settings": vars(args) | {"output": args.output.name}}
    with tempfile.TemporaryDirectory() as tmp:
        tasks, checkpoint, hf = prepare(Path(tmp), args)
        settings = InferenceConfig(max_batch_tokens=args.max_batch_tokens)
        model, tokenizer = load_pretrained(checkpoint), Tokenizer.from_file(checkpoint)
        engine = engine_for_model(model, tokenizer, settings, owns_model=True)
        hf_model = HFLM(pretrained=str(hf), max_length=args.seq_length - 1, batch_size=args.hf_batch_size, device="cpu")
        sides = measure({"paratron": ParatronLM(engine), "hf": hf_model}, tasks, args.rounds)
    ours, theirs = sides["paratron"], sides["hf"]
    gap = max(abs(a - b) for a, b in zip(ours.pop("loglikelihoods"), theirs.pop("loglikelihoods")))
    assert gap < 1e-4 and ours["acc"] == theirs["acc"], f"the two sides part: {gap:.2e}, {ours['acc']} {theirs['acc']}"
    result.update(paratron=ours, hf=theirs, max_loglikelihood_difference=gap)
    result["ratio"] = ours["requests_per_s"] / theirs["requests_per_s"]
    print(f"ratio (paratron / hf): {result['ratio']:.2f}; largest log-likelihood difference {gap:.1e}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
