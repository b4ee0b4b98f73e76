"""`paratron train | evaluate | preprocess | generate | serve | convert | plan | schedule | debug | doctor | inspect`:
the command line.

User mistakes (UserError) print one line and exit 2; internal failures keep their
traceback and exit 1. Each command imports what it needs when it runs, for start-up speed:
`paratron --help` and `paratron schedule` do not load torch's distributed machinery or the
data pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

try:
    import tomllib
except ImportError:  # (Python 3.10)
    tomllib = None

from paratron.distributed.parent import end_with_launcher
from paratron.errors import PeerFailure, UserError

if TYPE_CHECKING:  # (the schema itself is imported when a command runs, for start-up speed)
    from paratron.config.loading import Resolution
    from paratron.config.schema import Config

COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {}
"""name -> (one-line summary, function of the remaining arguments returning the exit code)"""


Command = Callable[[list[str]], int]


def command(name: str, summary: str) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        COMMANDS[name] = (summary, fn)
        return fn

    return register


def _usage() -> str:
    lines = ["usage: paratron COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (summary, _) in COMMANDS.items()]
    lines += ["", "`paratron COMMAND --help` describes a command's options; `paratron --version` the version."]
    return "\n".join(lines)


def version() -> str:
    """The installed package's version, else (run from a source tree) its pyproject.toml's."""
    import importlib.metadata  # (start-up speed, docs/architecture.md: only for --version)

    try:
        return importlib.metadata.version("paratron")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        project = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(project.read_text(encoding="utf-8"))["project"]["version"])
    except (AttributeError, OSError, KeyError, ValueError):  # (AttributeError: Python 3.10 has no tomllib)
        return "unknown (not installed, and no pyproject.toml beside the source)"


def train_parser() -> argparse.ArgumentParser:
    from paratron.config.arguments import ArgumentParser, add_config_arguments

    parser = ArgumentParser(
        prog="paratron train",
        usage="paratron train [--config RECIPE] [--nproc N] [flags]",
        description="Train a GPT-family model. Settings come from defaults, then --model's registry entry, "
        "then the --config recipe, then flags; Megatron-LM flag names are accepted.",
        allow_abbrev=False,
    )
    add_config_arguments(parser)
    return parser


def _check_and_launch(
    config: Config, argv: list[str], origins: dict[str, str] | None = None
) -> tuple[int | None, Config]:
    """Validate the settings and the input files before any worker starts; with --nproc N (and not
    started by torchrun) run `paratron ARGV` under torchrun and return its exit code, else None:
    this process is a worker and goes on, with the settings returned (fitted to this machine's
    GPUs). `origins`: where settings came from (`Resolution.origins`), for the error line."""
    from paratron.config.loading import explain_origins
    from paratron.distributed.init import computing_device_type, env_world_size, fit_to_devices, launched_by_torchrun
    from paratron.distributed.launch import needs_agent, run_under_torchrun, slurm_settings
    from paratron.training.preflight import check_before_launch

    torchrun = launched_by_torchrun()
    resolved = config  # (remembers where its settings came from)
    if not torchrun:
        config = dataclasses.replace(config, parallel=slurm_settings(os.environ, config.parallel))
        config, argv = fit_to_devices(config, argv)  # (one process per GPU, counted before any starts)
    p = config.parallel
    try:
        world_size = env_world_size() if torchrun else p.nproc_per_node * p.nnodes
        check_before_launch(config, world_size, computing_device_type(p.distributed_backend))
    except UserError as exc:  # say which settings a recipe, a preset or the checkpoint gave
        raise type(exc)(explain_origins(str(exc), origins or {}, resolved, config)) from None
    if needs_agent(p) and not torchrun:
        from paratron.checkpoint.lock import held_for_the_launch

        with held_for_the_launch(config.checkpoint.save if argv[0] == "train" else None, p):  # one writer
            return run_under_torchrun(p, argv), config
    return None, config


def train_config(argv: list[str]) -> Config:
    """The run's settings from `paratron train`'s flags (see `train_settings`)."""
    return train_settings(argv).config


def train_settings(argv: list[str]) -> Resolution:
    """The run's settings from `paratron train`'s flags, over the model of the checkpoint it loads, adjusted
    where Megatron-LM carries on, with where each came from."""
    from paratron.config.arguments import given_settings, parse_config_arguments
    from paratron.config.loading import resolve_command_line
    from paratron.config.schema import MODEL_ARCHITECTURE

    recipe, overrides, namespace = parse_config_arguments(train_parser(), argv)
    given = given_settings(overrides, namespace)
    resolution = resolve_command_line(overrides, recipe, given)
    if "RANK" not in os.environ and resolution.config.parallel.nnodes > 1:
        quiet_launcher_logs()  # (before torch is imported, below)
    from paratron.checkpoint.model_of import with_checkpoint  # (start-up speed, docs/architecture.md: torch)

    resolution = with_checkpoint(resolution, overrides, recipe, checkpoint_wins="use_checkpoint_args" in given)
    if resolution.saved is not None:  # (its architecture came from the checkpoint, whatever the flags said)
        given -= set(MODEL_ARCHITECTURE)
    notes = (resolution.notes, list(resolution.ignored.values()))
    return dataclasses.replace(resolution, config=_like_megatron(resolution.config, given, *notes))


@command("train", "train a model (launches itself under torchrun with --nproc N)")
def cmd_train(argv: list[str]) -> int:
    settings = train_settings(argv)
    if settings.config.planning.dry_run:
        from paratron.planning.dry_run import run_dry_run

        return run_dry_run(settings.config)
    if settings.config.planning.auto:
        argv, settings = _auto(settings.config, argv)
    config = settings.config
    launched, config = _check_and_launch(config, ["train", *argv], settings.origins)
    if launched is not None:
        return launched
    from paratron.training.run import run_training

    run_training(config)
    return 0


def _like_megatron(
    config: Config, given: set[str], notes_first: Sequence[str] = (), ignored: Sequence[str] = ()
) -> Config:
    """Carry on where Megatron-LM carries on with a warning (printed once, by the launcher or rank 0):
    its setting adjustments, and a --load that names the --save directory before its first checkpoint
    starts from scratch. A --load elsewhere that holds nothing stays an error (check_inputs).
    `notes_first`: how the settings were resolved (`config.loading.Resolution.notes`), printed before;
    `ignored`: the warnings of the settings resolved as if not given (`Resolution.ignored`)."""
    from paratron.checkpoint.verify import holds_checkpoint
    from paratron.config.megatron import adjust_like_megatron

    config, adjusted = adjust_like_megatron(config, given)
    notes = [*ignored, *adjusted]
    c = config.checkpoint
    if c.load and c.save and Path(c.load).expanduser().resolve() == Path(c.save).expanduser().resolve():
        if not holds_checkpoint(Path(c.load).expanduser()):
            notes.append(
                f"--load {c.load} holds no checkpoint yet; it is also --save, so training starts from scratch "
                "(as Megatron-LM does)"
            )
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(c, load=None))
    if os.environ.get("RANK", "0") == "0":
        for note in notes_first:
            print(f"note: {note}", file=sys.stderr)
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
    return config


def _auto(config: Config, argv: list[str]) -> tuple[list[str], Resolution]:
    """--auto: the planner's top layout for this machine, as flags the workers read too."""
    from paratron.distributed.init import launched_by_torchrun
    from paratron.errors import ConfigError
    from paratron.planning.auto import auto_layout

    if launched_by_torchrun():
        raise ConfigError(
            "--auto plans before the workers start: launch with paratron train --nproc N --auto, or run "
            "`paratron plan` and start its command under torchrun"
        )
    world = config.planning.world_size or config.parallel.nproc_per_node * config.parallel.nnodes
    argv, best = auto_layout(config, argv, world)
    print(
        f"--auto: {best.describe()}, predicted {best.prediction.tokens_per_s:,.0f} tokens/s, "
        f"peak {best.peak_memory / 1e9:.2f} GB per rank"
    )
    return argv, train_settings(argv)


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


