"""`paratron inspect A --diff B` against the plainest comparison a user might write: both weight files read with
`safetensors.torch.load_file` and `(a[n] - b[n]).abs().max()` over every tensor.

    .venv/bin/python bench/inspect_checkpoint.py  # GPT-2-small shape: 124M parameters, 475 MiB per file
    .venv/bin/python bench/inspect_checkpoint.py --layers 6 --hidden-size 512 --vocab-size 32768 --rounds 3
    .venv/bin/python bench/inspect_checkpoint.py --profile  # also cProfile one in-process --diff (top 15 by time)
    .venv/bin/python bench/inspect_checkpoint.py --smoke  # tiny: do both sides still run and agree?

The benchmark writes its own two checkpoints: a GPT of the given shape built as training builds it (on the meta
device, then `parallelize` at one process), saved by `save_checkpoint` at iteration 100 (A), then every weight
moved by N(0, 1e-4) and saved again at iteration 200 (B); fp32, one process, one `model.safetensors` each.

Each command runs in a fresh interpreter, as a user starts it, rounds alternating between them:

- `paratron inspect A --diff B --json` (the files of both checked against their recorded sha256 in a second
  thread while every pair of tensors is compared);
- the same with `--no-verify`;
- with `--baseline-source DIR`, the first command again with paratron imported from DIR (another version);
- the peer: `load_file` of both weight files, max |a - b| per tensor; and again on one thread (OMP_NUM_THREADS=1,
  as `inspect --diff` compares);
- `paratron inspect A --tensors none --no-verify`: what every `paratron inspect` pays before its first tensor
  (starting Python, importing torch and paratron, reading meta.json), and the peer's own start-up
  (`import torch, safetensors.torch`).

Under --smoke, the first command and the peer alone.

Measured: wall time, CPU time (user + system, all threads: steadier than wall time on a shared machine), peak
resident memory (VmHWM) and the peaks of its anonymous and file-backed parts
(/proc/PID/status polled every 10 ms). Both sides' largest differences must agree (max abs per tensor, to float32
rounding). Reported: medians, and paratron's diff over the peer as a ratio. Writes bench/results/inspect.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import torch

from common import RESULTS, ROOT, add_smoke_argument, apply_smoke
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.debugging.inspect import run_inspect
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.gpt import GPT
from paratron.parallel import parallelize
from paratron.storage import write_text_atomic

PEER = """
import json, sys
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
print(json.dumps({n: float((a[n] - b[n]).abs().max()) for n in sorted(a)}))
"""
"""The plain comparison: both files whole, one max |a - b| per tensor."""

PERTURBATION = 1e-4


def write_checkpoints(args: argparse.Namespace, work: Path) -> tuple[Path, Path, int]:
    """A (iteration 100) and B (iteration 200, every weight moved by N(0, 1e-4)); and the parameter count."""
    config = build_config(
        dict(
            num_layers=args.layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.heads,
            vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=1,
            seq_length=args.seq_length,
            max_position_embeddings=args.seq_length,
            mock_data=True,
            seed=1,
        )
    )
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1)).module
    save_checkpoint(work / "a", CheckpointContent(100, 800, config, model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * PERTURBATION)
    save_checkpoint(work / "b", CheckpointContent(200, 1600, config, model))
    os.sync()  # (the files' write-back would otherwise run during the first rounds)
    return work / "a" / "iter_0000100", work / "b" / "iter_0000200", sum(p.numel() for p in model.parameters())


def _kib(status: str, field: str) -> int:
    found = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(found.group(1)) if found else 0


def timed(command: list[str], source: Path = ROOT / "src", **environment: str) -> dict[str, Any]:
    """Run `command` with paratron imported from `source` (and `environment` set); its wall time, CPU time, peak
    memory (MiB) and standard output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]))
    env.update(environment)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        peaks = _poll_memory(child.pid)
        _, status, usage = os.wait4(child.pid, 0)  # (its own CPU time: steadier than wall time on a busy machine)
        seconds = time.perf_counter() - started
        child.returncode = code = os.waitstatus_to_exitcode(status)
        peaks["done"].set()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(command)} failed ({code}): {stderr[-2000:]}")
    return {
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_mib": peaks["peak"] / 1024,
        "anonymous_mib": peaks["anonymous"] / 1024,
        "file_mib": peaks["file"] / 1024,
        "code": code,
        "stdout": stdout,
    }


def _poll_memory(pid: int) -> dict[str, Any]:
    """Start polling /proc/PID/status (VmHWM, the peak of RssAnon and of RssFile, KiB) until the returned "done"
    event is set. (Not ru_maxrss: a forked child keeps its parent's until it execs, and the parent holds torch.)"""
    peaks: dict[str, Any] = {"peak": 0, "anonymous": 0, "file": 0, "done": threading.Event()}

    def poll() -> None:
        status_file = Path(f"/proc/{pid}/status")
        while not peaks["done"].is_set():
            try:
                status = status_file.read_text()
            except OSError:
                return
            peaks["peak"] = max(peaks["peak"], _kib(status, "VmHWM"))
            peaks["anonymous"] = max(peaks["anonymous"], _kib(status, "RssAnon"))
            peaks["file"] = max(peaks["file"], _kib(status, "RssFile"))
            peaks["done"].wait(0.01)

    threading.Thread(target=poll, daemon=True).start()
    return peaks


