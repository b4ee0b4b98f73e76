"""What the two pipeline benchmarks (pipeline_step.py, pipeline_bubble.py) share: the model and
batch flags, the config built from them, the micro-batches, and the results file they merge into."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common import DATA_SEED, PRECISION, SEED, add_smoke_argument, gpt_settings
from paratron.storage import write_text_atomic

if TYPE_CHECKING:
    from paratron.config.schema import Config
    from paratron.model.batch import Batch

SMOKE = dict(layers=4, hidden=64, heads=4, ffn=128, vocab=256, seq=32, microbatches=4, rounds=1, steps=1)
"""--smoke: a model of seconds, every check still on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both benchmarks take: the pipeline, the model's shape, the batch, the output."""
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--cores", type=int, default=2, help="CPU cores shared by the processes")
    parser.add_argument(
        "--first-layers",
        type=int,
        default=None,
        help="layers of the first pipeline stage (1f1b, zb-h1; as --decoder-first-pipeline-num-layers)",
    )
    parser.add_argument(
        "--last-layers",
        type=int,
        default=None,
        help="layers of the last pipeline stage (as --decoder-last-pipeline-num-layers)",
    )
    parser.add_argument("--output", type=Path, default=None)
    add_smoke_argument(parser)


def build(args: dict, schedule: str) -> Config:
    """The config of one side: the model of the flags, cut into --pp stages by `schedule`."""
    from paratron.config import build_config

    pp, m = args["pp"], args["microbatches"]
    parallel: dict[str, Any] = dict(pipeline_model_parallel_size=pp, pipeline_schedule=schedule)
    if schedule == "interleaved":
        parallel["num_layers_per_virtual_pipeline_stage"] = args["layers"] // (2 * pp)
    elif schedule != "zb-v":  # one chunk per rank: the end stages may take other layer counts
        parallel["decoder_first_pipeline_num_layers"] = args.get("first_layers")
        parallel["decoder_last_pipeline_num_layers"] = args.get("last_layers")
    return build_config(
        dict(
            gpt_settings(args),
            **parallel,
            mock_data=True,
            seq_length=args["seq"],
            micro_batch_size=args["micro_batch_size"],
            global_batch_size=args["micro_batch_size"] * m,
            seed=args["seed"],
        )
    )


def microbatches(args: dict) -> tuple[torch.Tensor, torch.Tensor, list[Batch]]:
    """One global batch of random tokens, the same on every rank: inputs, labels, and its micro-batches."""
    from paratron.model.batch import Batch

    mb, m, seq = args["micro_batch_size"], args["microbatches"], args["seq"]
    ids = torch.randint(0, args["vocab"], (mb * m, seq + 1), generator=torch.Generator().manual_seed(DATA_SEED))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return inputs, labels, [Batch(inputs[i : i + mb], labels[i : i + mb]) for i in range(0, mb * m, mb)]


def run_settings(args: dict) -> dict:
    """The model and batch a result was measured with, for its json."""
    return gpt_settings(args) | {
        "seq_length": args["seq"],
        "micro_batch_size": args["micro_batch_size"],
        "microbatches": args["microbatches"],
        "precision": PRECISION,
        "seed": args["seed"],
    }


def merge_into(output: Path | None, key: str, results: dict) -> None:
    """Merge `results` into the JSON at `output` under `key` (the runs of other settings stay)."""
    if output:
        merged = json.loads(output.read_text()) if output.exists() else {}
        merged[key] = {**merged.get(key, {}), **results}  # (--only keeps the other pairings)
        write_text_atomic(output, json.dumps(merged, indent=2))
