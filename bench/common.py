"""What the benchmarks share: model shapes, the settings a side-by-side comparison assumes, the
smoke mode, and the spawning of gloo ranks.

Every comparison runs both sides on the same computation, so that a ratio of times means
something and each benchmark can check that its two sides agree:

- Dropout 0 (`NO_DROPOUT`). Megatron-LM's default is 0.1, and twin implementations (paratron and
  DTensor, torch.distributed.pipelining, megatron-core, DDP / FSDP2) draw different dropout masks
  from the same seed: their losses and gradients would part from the first step, and one side
  might pay for masks the other does not draw.
- fp32 (paratron's default precision): the CPU has no fast bf16 or fp16 matmuls, and the checks'
  tolerances are fp32's.
- `SEED` for the weights, `DATA_SEED` for the token ids every rank draws alike.

`--smoke` (every benchmark has it): tiny sizes, one round, every check of the benchmark on,
results in a temporary folder, a few seconds; tests/integration/test_bench_smoke.py runs them
all, so a benchmark that stops working fails a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.multiprocessing as mp

from paratron.distributed.local_ranks import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
SEED = 7
DATA_SEED = 0
PRECISION = "fp32"

LLAMA_STYLE = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "add_bias_linear": False,
}
"""Llama's layer (rotary positions, RMSNorm, SwiGLU, no biases); shapes come on top."""

LLAMA_SMALL = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "ffn_hidden_size": 1536,
    "vocab_size": 8192,
    "max_position_embeddings": 512,
    **LLAMA_STYLE,
    "untie_embeddings_and_output_weights": True,
    **NO_DROPOUT,
}
"""The Llama-shaped model of the tensor-parallel, ZeRO-memory and sharded-checkpoint benchmarks."""

SMOKE_HELP = "tiny sizes and one round, every check on, results in a temporary folder: does the benchmark still run?"


def gpt_settings(args: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2-style model of the pipeline and data-parallel benchmarks, from their shape flags.
    Untied embeddings: tied weights would add an all-reduce on one side only."""
    return dict(
        num_layers=args["layers"],
        hidden_size=args["hidden"],
        num_attention_heads=args["heads"],
        ffn_hidden_size=args["ffn"],
        vocab_size=args["vocab"],
        max_position_embeddings=args["seq"],
        make_vocab_size_divisible_by=1,
        untie_embeddings_and_output_weights=True,
        **NO_DROPOUT,
    )


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    """--smoke, worded alike in every benchmark."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def apply_smoke(args: argparse.Namespace, parser: argparse.ArgumentParser, **tiny: Any) -> None:
    """Under --smoke: take the tiny settings, and send results that would land in bench/results
    (the published figures) to a temporary folder instead."""
    if not args.smoke:
        return
    for key, value in tiny.items():
        setattr(args, key, value)
    for key in ("output", "markdown"):
        default = parser.get_default(key) if hasattr(args, key) else None
        if default is not None and getattr(args, key) == default:
            setattr(args, key, smoke_folder() / Path(default).name)


def smoke_folder() -> Path:
    """Where --smoke writes what a full run writes to bench/results."""
    folder = Path(tempfile.gettempdir()) / f"paratron-bench-smoke-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return folder


def test_helper(name: str) -> ModuleType:
    """A helper module of the test suite (tests/NAME.py, e.g. the megatron-core oracle), loaded from
    its file so that a benchmark builds its peer exactly as the tests do."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spawn(worker: Callable[..., None], world: int, *args: Any, forked: bool = False) -> Any:
    """Run `worker(rank, world, port, *args, out)` on `world` spawned processes and return the JSON
    that rank 0 wrote to `out`. Unlike `run_ranks` there is no time limit: full runs take minutes.

    `forked` (--smoke): the ranks are forked by `run_ranks` from a server that imported torch once,
    not started as fresh interpreters that each spend seconds importing it: the same computation,
    but not a full run's conditions (the server's C library settings, run_ranks' time limit)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        if forked:
            run_ranks(_ranked, world, worker, args, out.name)
        else:
            mp.spawn(worker, args=(world, free_port(), *args, out.name), nprocs=world)
        return json.loads(Path(out.name).read_text())


def _ranked(worker: Callable[..., None], args: tuple[Any, ...], out: str) -> None:
    """One rank of `spawn(..., forked=True)`: `worker` called as `mp.spawn` calls it, from the
    torchrun environment `run_ranks` set."""
    rank, world, port = (int(os.environ[key]) for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    worker(rank, world, port, *args, out)