def evaluate_parser() -> argparse.ArgumentParser:
    """train's flags that evaluate uses (EVALUATE_TAKES), and --output."""
    from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments

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


@command("evaluate", "per-token loss and perplexity of a saved model over whole files, per file (task)")
def cmd_evaluate(argv: list[str]) -> int:
    from paratron.config.arguments import parse_config_arguments
    from paratron.config.fields import flag
    from paratron.config.loading import override, resolve_settings
    from paratron.errors import ConfigError

    parser = evaluate_parser()
    recipe, overrides, namespace = parse_config_arguments(parser, argv)
    if namespace.tasks is not None:
        return _evaluate_tasks(argv, recipe, overrides, namespace)
    resolution = resolve_settings(overrides, recipe)
    config = resolution.config
    if not config.checkpoint.load:
        raise ConfigError(f"paratron evaluate needs {flag.load} CKPT (the model to evaluate)")
    if not config.data.data_path:
        raise ConfigError(f"paratron evaluate needs {flag.data_path} FILE... (the data to evaluate on)")
    from paratron.checkpoint.model_of import with_checkpoint  # (start-up speed, docs/architecture.md: torch)

    # (validated with the checkpoint's model, whose context is the default --seq-length, as for fine-tuning)
    resolution = with_checkpoint(resolution, {**overrides, "finetune": True}, recipe)
    # (its weights, no schedule to fit)
    config = override(resolution.config, eval_iters=0, train_iters=1, lr_warmup_iters=0, finetune=True)
    launched, config = _check_and_launch(config, ["evaluate", *argv], resolution.origins)
    if launched is not None:
        return launched
    from paratron.training.validation_loss import run_evaluation

    run_evaluation(config, namespace.output)
    return 0


