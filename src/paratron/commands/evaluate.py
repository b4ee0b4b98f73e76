"""`paratron evaluate`: the per-token loss of a saved model over whole files, or lm-evaluation-harness tasks on it.

The checkpoint, evaluation and inference stacks (torch) are imported once the flags are read: `paratron
evaluate --help` loads none of them (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from paratron.commands.launching import check_and_launch
from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments, parse_config_arguments
from paratron.config.fields import flag
from paratron.config.loading import override, resolve_settings
from paratron.config.schema import Config
from paratron.errors import ConfigError

EVALUATE_TAKES = (
    ("load", "ckpt_format"),
    ("data_path", "seq_length", "data_cache_path", "mmap_bin_files"),
    ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "legacy_tokenizer"),
    ("tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens", "tokenizer_special_tokens"),
    ("sft", "chat_template", "sft_pack", "sft_truncation", "truncate"),
    ("image_folder", "image_processor", "use_tiling", "max_num_tiles", "use_thumbnail"),
    ("micro_batch_size", "global_batch_size", "precision"),
    ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id"),
    ("rdzv_timeout_seconds", "distributed_backend", "distributed_timeout_minutes"),
    ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel"),
    ("context_parallel_size", "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size"),
)
"""The settings `paratron evaluate` uses (train's flags): the checkpoint, the data and its tokenizer, the batch and
the layout it runs at; the model comes from the checkpoint."""


def parser() -> argparse.ArgumentParser:
    """train's flags that evaluate uses (EVALUATE_TAKES), and --output."""
    parser = ArgumentParser(prog="paratron evaluate", allow_abbrev=False)
    takes = Takes(
        "paratron evaluate",
        fields=sum(EVALUATE_TAKES, ()),
        why=(("model", "paratron evaluate takes the model from the checkpoint (--load); drop the model flags"),),
    )
    add_config_arguments(parser, takes)
    parser.usage = (
        "paratron evaluate --load CKPT --data-path FILE... [--sft ...] [--output FILE.json] [flags]\n"
        "       paratron evaluate --load CKPT --tasks NAME[,NAME...] [--num-fewshot K] [--include-path DIR] "
        "[--limit N] [--output FILE.json] [flags]"
    )
    parser.description = (
        "The per-token loss (and perplexity) of the --load checkpoint over the whole of each --data-path file, "
        "per file and overall, at any layout (--nproc, tensor and pipeline parallelism). A text or preprocessed "
        "file is one token stream read in order, in windows of --seq-length + 1 tokens sharing one token (the last "
        "one shorter, padded): every token but the first is scored once, so a file of n tokens scores n - 1. With "
        "--sft, the assistant tokens of every conversation (cut to --seq-length as --sft-truncation says). A file "
        "with nothing to score is an error. Takes train's tokenizer, template and sequence flags; the model "
        "settings come from the checkpoint. With --tasks, lm-evaluation-harness tasks instead (no --data-path): "
        "the harness runs in this process on the inference engine, prints its results table and writes its results "
        "JSON to --output."
    )
    parser.add_argument("--output", type=Path, metavar="FILE.json", help="Write the losses (or task results) here.")
    tasks = parser.add_argument_group("lm-evaluation-harness tasks")
    tasks.add_argument(
        "--tasks", metavar="NAME[,NAME...]", help="Run these harness tasks (or groups) instead of the loss over files."
    )
    tasks.add_argument(
        "--num-fewshot", type=int, metavar="K", help="Few-shot examples in each prompt (default: each task's own)."
    )
    tasks.add_argument("--include-path", metavar="DIR", help="A folder of your own task YAML files.")
    tasks.add_argument("--limit", type=int, metavar="N", help="Score at most N documents of each task.")
    return parser


def run(argv: list[str]) -> int:
    """`paratron evaluate ARGV`: the checks, then the workers launched, or this process evaluates (a worker, or
    the only process)."""
    recipe, overrides, namespace = parse_config_arguments(parser(), argv)
    if namespace.tasks is not None:
        return _evaluate_tasks(argv, recipe, overrides, namespace)
    from paratron.checkpoint.model_of import read_saved_model  # (start-up speed, docs/architecture.md: torch)

    # (validated with the checkpoint's model, whose context is the default --seq-length, as for fine-tuning)
    resolution = resolve_settings({**overrides, "finetune": True}, recipe, read_checkpoint=read_saved_model)
    if not resolution.config.checkpoint.load:
        raise ConfigError(f"paratron evaluate needs {flag.load} CKPT (the model to evaluate)")
    if not resolution.config.data.data_path:
        raise ConfigError(f"paratron evaluate needs {flag.data_path} FILE... (the data to evaluate on)")
    # (its weights, no schedule to fit)
    config = override(resolution.config, eval_iters=0, train_iters=1, lr_warmup_iters=0, finetune=True)
    launched, config, layout = check_and_launch(config, ["evaluate", *argv], resolution.origins)
    if launched is not None:
        return launched
    from paratron.training.validation_loss import run_evaluation  # (start-up speed, docs/architecture.md: torch)

    run_evaluation(config, namespace.output, layout)
    return 0


def _evaluate_tasks(argv: list[str], recipe: str | None, overrides: dict, namespace: argparse.Namespace) -> int:
    """`paratron evaluate --tasks`: lm-evaluation-harness tasks on the engine of the --load checkpoint."""
    from paratron.inference.loading import engine_settings  # (start-up speed, docs/architecture.md: torch)
    from paratron.inference.tasks import run_tasks

    aside = functools.partial(print, file=sys.stderr)
    resolution = engine_settings(overrides, recipe, "evaluate", "the model to evaluate", aside)
    names = _task_names(resolution.config, namespace)
    launched, config, layout = check_and_launch(resolution.config, ["evaluate", *argv], resolution.origins)
    if launched is not None:
        return launched
    n = namespace
    run_tasks(config, names, n.num_fewshot, n.include_path, n.limit, n.output, layout=layout)
    return 0


def _task_names(config: Config, namespace: argparse.Namespace) -> tuple[str, ...]:
    """`paratron evaluate --tasks`' task names, checked (with its other flags) before any worker starts."""
    from paratron.inference.tasks import task_manager, task_names  # (start-up speed, docs/architecture.md: torch)

    if config.data.data_path:
        raise ConfigError(f"paratron evaluate takes --tasks or {flag.data_path}, not both; drop one")
    if namespace.num_fewshot is not None and namespace.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {namespace.num_fewshot}: give 0 or more")
    if namespace.limit is not None and namespace.limit < 1:
        raise ConfigError(f"--limit {namespace.limit}: give 1 or more documents")
    names = task_names(namespace.tasks)
    task_manager(names, namespace.include_path, ("--tasks", "--include-path"))
    return names