def commands(a: Path, b: Path, args: argparse.Namespace) -> dict[str, tuple[list[str], Path, dict[str, str]]]:
    """Each command line (a fresh interpreter each), the paratron sources it imports and the environment it adds;
    under --smoke, the two sides alone."""
    paratron = [sys.executable, "-m", "paratron", "inspect"]
    diff = [*paratron, str(a), "--diff", str(b), "--json"]
    peer = [sys.executable, "-c", PEER, str(a / "model.safetensors"), str(b / "model.safetensors")]
    out = {"diff": (diff, ROOT / "src", {}), "peer": (peer, ROOT, {})}
    if args.smoke:
        return out
    out["diff_no_verify"] = ([*diff, "--no-verify"], ROOT / "src", {})
    if args.baseline_source:
        out["diff_baseline"] = (diff, args.baseline_source, {})
    out["peer_one_thread"] = (peer, ROOT, {"OMP_NUM_THREADS": "1"})
    out["start_up"] = ([*paratron, str(a), "--tensors", "none", "--no-verify"], ROOT / "src", {})
    out["peer_start_up"] = ([sys.executable, "-c", "import torch, safetensors.torch"], ROOT, {})
    return out


def check_agreement(paratron_json: str, peer_json: str) -> float:
    """Both sides found the same largest difference in every tensor (float32 rounding apart); the largest of all."""
    diff = json.loads(paratron_json)
    peer = json.loads(peer_json)
    ours = {t["name"]: t["max_abs"] for t in diff["tensors"]}
    assert not diff["identical"] and set(ours) == set(peer), "the two sides compared different tensors"
    for name, value in peer.items():
        assert abs(ours[name] - value) <= 1e-6 * max(abs(value), 1e-30), f"{name}: paratron {ours[name]}, peer {value}"
    assert 0 < max(peer.values()) < 20 * PERTURBATION, "B is not A moved by N(0, 1e-4)"
    return max(peer.values())


def profile(a: Path, b: Path, top: int) -> str:
    """cProfile of one in-process `inspect A --diff B` (after the imports): the `top` functions by own time."""
    profiler = cProfile.Profile()
    with redirect_stdout(io.StringIO()):
        profiler.runcall(run_inspect, [str(a), "--diff", str(b), "--tensors", "3"])
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of one in-process --diff")
    parser.add_argument(
        "--baseline-source",
        type=Path,
        default=None,
        help="another version's src folder: its `inspect --diff` is timed too (diff_baseline), in the same rounds",
    )
    parser.add_argument("--directory", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--output", type=Path, default=RESULTS / "inspect.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, layers=2, hidden_size=64, heads=4, vocab_size=256, seq_length=32, rounds=1)
    work, load_before = Path(tempfile.mkdtemp(dir=args.directory)), os.getloadavg()
    try:
        a, b, params = write_checkpoints(args, work)
        size = (a / "model.safetensors").stat().st_size
        print(f"checkpoints: {params / 1e6:.1f}M parameters, {size / 2**20:.1f} MiB of weights each", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in commands(a, b, args)}
        for round_ in range(args.rounds):
            for kind, (command, source, environment) in commands(a, b, args).items():
                runs[kind].append(timed(command, source, **environment))
            for kind in runs.keys() & {"diff", "diff_no_verify", "diff_baseline"}:
                largest = check_agreement(runs[kind][-1]["stdout"], runs["peer"][-1]["stdout"])
            if "peer_one_thread" in runs:
                assert runs["peer_one_thread"][-1]["stdout"] == runs["peer"][-1]["stdout"], "the peer's runs disagree"
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.2f}s" for k, v in runs.items()))
        profiled = profile(a, b, 15) if args.profile else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, parser, runs, params, size, largest, profiled, load_before)


def report(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    runs: dict[str, list[dict[str, Any]]],
    params: int,
    size: int,
    largest: float,
    profiled: str | None,
    load_before: tuple[float, float, float],
) -> None:
    """Print the medians and the ratio; write the JSON results."""
    keys = ("seconds", "cpu_seconds", "peak_mib", "anonymous_mib", "file_mib")
    median = {kind: {k: statistics.median(r[k] for r in rs) for k in keys} for kind, rs in runs.items()}
    command = "python bench/inspect_checkpoint.py" + "".join(
        f" --{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("output", "directory", "smoke", "profile", "baseline_source") and v != parser.get_default(k)
    )
    ratios = {
        f"{kind}_over_{other}_{what}": median[kind][what] / median[other][what]
        for kind, other in (
            ("diff", "peer"),
            ("diff_no_verify", "peer"),
            ("diff", "peer_one_thread"),
            ("diff", "diff_baseline"),
        )
        for what in ("seconds", "cpu_seconds")
        if kind in median and other in median
    }
    payload = {
        "command": command,
        "parameters": params,
        "weights_bytes": size,
        "largest_difference": largest,
        "runs": {kind: [{k: r[k] for k in keys} for r in rs] for kind, rs in runs.items()},
        "median": median,
        "ratios": ratios,
        "baseline_source": str(args.baseline_source) if args.baseline_source else None,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    print(f"{'command':<16} {'wall s':>7} {'CPU s':>7} {'peak MiB':>9} {'anon MiB':>9} {'file MiB':>9}")
    for kind, values in median.items():
        print(
            f"{kind:<16} {values['seconds']:>7.2f} {values['cpu_seconds']:>7.2f} "
            + " ".join(f"{values[k]:>9.0f}" for k in keys[2:])
        )
    print(f"medians of {args.rounds} rounds; written {args.output}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    if profiled:
        print(profiled)


if __name__ == "__main__":
    main()