def _evaluate_tasks(argv: list[str], recipe: str | None, overrides: dict, namespace: argparse.Namespace) -> int:
    """`paratron evaluate --tasks`: lm-evaluation-harness tasks on the engine of the --load checkpoint."""
    from paratron.config.loading import resolve_settings
    from paratron.inference.loading import engine_settings  # (start-up speed, docs/architecture.md: torch)
    from paratron.inference.tasks import run_tasks

    names = _task_names(resolve_settings(overrides, recipe).config, namespace)
    aside = functools.partial(print, file=sys.stderr)
    resolution = engine_settings(overrides, recipe, "evaluate", "the model to evaluate", aside)
    launched, config = _check_and_launch(resolution.config, ["evaluate", *argv], resolution.origins)
    if launched is not None:
        return launched
    n = namespace
    run_tasks(config, names, n.num_fewshot, n.include_path, n.limit, n.output)
    return 0


def _task_names(config: Config, namespace: argparse.Namespace) -> tuple[str, ...]:
    """`paratron evaluate --tasks`' task names, checked (with its other flags) before any worker starts."""
    from paratron.config.fields import flag
    from paratron.errors import ConfigError
    from paratron.inference.tasks import task_manager, task_names

    if config.data.data_path:
        raise ConfigError(f"paratron evaluate takes --tasks or {flag.data_path}, not both; drop one")
    if namespace.num_fewshot is not None and namespace.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {namespace.num_fewshot}: give 0 or more")
    if namespace.limit is not None and namespace.limit < 1:
        raise ConfigError(f"--limit {namespace.limit}: give 1 or more documents")
    names = task_names(namespace.tasks)
    task_manager(names, namespace.include_path, ("--tasks", "--include-path"))
    return names


