"""Serving throughput and latency: `paratron serve` under 1, 4, 8, 16 and 64 concurrent streaming clients.

One server process serves a random Llama-shaped model (fp32, big enough that its compute, not HTTP, sets the pace
on a CPU) from a Hugging Face folder. The same requests (prompts cut from the Python standard library's sources,
greedy, a fixed number of new tokens each: `ignore_eos`) are sent by C clients at a time, each streaming its answer
(server-sent events, one chunk per token: `logprobs: 0`): C = 1 is the requests sent one at a time, the baseline.
Reported per C: generated tokens per second over the whole run, time to first token and time between tokens (p50,
p99), and the throughput against one at a time; the greedy texts must be the same at every C (continuous batching
changes when a request runs, not what it gets).

    python bench/serve.py --output bench/results/serve.json
    python bench/serve.py --smoke  # a tiny model, 8 requests, a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import torch

from common import RESULTS, add_smoke_argument, apply_smoke
from llama_common import save_random_llama
from paratron.data.corpus import stdlib_files
from paratron.data.tokenizer import train_byte_level_bpe

READY = re.compile(r"serving \S+ on (http://\S+) ")


def corpus(limit: int) -> list[str]:
    texts = []
    for path in sorted(stdlib_files())[:limit]:
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def model_folder(folder: Path, args: argparse.Namespace) -> tuple[list[list[int]], int]:
    """A random Llama with a byte-level BPE tokenizer of the standard library, saved in `folder`; the prompts'
    token ids (each --prompt-tokens long, cut from different sources) and the model's parameter count."""
    texts = corpus(200)
    tokenizer = train_byte_level_bpe(iter(texts), args.vocab)
    folder.mkdir(parents=True)
    tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    positions = args.prompt_tokens + args.max_tokens + 16
    model = save_random_llama(
        folder, args, tokenizer.vocab_size, positions, args.heads // 2, bos_token_id=None, eos_token_id=tokenizer.eod_id
    )
    parameters = sum(p.numel() for p in model.parameters())
    prompts = []
    for text in texts[: 4 * args.requests]:
        ids = tokenizer.encode(text)
        if len(ids) >= 2 * args.prompt_tokens:
            prompts.append(ids[args.prompt_tokens : 2 * args.prompt_tokens])
        if len(prompts) == args.requests:
            return prompts, parameters
    raise SystemExit(f"the standard library gave {len(prompts)} prompts of {args.prompt_tokens} tokens; ask for fewer")


def start_server(folder: Path, logs: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """`paratron serve` on a free port; its process and address once it listens."""
    command = [sys.executable, "-m", "paratron", "serve", "--load", str(folder), "--port", "0"]
    command += ["--served-model-name", "bench", "--max-running-requests", "64"]
    out, err = open(logs / "stdout.txt", "w"), open(logs / "stderr.txt", "w")
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, stdout=out, stderr=err, env=environment)
    deadline = time.monotonic() + 300
    while not (found := READY.search((logs / "stdout.txt").read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start: {(logs / 'stderr.txt').read_text()[-2000:]}")
        time.sleep(0.2)
    return process, found.group(1)


def one_stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion: its text, when its first token came and the gaps between the next ones."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["logprobs"] = 0  # (a chunk for every token, even one whose text is not final yet)
    start = time.perf_counter()
    arrivals, text = [], []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            now = time.perf_counter()
            arrivals += [now] * len(choice["logprobs"]["tokens"])
            text.append(choice["text"])
    assert len(arrivals) == max_tokens, (len(arrivals), max_tokens)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"text": "".join(text), "first": arrivals[0] - start, "gaps": gaps, "tokens": len(arrivals)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_clients(url: str, prompts: list[list[int]], max_tokens: int, clients: int) -> dict[str, Any]:
    """All prompts, `clients` at a time; throughput and latencies."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        streams = list(pool.map(lambda p: one_stream(url, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    firsts = [s["first"] * 1e3 for s in streams]
    gaps = [g * 1e3 for s in streams for g in s["gaps"]]
    tokens = sum(s["tokens"] for s in streams)
    return {
        "clients": clients,
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "first_token_ms": {"p50": round(statistics.median(firsts), 1), "p99": round(percentile(firsts, 99), 1)},
        "between_tokens_ms": {"p50": round(statistics.median(gaps), 2), "p99": round(percentile(gaps, 99), 2)},
        "texts": [s["text"] for s in streams],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="paratron-bench-serve-") as tmp:
        folder = Path(tmp) / "model"
        prompts, parameters = model_folder(folder, args)
        process, url = start_server(folder, Path(tmp), args.threads)
        try:
            one_stream(url, prompts[0], 4)  # (warm-up)
            runs = [run_clients(url, prompts, args.max_tokens, clients) for clients in args.clients]
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=120)
        assert code == 0, f"the server exited with {code}"
    baseline, baseline_texts = runs[0], runs[0]["texts"]
    for run in runs:
        assert run.pop("texts") == baseline_texts, f"{run['clients']} clients got other greedy texts than 1"
        run["throughput_vs_one_at_a_time"] = round(run["tokens_per_s"] / baseline["tokens_per_s"], 2)
    model = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "heads", "vocab")}
    return {
        "model": {**model, "precision": "fp32", "parameters": parameters},
        "requests": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "server_threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=64, help="Requests in each run (default: 64).")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64, help="New tokens per request (default: 64).")
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1, 4, 8, 16, 64], help="Concurrent clients of each run."
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="The server's compute threads (default: 1, the clients run on the same machine and take the others).",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "serve.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, heads=4, vocab=600, requests=8)
    apply_smoke(args, parser, **tiny, prompt_tokens=32, max_tokens=8, clients=[1, 8], threads=1)
    result = measure(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for run in result["runs"]:
        print(
            f"{run['clients']:>3} clients: {run['tokens_per_s']:>8.1f} tokens/s "
            f"(x{run['throughput_vs_one_at_a_time']:.2f}), first token p50 {run['first_token_ms']['p50']} ms "
            f"p99 {run['first_token_ms']['p99']} ms, between tokens p50 {run['between_tokens_ms']['p50']} ms "
            f"p99 {run['between_tokens_ms']['p99']} ms"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
