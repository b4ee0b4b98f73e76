"""Settings for using a trained model: the inference engine's KV cache and batching, the server's limits, and
lm-evaluation-harness tasks run during training (`paratron generate | serve | evaluate --tasks`, `train
--eval-tasks`). A section of its own in `Config` (`config.inference`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paratron.config.limits import ABOVE_ZERO, ZERO_OR_MORE


@dataclass(frozen=True)
class InferenceConfig:
    """Generation, serving and task evaluation."""

    kv_cache_gb: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Memory for the KV cache on each device, in GB (10^9 bytes): the keys and values of every running request live
    in blocks of --kv-block-size tokens taken from it (default: --kv-cache-tokens, or room for --max-running-requests
    requests of the model's whole context)."""

    kv_cache_tokens: int | None = field(default=None, metadata=ABOVE_ZERO)
    """The KV cache's size in tokens instead of GB (rounded up to whole blocks)."""

    kv_block_size: int = field(default=16, metadata=ABOVE_ZERO)
    """Tokens per KV-cache block: a request holds whole blocks, taken as it grows and given back when it ends."""

    max_batch_tokens: int = field(default=2048, metadata=ABOVE_ZERO)
    """Tokens one engine step runs at most (every running request's next token, then prompts of waiting ones; a
    prompt longer than this is run in pieces)."""

    max_running_requests: int = field(default=64, metadata=ABOVE_ZERO)
    """Sequences decoded together at most (a request with n completions counts n); the others wait their turn."""

    max_request_tokens: int | None = field(default=None, metadata=ABOVE_ZERO)
    """The server's limit on one request's max_tokens (default: the model's context): a request beyond it is refused
    with a 400 naming the limit, so no client takes every cache block."""

    max_request_n: int = field(default=16, metadata=ABOVE_ZERO)
    """The server's limit on one request's `n` (completions per prompt)."""

    max_prompt_tokens: int | None = field(default=None, metadata=ABOVE_ZERO)
    """The server's limit on one prompt's length in tokens (default: the model's context less one)."""

    eval_tasks: tuple[str, ...] = ()
    """lm-evaluation-harness tasks (names, or task YAML files' names under --eval-tasks-include-path) that training runs
    every --eval-interval steps, logging their metrics beside the validation loss (metrics.jsonl, TensorBoard)."""

    eval_tasks_include_path: str | None = None
    """A folder of the user's own lm-evaluation-harness task YAML files for --eval-tasks (the harness'
    --include_path)."""

    eval_tasks_num_fewshot: int | None = field(default=None, metadata=ZERO_OR_MORE)
    """Few-shot examples in each --eval-tasks prompt (default: each task's own)."""

    eval_tasks_limit: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Score at most this many documents of each --eval-tasks task (default: all)."""