@command("preprocess", "tokenize text or jsonl into a Megatron-LM indexed dataset (.bin/.idx)")
def cmd_preprocess(argv: list[str]) -> int:
    from paratron.config.arguments import ArgumentParser
    from paratron.data.preprocess import (
        PreprocessResult,
        add_tokenizer_arguments,
        input_files,
        preprocess,
        read_documents,
        save_trained_tokenizer,
        tokenizer_from_arguments,
        tokenizer_type_of,
    )
    from paratron.data.tokenizer import train_byte_level_bpe

    parser = ArgumentParser(
        prog="paratron preprocess",
        allow_abbrev=False,
        description="Tokenize jsonl (one JSON object per line) and plain-text files into "
        "OUTPUT_PREFIX_{key}_document.bin/.idx, Megatron-LM's indexed format.",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="jsonl/json/ndjson files (one document per line), other files (one document each), "
        "or directories of them.",
    )
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX", help="Output path prefix.")
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="Keys to extract from each JSON line (one output dataset per key; default: text).",
    )
    add_tokenizer_arguments(parser)
    parser.add_argument("--append-eod", action="store_true", help="End every document with the end-of-document token.")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="Tokenizing processes (default: 1).")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="Skip and count bad lines (not JSON, no key, empty, not UTF-8) instead of stopping.",
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="No progress bar.")
    parser.add_argument(
        "--sft",
        action="store_true",
        help="The input is .jsonl conversations: render them with --chat-template and write their token ids and "
        "which tokens are trained (OUTPUT_PREFIX_input_ids_document and OUTPUT_PREFIX_trained_document), for "
        "`paratron train --sft --data-path OUTPUT_PREFIX`.",
    )
    parser.add_argument(
        "--chat-template",
        default="tokenizer",
        metavar="TEMPLATE",
        help="With --sft: tokenizer (the tokenizer folder's own template), chatml, llama3 or a jinja file.",
    )
    args = parser.parse_args(argv)
    if args.sft:
        return _preprocess_conversations(args)
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be at least 1")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: must be at least 1")
    files = input_files(args.input)
    if tokenizer_type_of(args) == "ByteLevelBPE":
        texts = (
            d.texts[0] for d in read_documents(files, args.json_keys[:1], PreprocessResult([]), args.skip_bad_lines)
        )
        tokenizer = train_byte_level_bpe(texts, args.vocab_size or 8192)
        path = save_trained_tokenizer(tokenizer, args.output_prefix)
        print(f"trained a {tokenizer.vocab_size}-entry byte-level BPE: {path}")
    else:
        tokenizer = tokenizer_from_arguments(args)
    result = preprocess(
        files,
        args.output_prefix,
        tokenizer,
        args.json_keys,
        args.append_eod,
        args.workers,
        args.skip_bad_lines,
        progress=not args.no_progress_bar,
    )
    mb = result.input_bytes / 1e6
    print(
        f"{result.documents:,} documents, {result.tokens:,} tokens from {mb:,.1f} MB in {result.seconds:.1f}s "
        f"({mb / result.seconds:,.2f} MB/s, {result.tokens / result.seconds:,.0f} tokens/s)"
    )
    if result.skipped:
        print(f"skipped {result.skipped} bad lines, e.g. {result.skipped_examples[0]}")
    for prefix in result.prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def _preprocess_conversations(args) -> int:
    """`paratron preprocess --sft`: conversations -> token ids and trained-token flags."""
    import time

    from paratron.data.preprocess import input_files
    from paratron.data.sft import preprocess_sft, tokenizer_chat_template
    from paratron.data.tokenizer import Tokenizer

    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise UserError(
            "--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH (the model's tokenizer)"
        )
    tokenizer = Tokenizer.from_file(args.tokenizer_model)
    template = tokenizer_chat_template(args.chat_template, tokenizer)
    start = time.perf_counter()
    conversations, tokens = preprocess_sft(input_files(args.input), args.output_prefix, template, tokenizer)
    print(
        f"{conversations:,} conversations, {tokens:,} tokens in {time.perf_counter() - start:.1f}s; "
        f"train on them with: paratron train --sft --data-path {args.output_prefix} ..."
    )
    return 0


GENERATE_TAKES = (
    ("load", "ckpt_format", "data_cache_path", "precision"),
    ("image_processor", "use_tiling", "max_num_tiles", "use_thumbnail"),
    ("kv_cache_gb", "kv_cache_tokens", "kv_block_size", "max_batch_tokens", "max_running_requests"),
    ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id"),
    ("rdzv_timeout_seconds", "distributed_backend", "distributed_timeout_minutes"),
    ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
)
"""The settings `paratron generate` uses (train's flags): the checkpoint, its precision, the images' preprocessing,
the engine's KV cache and batching, and the layout it runs at; the model and tokenizer come from the checkpoint."""


