"""`paratron evaluate`: the per-token loss of a saved model over whole files, per file and overall.

Every token of every --data-path file is scored once, in order, at any layout. A pretraining file
is one token stream (its documents as written, end-of-document tokens included) cut into windows
of seq_length + 1 tokens sharing one token with the next, the last one shorter and padded with
labels that score nothing: every token but the file's first is predicted once, so a file of n
tokens scores n - 1. With --sft each conversation is read once (packed or not) and its assistant
tokens are scored, within --seq-length as --sft-truncation says. The global batches are cut into
micro-batches as in training, and the last one is padded with samples that score nothing. The
loss of a task is the sum of its token losses over its scored tokens, so it does not depend on
the layout, the batch size or packing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paratron.checkpoint.load import load_model_weights
from paratron.checkpoint.model_of import paratron_checkpoint
from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config.layout import BatchPlan, Layout, resolve_layout
from paratron.config.loading import override
from paratron.config.schema import Config
from paratron.data.build import cache_root, evaluation_sources
from paratron.data.datasets import SampleSource
from paratron.data.loader import DocumentLayout, micro_batches
from paratron.data.sft.packing import SFTSample
from paratron.distributed import comm
from paratron.distributed.init import initialize, shutdown
from paratron.distributed.topology import Axis, worker_topology
from paratron.model.batch import IGNORE_INDEX, Batch
from paratron.model.gpt import GPT
from paratron.parallel.model import ParallelModel
from paratron.parallel.parallelize import parallelize
from paratron.storage import write_text_atomic

DOCUMENT_SETTINGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
"""How the trained run read the documents of its samples; evaluation reads them the same way."""


class _Whole:
    """A task's samples (`SFTSample`s: conversations, or `StreamWindows` of a file), then padding
    samples that score nothing up to a whole number of global batches."""

    def __init__(self, source: SampleSource, seq_length: int, global_batch_size: int) -> None:
        self.source, self.seq_length = source, seq_length
        self.size = -(-len(source) // global_batch_size) * global_batch_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> SFTSample:
        if k < len(self.source):
            return self.source[k]
        single = np.zeros(self.seq_length, dtype=np.int64)
        positions = np.arange(self.seq_length, dtype=np.int64)
        return SFTSample(single, np.full(self.seq_length, IGNORE_INDEX, dtype=np.int64), positions, single)


def task_loss_sums(
    model: ParallelModel, tasks: dict[str, Iterable[list[Batch]]], device: torch.device
) -> tuple[list[float], list[float]]:
    """Per task, the summed token loss and the trained tokens of its global batches (each this
    rank's micro-batches), summed over every rank's share: the per-token loss of a task is the
    first over the second. Every rank takes part."""
    sums = torch.zeros(2, len(tasks), dtype=torch.float64, device=device)  # token-loss sums; trained tokens
    for t, global_batches in enumerate(tasks.values()):
        for batches in global_batches:
            sums[0, t] += model.evaluate(batches).double()
            sums[1, t] += sum(batch.trained_tokens() for batch in batches)
    topology = model.topology
    pp = topology.group(Axis.PP)
    if pp.size > 1:  # losses live on the last stage, token counts on every stage
        sums[1] *= float(topology.pp_rank == pp.size - 1)
        comm.all_reduce(sums, pp)
    comm.all_reduce(sums, topology.group(Axis.DP))
    losses, tokens = sums.tolist()
    return losses, tokens


def whole_batches(
    source: SampleSource, plan: BatchPlan, seq_length: int, device: torch.device
) -> Iterator[list[Batch]]:
    """This rank's micro-batches of each global batch over `source` once, in order, the last one padded with samples
    that score nothing."""
    padded = _Whole(source, seq_length, plan.global_batch_size)
    for first in range(0, len(padded), plan.global_batch_size):
        yield micro_batches(padded, plan, first, device)


def validation_batches(
    config: Config,
    tasks: dict[str, SampleSource],
    plan: BatchPlan,
    documents: DocumentLayout | None,
    number: int,
    device: torch.device,
) -> dict[str, Iterator[list[Batch]]]:
    """Each validation task's global batches in a training run's `number`-th evaluation. As in Megatron-LM, each
    evaluation reads the next --eval-iters batches (the evaluation at step i is number ceil(i / eval_interval) - 1),
    so the order is a pure function of the step. With --sft and no --eval-iters, every evaluation reads each
    validation sample once instead (`whole_batches`)."""
    iters = config.training.eval_batches(config.data.sft)
    if iters is None:
        return {name: whole_batches(source, plan, config.data.seq_length, device) for name, source in tasks.items()}
    first = number * iters * plan.global_batch_size

    def batches(source: SampleSource) -> Iterator[list[Batch]]:
        for i in range(iters):
            yield micro_batches(source, plan, first + i * plan.global_batch_size, device, documents)

    return {name: batches(source) for name, source in tasks.items()}


def evaluate_tasks(
    model: ParallelModel, tasks: dict[str, SampleSource], plan: BatchPlan, seq_length: int, device: torch.device
) -> dict[str, Any]:
    """{"loss", "perplexity", "tokens", "tasks": {name: {"loss", "perplexity", "tokens"}}} over whole tasks
    (each with at least one scored token)."""

    whole = {name: whole_batches(source, plan, seq_length, device) for name, source in tasks.items()}
    losses, tokens = task_loss_sums(model, whole, device)

    def summary(loss_sum: float, count: float) -> dict[str, float]:
        loss = loss_sum / count  # (never 0: `evaluation_sources` refuses a file with nothing to score)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count)}

    result: dict[str, Any] = summary(sum(losses), sum(tokens))
    result["tasks"] = {name: summary(s, n) for name, s, n in zip(tasks, losses, tokens)}
    return result


def run_evaluation(config: Config, output: Path | None, layout: Layout | None = None) -> dict[str, Any]:
    """Evaluate the --load checkpoint (its own model settings) on --data-path; print a line per
    task on rank 0 and write `output` (JSON). `layout` is the one validation worked out (`paratron
    evaluate` passes it, validated with the checkpoint's model); without one it is worked out here, once."""
    owned = not dist.is_initialized()
    ctx = initialize(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    try:
        say = print if ctx.is_main else (lambda *a, **k: None)
        assert config.checkpoint.load is not None
        load = Path(config.checkpoint.load).expanduser()
        info = read_checkpoint(paratron_checkpoint(load, cache_root(config), True, ctx.local_rank, say))
        trained = info.config.data  # (documents are read as training read them)
        documents = {name: getattr(trained, name) for name in DOCUMENT_SETTINGS}
        config = dataclasses.replace(
            config, model=info.config.model, data=dataclasses.replace(config.data, **documents)
        )
        layout = layout or resolve_layout(config, ctx.world_size)
        topology = worker_topology(layout, ctx.world_size, ctx.rank)
        _, vocab, tasks = evaluation_sources(config, ctx.local_rank, say, tokenizer_from_checkpoint(info))
        config = override(config, vocab_size=max(vocab, config.model.vocab_size or 0))
        with torch.device("meta"):
            meta = GPT(config.model)
        model = parallelize(meta, config, topology, ctx.device, layout)
        load_model_weights(info, model.module, whole=topology.size(Axis.PP) == 1)
        plan = layout.batches(topology.dp_rank)
        result = evaluate_tasks(model, tasks, plan, config.data.seq_length, ctx.device)
        for name, task in [*result["tasks"].items(), ("(overall)", result)]:
            say(f"{name}: loss {task['loss']:.6f} | perplexity {task['perplexity']:.3f} | {task['tokens']:,} tokens")
        if output is not None and ctx.is_main:
            write_text_atomic(
                output,
                json.dumps(result, indent=1) + "\n",
                "the evaluation results",
                "free space or choose another --output",
            )
            say(f"wrote {output}")
        return result
    finally:
        if owned:
            shutdown()
