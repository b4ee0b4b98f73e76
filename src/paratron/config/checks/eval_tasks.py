"""What `train --eval-tasks` needs of a run: a tokenizer (the harness speaks text) and a layout the inference engine
runs. The task names themselves are checked against the harness' index with the input files (`training.preflight`)."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_eval_tasks(config: Config, layout: Layout) -> None:
    """One ConfigError naming the setting that keeps --eval-tasks from running, and the flag to drop."""
    if not config.inference.eval_tasks:
        return
    d, p = config.data, config.parallel
    tasks = f"{flag.eval_tasks} {','.join(config.inference.eval_tasks)}"
    if d.mock_data:
        raise ConfigError(
            f"{tasks} needs a tokenizer, and {flag.mock_data} has none; train on text (--data-path with a tokenizer) "
            f"or drop {flag.eval_tasks}"
        )
    if d.resolved_tokenizer_type == "NullTokenizer":
        raise ConfigError(
            f"{tasks} needs a tokenizer that reads text; {flag.tokenizer_type} NullTokenizer reads token ids; "
            f"choose another tokenizer or drop {flag.eval_tasks}"
        )
    vpp = flag.num_layers_per_virtual_pipeline_stage
    refused = (
        (p.sequence_parallel, flag.sequence_parallel, flag.sequence_parallel),
        (layout.cp > 1, f"{flag.context_parallel_size} {layout.cp}", flag.context_parallel_size),
        (
            p.expert_model_parallel_size > 1,
            f"{flag.expert_model_parallel_size} {p.expert_model_parallel_size}",
            flag.expert_model_parallel_size,
        ),
        (p.zero_stage == 3, f"{flag.zero_stage} 3", flag.zero_stage),
        (
            layout.pipeline.chunks > 1,
            "virtual pipeline stages",
            f"{vpp} (or {flag.virtual_pipeline_model_parallel_size})",
        ),
    )
    for on, what, drop in refused:
        if on:
            raise ConfigError(f"{tasks}: the inference engine does not run {what}; drop {drop} or {flag.eval_tasks}")