def generate_parser() -> argparse.ArgumentParser:
    """train's flags that generate uses (GENERATE_TAKES), and its own (prompts, sampling, output)."""
    from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments
    from paratron.inference.generate_options import add_generate_arguments  # (start-up speed: torch)

    parser = ArgumentParser(prog="paratron generate", allow_abbrev=False)
    takes = Takes(
        "paratron generate",
        fields=sum(GENERATE_TAKES, ()),
        why=(("model", "paratron generate takes the model from the checkpoint (--load); drop the model flags"),),
    )
    add_config_arguments(parser, takes)
    add_generate_arguments(parser)
    parser.usage = (
        "paratron generate --load CKPT (--prompt TEXT... | --prompt-file FILE | --chat) [sampling flags] [flags]"
    )
    parser.description = (
        "Continue prompts with a saved model (a paratron or Megatron-LM checkpoint, or a Hugging Face folder) at any "
        "layout (--nproc, tensor and pipeline parallelism). All prompts run together in the inference engine "
        "(continuous batching) and are printed in order; a lone prompt is streamed as it is generated; --chat holds "
        "a conversation read from standard input."
    )
    return parser


@command("generate", "continue prompts, or hold a conversation, with a saved model")
def cmd_generate(argv: list[str]) -> int:
    from paratron.config.arguments import parse_config_arguments
    from paratron.inference.generate_command import generate_settings, run_generate  # (start-up speed: torch)
    from paratron.inference.generate_options import generate_options

    recipe, overrides, namespace = parse_config_arguments(generate_parser(), argv)
    options = generate_options(namespace, sys.stdin)  # (files read and flags checked before any worker starts)
    resolution = generate_settings(overrides, recipe)
    launched, config = _check_and_launch(resolution.config, ["generate", *argv], resolution.origins)
    if launched is not None:
        return launched
    return run_generate(config, options, sys.stdin, precision=overrides.get("precision"))


SERVE_TAKES = (
    ("load", "ckpt_format", "precision", "chat_template"),
    ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id"),
    ("rdzv_timeout_seconds", "distributed_backend", "distributed_timeout_minutes"),
    ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    ("kv_cache_gb", "kv_cache_tokens", "kv_block_size", "max_batch_tokens", "max_running_requests"),
    ("max_request_tokens", "max_request_n", "max_prompt_tokens"),
)
"""The settings `paratron serve` uses (train's flags): the checkpoint and its precision, the chat template, the
launch and the layout, the engine's KV cache and batching, the server's request limits; the model and its
tokenizer come from the checkpoint."""


def serve_parser() -> argparse.ArgumentParser:
    """train's flags that serve uses (SERVE_TAKES), and the server's own."""
    from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments

    parser = ArgumentParser(prog="paratron serve", allow_abbrev=False)
    takes = Takes(
        "paratron serve",
        fields=sum(SERVE_TAKES, ()),
        why=(
            ("model", "paratron serve takes the model from the checkpoint (--load); drop the model flags"),
            ("data", "paratron serve uses the checkpoint's tokenizer; drop the data and tokenizer flags"),
        ),
    )
    add_config_arguments(parser, takes)
    parser.usage = "paratron serve --load CKPT [--port 8000] [--host 127.0.0.1] [--api-key KEY] [flags]"
    parser.description = (
        "Serve the --load checkpoint (paratron, Megatron-LM or a Hugging Face folder) over HTTP with OpenAI's API: "
        "/v1/completions, /v1/chat/completions (the tokenizer's chat template, or --chat-template), /v1/models, "
        "/health, and the tokenizer routes lm-evaluation-harness reads (/tokenize, /detokenize, /tokenizer_info). "
        "Requests are batched continuously by the engine; --nproc with tensor and pipeline parallelism spreads the "
        "model over several devices. SIGTERM lets running requests finish, then exits."
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="Address to listen on (default: 127.0.0.1).",
    )
    server.add_argument(
        "--port", type=int, default=8000, metavar="N", help="Port to listen on; 0 picks a free one (default: 8000)."
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("PARATRON_API_KEY"),
        metavar="KEY",
        help="Require `Authorization: Bearer KEY` on every route but /health (default: $PARATRON_API_KEY, else none).",
    )
    server.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="The model's name in /v1/models and in requests (default: the checkpoint folder's name).",
    )
    return parser


