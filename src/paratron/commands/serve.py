"""`paratron serve`: a saved model over HTTP with OpenAI's API, requests batched by the inference engine.

The inference stack (torch) is imported once the flags are read and checked: `paratron serve --help` loads
none of it (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import functools
import os

from paratron.commands.launching import check_and_launch
from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments, parse_config_arguments
from paratron.errors import ConfigError

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


def parser() -> argparse.ArgumentParser:
    """train's flags that serve uses (SERVE_TAKES), and the server's own."""
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


def run(argv: list[str]) -> int:
    """`paratron serve ARGV`: the server's flags checked, then the workers launched, or this process serves (a
    worker, or the only process)."""
    recipe, overrides, namespace = parse_config_arguments(parser(), argv)
    if not 0 <= namespace.port <= 65535:
        raise ConfigError(f"--port {namespace.port}: must be between 0 (a free port) and 65535")
    if namespace.api_key is not None and not namespace.api_key.strip():
        raise ConfigError("--api-key: empty; give a key, or leave it out to serve without one")
    from paratron.inference.serve_processes import (  # (start-up speed, docs/architecture.md: torch)
        run_server,
        serve_settings,
    )

    resolution = serve_settings(overrides, recipe)
    launched, config, layout = check_and_launch(resolution.config, ["serve", *argv], resolution.origins)
    if launched is not None:
        return launched
    log = functools.partial(print, flush=True)
    precision = config.training.precision if "precision" in overrides else None  # (else the checkpoint's)
    args = (namespace.host, namespace.port, namespace.api_key, namespace.served_model_name, log, precision)
    run_server(config, *args, layout=layout)
    return 0