@command("serve", "serve a saved model over HTTP with OpenAI's API (completions, chat), batching requests")
def cmd_serve(argv: list[str]) -> int:
    from paratron.config.arguments import parse_config_arguments
    from paratron.errors import ConfigError

    recipe, overrides, namespace = parse_config_arguments(serve_parser(), argv)
    if not 0 <= namespace.port <= 65535:
        raise ConfigError(f"--port {namespace.port}: must be between 0 (a free port) and 65535")
    if namespace.api_key is not None and not namespace.api_key.strip():
        raise ConfigError("--api-key: empty; give a key, or leave it out to serve without one")
    from paratron.inference.serve_processes import (  # (start-up speed, docs/architecture.md: torch)
        run_server,
        serve_settings,
    )

    resolution = serve_settings(overrides, recipe)
    launched, config = _check_and_launch(resolution.config, ["serve", *argv], resolution.origins)
    if launched is not None:
        return launched
    log = functools.partial(print, flush=True)
    precision = config.training.precision if "precision" in overrides else None  # (else the checkpoint's)
    args = (namespace.host, namespace.port, namespace.api_key, namespace.served_model_name, log, precision)
    run_server(config, *args)
    return 0


@command("convert", "convert weights between Hugging Face, Megatron-LM and paratron checkpoints")
def cmd_convert(argv: list[str]) -> int:
    from paratron.checkpoint.converted import ConvertOptions
    from paratron.checkpoint.formats import UNSUPPORTED, convert, converts
    from paratron.checkpoint.hf import FAMILY_NAMES
    from paratron.config.arguments import ArgumentParser

    parser = ArgumentParser(
        prog="paratron convert",
        allow_abbrev=False,
        usage="paratron convert --from hf SRC --to paratron DST  |  --from paratron SRC --to hf DST [--merge-lora]"
        "  |  --from paratron SRC --to peft DST  |  --from megatron SRC --to paratron|hf DST [--finetune]"
        "  |  --from paratron SRC --to megatron DST [--target-tensor-parallel-size N]"
        " [--target-pipeline-parallel-size M]"
        "  |  --from hf LM --vision-model-path VIT --to paratron DST [--vision-feature-layer N ...]",
        description=f"Convert {', '.join(list(FAMILY_NAMES.values())[:-1])} and {list(FAMILY_NAMES.values())[-1]} "
        "weights between a Hugging Face directory (config.json + safetensors: model.safetensors or the shards its "
        "model.safetensors.index.json names; a field config.json leaves out takes transformers' default for "
        "the model type) and a paratron checkpoint (weights only, for --load); write a LoRA "
        "checkpoint's adapters as a peft adapter (Llama family), or merged into the base weights; read "
        "Megatron-LM GPT checkpoints (torch and torch_dist formats, any TP/PP) and write its torch format "
        "(docs/megatron-checkpoints.md); put a CLIP or SigLIP vision encoder before a language model "
        "(docs/multimodal.md).",
    )
    parser.add_argument(
        "--from",
        dest="source",
        nargs=2,
        metavar=("FORMAT", "SRC"),
        required=True,
        help="hf, megatron or paratron, and the directory to read.",
    )
    parser.add_argument(
        "--to",
        dest="target",
        nargs=2,
        metavar=("FORMAT", "DST"),
        required=True,
        help="paratron, hf, peft or megatron, and a new directory to write.",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="With --to hf: fold a LoRA checkpoint's adapters into the base weights, W + (alpha/rank) B A.",
    )
    parser.add_argument(
        "--finetune",
        action="store_true",
        help="With --from megatron: weights only (iteration 0, no optimizer state), for fine-tuning.",
    )
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="With --to megatron: the tensor-parallel size of the written checkpoint (default 1).",
    )
    parser.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="With --to megatron: the pipeline-parallel size of the written checkpoint (default 1).",
    )
    vision = parser.add_argument_group("vision encoder (with --from hf SRC --to paratron DST)")
    vision.add_argument(
        "--vision-model-path",
        type=Path,
        metavar="DIR",
        help="A Hugging Face CLIP or SigLIP vision encoder (CLIPVisionModel, SiglipVisionModel, or a CLIPModel or "
        "SiglipModel, whose vision half is taken) to put before the language model SRC, with a new projector.",
    )
    vision.add_argument(
        "--vision-feature-layer", type=int, metavar="N", help="Its layer that feeds the projector (default -2)."
    )
    vision.add_argument(
        "--vision-feature-select",
        choices=("default", "full"),
        help="default: drop CLIP's class token, full: keep every feature (default: default for CLIP, full for SigLIP).",
    )
    vision.add_argument("--vision-projection", choices=("mlp", "affine"), help="The new projector (default mlp).")
    args = parser.parse_args(argv)
    formats = (args.source[0], args.target[0])
    source, target = Path(args.source[1]), Path(args.target[1])
    vision_flags = (args.vision_feature_layer, args.vision_feature_select, args.vision_projection)
    if args.vision_model_path is None and any(flag is not None for flag in vision_flags):
        raise UserError(
            "--vision-feature-layer/--vision-feature-select/--vision-projection apply with --vision-model-path only"
        )
    if args.vision_model_path is not None and formats != ("hf", "paratron"):
        raise UserError("--vision-model-path applies to --from hf SRC --to paratron DST only")
    if args.vision_model_path is not None and not args.vision_model_path.is_dir():
        raise UserError(f"--vision-model-path {args.vision_model_path}: no such directory")
    if args.merge_lora and formats != ("paratron", "hf"):
        raise UserError("--merge-lora applies to --from paratron SRC --to hf DST only")
    if args.finetune and formats[0] != "megatron":
        raise UserError("--finetune applies to --from megatron SRC only")
    layout = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if layout != (1, 1) and formats[1] != "megatron":
        raise UserError("--target-tensor-parallel-size/--target-pipeline-parallel-size apply to --to megatron only")
    if not source.exists():
        raise UserError(f"--from {args.source[0]} {source}: no such directory")
    if not converts(*formats):
        raise UserError(f"--from {formats[0]} --to {formats[1]}: {UNSUPPORTED}")
    options = ConvertOptions(
        args.merge_lora,
        args.finetune,
        *layout,
        vision_model_path=args.vision_model_path,
        vision_feature_layer=args.vision_feature_layer,
        vision_feature_select=args.vision_feature_select,
        vision_projection=args.vision_projection,
    )
    print(convert(formats[0], source, formats[1], target, options)[1])
    return 0


@command("plan", "choose the parallel layout: every layout ranked by predicted throughput, with memory and time")
def cmd_plan(argv: list[str]) -> int:
    from paratron.planning.command import run_plan

    return run_plan(argv)


@command("schedule", "simulate a pipeline schedule, report its bubble and draw its timeline")
def cmd_schedule(argv: list[str]) -> int:
    from paratron.config.arguments import ArgumentParser
    from paratron.config.schema import LoggingConfig
    from paratron.errors import ConfigError
    from paratron.parallel.pipeline.draw import draw_timeline
    from paratron.parallel.pipeline.schedules import (
        SCHEDULES,
        build_schedule,
        peak_live_activations,
        simulate,
        theoretical_bubble,
    )

    parser = ArgumentParser(
        prog="paratron schedule",
        allow_abbrev=False,
        description="Build a pipeline schedule, simulate it with forward 1 and backward 2 time units "
        "(input and weight gradients 1 each for zb-h1), and "
        "draw which operation every rank runs when; no model or process is started.",
    )
    parser.add_argument("--pp", type=int, required=True, metavar="N", help="Pipeline-parallel size (ranks).")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="Micro-batches per step.")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="Schedule (default: 1f1b).")
    parser.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="V",
        help="Model chunks (virtual stages) per rank; only for interleaved (default: 1).",
    )
    run_dir = LoggingConfig().run_dir
    parser.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="PNG to write (default: schedule-NAME-ppN-mM[-vV].png in --run-dir).",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path(run_dir),
        metavar="DIR",
        help=f"Folder of the default --output, as train's run folder (default: {run_dir}).",
    )
    parser.add_argument("--print", action="store_true", dest="show", help="Also print every rank's operations.")
    args = parser.parse_args(argv)
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--vpp", args.vpp)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    name, pp, m, v = args.schedule, args.pp, args.microbatches, args.vpp
    try:
        schedule = build_schedule(name, pp, m, v)
    except ValueError as exc:
        raise ConfigError(f"--schedule {name} --pp {pp} --microbatches {m} --vpp {v}: {exc}") from None
    timeline = simulate(schedule)
    theory = theoretical_bubble(name, pp, m, v)
    formula = {"interleaved": "((p-1)/v)/(m+(p-1)/v)", "zb-h1": "(p-1)/(3m+p-1)"}.get(name, "(p-1)/(m+p-1)")
    caveat = ", which assumes m >= p" if name == "zb-h1" and m < pp else ""
    v = schedule.chunks
    chunks = f", {v} chunks per rank" if v > 1 else ""
    held = "micro-batch activations" if v == 1 else f"micro-batch chunk activations (1/{v} of a stage's each)"
    if args.show:
        print(schedule)
    against = "no closed form" if name == "zb-v" else f"theory {formula} = {theory:.1%}{caveat}"
    print(
        f"{name}: pp {pp}, {m} micro-batches{chunks}: bubble {timeline.bubble_fraction():.1%} of the step "
        f"({against}); peak live {held} per rank: " + " ".join(map(str, peak_live_activations(schedule)))
    )
    output = args.output or args.run_dir / (f"schedule-{name}-pp{pp}-m{m}" + (f"-v{v}" if v > 1 else "") + ".png")
    title = f"{name} schedule: pp {pp}, {m} micro-batches{chunks}; bubble {timeline.bubble_fraction():.1%}"
    print(f"timeline: {draw_timeline(timeline.spans, output, title, '(forward = 1)')}")
    return 0


@command("debug", "compare two layouts step by step and name the first module or gradient where they part")
def cmd_debug(argv: list[str]) -> int:
    from paratron.debugging.compare import run_debug

    return run_debug(argv)


@command("doctor", "what this machine can do: versions, devices, interconnect, a collective probe, warnings")
def cmd_doctor(argv: list[str]) -> int:
    from paratron.debugging.doctor import run_doctor

    return run_doctor(argv)


@command("inspect", "what a checkpoint holds (configuration, layout, step, tensors, optimizer state); --diff two")
def cmd_inspect(argv: list[str]) -> int:
    from paratron.debugging.inspect import run_inspect

    return run_inspect(argv)


CPP_LOG_LEVEL, USER_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL", "PARATRON_USER_CPP_LOG_LEVEL"


def quiet_launcher_logs() -> None:
    """Keep torch's C++ log (a stack trace per failed connection to the rendezvous) out of the
    launch agent, which reports failures in one line; the workers get the user's level back
    (`main`). Before torch is imported, which reads it once."""
    os.environ[USER_CPP_LOG_LEVEL] = os.environ.get(CPP_LOG_LEVEL, "")
    os.environ[CPP_LOG_LEVEL] = "FATAL"


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_lost(exc: RuntimeError) -> bool:
    """Whether a worker's collective failed because another rank died (the agent then stops or
    restarts the job; this rank's traceback would only hide the one that matters)."""
    return "RANK" in os.environ and any(sign in str(exc) for sign in PEER_LOST)


def main(argv: Sequence[str] | None = None) -> int:
    if "RANK" in os.environ and argv is None:  # a worker process: it ends with its launcher
        end_with_launcher(os.getppid())  # (`python -m paratron` has already: this is for the `paratron` script)
    if "RANK" in os.environ and USER_CPP_LOG_LEVEL in os.environ:  # a worker of a quiet launcher
        level = os.environ.pop(USER_CPP_LOG_LEVEL)
        os.environ.pop(CPP_LOG_LEVEL) if not level else os.environ.update({CPP_LOG_LEVEL: level})
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"paratron {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: unknown command {name!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][1](rest)
    except PeerFailure:
        return 2
    except RuntimeError as exc:
        if not _peer_lost(exc):
            raise
        from paratron.distributed.watchdog import hang_reported  # (start-up speed, docs/architecture.md: torch)

        if not hang_reported():  # (else the watchdog's line said it all)
            sign = next(sign for sign in PEER_LOST if sign in str(exc))
            print(
                f"[rank {os.environ.get('RANK', '0')}] stopped: another rank failed ({sign.lower()})", file=sys.stderr
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # nothing left to tidy, and torch's threads may still hold the dead connections
    except OSError as exc:  # an unreadable input, an unwritable output, a full disk: the user's to fix
        from paratron.distributed.launch import report_worker_error

        where = f"{exc.filename}: " if exc.filename else ""
        report_worker_error(f"{where}{exc.strerror or exc}")
        return 2
    except UserError as exc:
        from paratron.config.arguments import as_typed
        from paratron.distributed.launch import report_worker_error

        report_worker_error(as_typed(str(exc), rest))
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
