"""Assemble a training run from a validated Config, run it, and report.

Order: process group -> topology -> the layout -> data (tokenizer, samples; the tokenizer
completes the config with its vocabulary, the one value a config leaves open) -> model (meta)
-> parallelize (initialized from the seed) -> optimizer -> resume -> train -> plot, sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.checkpoint.gather import whole_model_state
from paratron.checkpoint.load import load_model_weights
from paratron.checkpoint.lock import SaveLock, held_by_the_launcher
from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import CheckpointInfo
from paratron.config.layout import Layout, resolve_layout
from paratron.config.loading import override
from paratron.config.precision import PRECISION_DTYPES
from paratron.config.schema import Config
from paratron.data.build import build_data, cache_root
from paratron.data.tokenizer import Tokenizer
from paratron.debugging.batches import BatchSource, dump_batches
from paratron.distributed.init import (
    DistributedContext,
    attention_kernel_priority,
    deterministic_algorithms,
    initialize,
    job_store,
    raise_any_failure,
    seed_everything,
    shutdown,
)
from paratron.distributed.parent import expected_parent
from paratron.distributed.topology import Axis, Topology, worker_topology
from paratron.distributed.watchdog import Watchdog
from paratron.errors import CheckpointError
from paratron.inference.generate import generate
from paratron.model.attention_kernel import attention_kernel
from paratron.model.gpt import GPT, build_model
from paratron.optim.build import build_optimizer
from paratron.parallel.parallelize import parallelize
from paratron.training.flops import peak_flops, training_flops_per_token
from paratron.training.loop import Trainer
from paratron.training.metrics import MetricsWriter, ProgressLog
from paratron.training.plot import plot_loss_curve
from paratron.training.preflight.checkpoint import uses_saved_tokenizer
from paratron.training.profiling import manual_gc
from paratron.training.resume import ResumePlan, TrainState, plan_resume


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def run_training(config: Config, layout: Layout | None = None) -> TrainState:
    """Train as configured on this process's rank; returns the final state (all ranks). `layout` is the one
    the settings' validation worked out for this world (`paratron train` passes it); without one (library
    use) it is worked out here, once. A process group the caller started is used and left running; one
    started here is shut down."""
    owned = not dist.is_initialized()
    ctx = initialize(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    try:
        layout = layout or resolve_layout(config, ctx.world_size)
        with _save_lock(config, ctx), deterministic_algorithms(config.training.deterministic_mode, ctx.device):
            return _run(config, ctx, layout)
    finally:
        if owned:
            shutdown()


@contextlib.contextmanager
def _save_lock(config: Config, ctx: DistributedContext) -> Iterator[None]:
    """One job writes in --save at a time (checkpoint/lock.py): a launcher holds the lock for its
    workers; without one, rank 0 takes it and the other ranks wait to hear that it did."""
    save = config.checkpoint.save
    if save is None or held_by_the_launcher():
        yield
        return
    lock, failure = None, None
    if ctx.is_main:
        try:
            lock = SaveLock(Path(save)).acquire()
        except CheckpointError as exc:
            failure = exc
    raise_any_failure(failure, f"rank 0 could not take the lock of {save}")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _run(config: Config, ctx: DistributedContext, layout: Layout) -> TrainState:
    started = time.perf_counter()
    p = config.parallel
    topology = worker_topology(layout, ctx.world_size, ctx.rank)
    say = print if ctx.is_main else (lambda *a, **k: None)
    peak, peak_source = peak_flops(ctx.device, config.logging.peak_tflops, config.training.precision)
    trainer, plan, n_params = _assemble(config, ctx, topology, layout, peak, say)
    config = trainer.config  # (completed with the tokenizer's vocabulary)
    _describe(trainer, plan.checkpoint, n_params, peak_source, say)
    if config.logging.dump_batches and ctx.is_main:  # (the other ranks go on: the dump reads, it consumes nothing)
        say(f"batches: {_dump_batches(trainer)}")
    watchdog = None
    if ctx.world_size > 1:
        timeout = 60 * p.distributed_timeout_minutes
        watchdog = Watchdog(timeout, ctx.rank, ctx.world_size, job_store(), parent=expected_parent())
        trainer.watchdog = watchdog
    if config.logging.log_progress and config.checkpoint.save:
        tokens = trainer.state.consumed_samples * config.data.seq_length
        trainer.progress = ProgressLog(
            Path(config.checkpoint.save), ctx.world_size, trainer.flops_per_token * tokens, ctx.is_main
        )
    priority = attention_kernel_priority(ctx.device)  # (cuDNN, then flash attention, first on Hopper and newer)
    with trainer.writer, watchdog or contextlib.nullcontext(), manual_gc(config.training), priority:
        dtype = PRECISION_DTYPES[config.training.precision]
        say(f"attention: {attention_kernel(config.model, config.data.seq_length, ctx.device, dtype)}")
        state = trainer.fit()
        trainer.instruments.finish_profile()
    if ctx.is_main:
        source = config.data.corpus or ("mock data" if config.data.mock_data else "--data-path")
        title = f"{n_params / 1e6:.2f}M-parameter model on {source}; {topology.describe()}"
        _report(config, state, Path(config.logging.run_dir), time.perf_counter() - started, title, say)
        if trainer.data.truncated is not None and trainer.data.truncated[0]:
            cut, total = trainer.data.truncated
            say(
                f"truncated: {cut} of {total} training conversations were longer than --seq-length "
                f"{config.data.seq_length} and were cut to it (--no-truncate refuses them)"
            )
    tokenizer = trainer.data.tokenizer
    if config.logging.sample_prompt and isinstance(tokenizer, Tokenizer):
        weights = whole_model_state(trainer.model.module, topology)  # collective: all take part
        if ctx.is_main:
            single = build_model(config.model, ctx.device, seed=config.training.seed)
            single.load_state_dict(weights, strict=False)  # strict=False: the tied output weight
            _print_sample(config, single, tokenizer, say)
    if dist.is_initialized():
        dist.barrier()
    return state


def _assemble(
    config: Config,
    ctx: DistributedContext,
    topology: Topology,
    layout: Layout,
    peak: float,
    say: Callable[[str], None],
) -> tuple[Trainer, ResumePlan, int]:
    """Data, model, optimizer and trainer, going on where the resume plan says; also the plan and
    the single-device parameter count."""
    t = config.training
    plan = plan_resume(config, cache_root(config), ctx.local_rank, say)
    resume = plan.checkpoint
    saved_tokenizer = tokenizer_from_checkpoint(resume) if uses_saved_tokenizer(config, resume) else None
    data = build_data(config, layout.global_batch_size, ctx.local_rank, log=say, saved_tokenizer=saved_tokenizer)
    config = override(config, vocab_size=data.vocab_size)  # complete: the tokenizer decides the vocabulary
    if data.image_token_id is not None:  # (and which token stands for an image's features)
        config = override(config, image_token_id=data.image_token_id)
    with torch.device("meta"):
        meta = GPT(config.model)
    n_params = sum(q.numel() for q in meta.parameters())
    model = parallelize(meta, config, topology, ctx.device, layout)
    if resume is not None:  # (before the optimizer takes its masters)
        load_model_weights(resume, model.module, whole=topology.size(Axis.PP) == 1, grow=config.model.add_image_token)
    optimizer = build_optimizer(model, config.optimizer)
    seed_everything(t.seed + 100 * topology.pp_rank)  # dropout; weights and data have their own seeds
    state = plan.initial_state()
    writer = MetricsWriter(
        Path(config.logging.run_dir),
        t.train_iters,
        state.iteration,
        enabled=ctx.is_main,
        progress_bar=config.logging.progress_bar,
        tensorboard=config.logging.tensorboard,
        logging=config.logging,
        settings=dataclasses.asdict(config) if config.logging.wandb_project and ctx.is_main else None,
    )
    trainer = Trainer(
        config,
        ctx,
        topology,
        layout,
        model,
        optimizer,
        data,
        writer,
        training_flops_per_token(config.model, config.data.seq_length),
        peak,
        state,
    )
    trainer.restore(plan)
    return trainer, plan, n_params


def _describe(
    trainer: Trainer, resume: CheckpointInfo | None, n_params: int, peak_source: str, say: Callable[[str], None]
) -> None:
    config, ctx, peak = trainer.config, trainer.ctx, trainer.peak_flops
    t, m, c = config.training, config.model, config.checkpoint
    say(f"paratron: {trainer.topology.describe()} on {ctx.backend}/{ctx.device.type}, {t.precision}")
    say(
        f"model: {n_params / 1e6:.2f}M parameters ({m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_attention_heads} heads, vocab {m.vocab_size}); global batch {trainer.global_batch_size} x "
        f"{config.data.seq_length} tokens = {trainer.plan.num_micro_batches} micro-batch(es) of "
        f"{t.micro_batch_size} per rank; peak {peak / 1e12:.3f} TFLOP/s/device ({peak_source})"
    )
    trained = sum(q.numel() for q in trainer.model.trained_parameters)
    if m.lora_rank is not None:
        what = "adapter and projector parameters" if m.has_vision else "adapter parameters"
        say(
            f"LoRA rank {m.lora_rank}, alpha {m.lora_alpha:g} on {','.join(m.lora_targets)}: "
            f"{trained:,} {what} train on this rank; every other weight is frozen"
        )
    elif m.has_vision:
        frozen = [
            part for part, on in (("encoder", m.freeze_vision_model), ("language model", m.freeze_language_model)) if on
        ]
        say(
            f"vision: {m.vision_model or 'own encoder'} ({m.vision_num_layers} layers, width {m.vision_hidden_size}, "
            f"{m.image_tokens} tokens per image); {trained:,} parameters train on this rank"
            + (f" (frozen: {', '.join(frozen)})" if frozen else "")
        )
    if resume is not None:
        how = (
            "its weights only (--finetune)"
            if c.finetune
            else "its weights (a converted model)"
            if resume.weights_only
            else f"step {resume.iteration}" + (", fresh optimizer state (--no-load-optim)" if c.no_load_optim else "")
        )
        if m.has_vision and not resume.config.model.has_vision:
            grown = m.vocab_size - resume.config.model.vocab_size if m.add_image_token else 0
            rows = (
                f"; {grown} vocabulary row(s) added, each the mean of the old (--add-image-token)" if grown > 0 else ""
            )
            say(f"vision: a text checkpoint: the encoder and projector start from their initialization{rows}")
        for problem in resume.passed_over:
            say(f"warning: passed over a damaged checkpoint: {problem}")
        say(f"loaded {resume.path}: {how}")


def _dump_batches(trainer: Trainer) -> Path:
    """--dump-batches N: the next N global batches the run trains on, decoded, into the run directory."""
    config, data, ramp = trainer.config, trainer.data, trainer.ramp
    source = BatchSource(
        data.train,
        trainer.layout,
        ramp.batch_at if ramp is not None else lambda _: trainer.global_batch_size,
        trainer.documents,
        data.tokenizer,
        data.image_token_id,
    )
    state = trainer.state
    run_dir = Path(config.logging.run_dir)
    return dump_batches(source, config.logging.dump_batches, state.consumed_samples, run_dir, state.iteration + 1)


def _report(config: Config, state: TrainState, run_dir: Path, elapsed: float, title: str, say) -> None:
    plot = plot_loss_curve(run_dir, title)
    line = f"done: {state.iteration} steps in {_duration(elapsed)}"
    if state.losses:
        line += f" | final train loss {state.losses[-1]:.4f}"
    if state.val_losses:
        line += f" | validation loss {state.val_losses[-1]:.4f}"
    say(line)
    if config.checkpoint.save:
        say(f"checkpoint: {Path(config.checkpoint.save) / f'iter_{state.iteration:07d}'}")
    say(f"metrics: {run_dir / 'metrics.jsonl'} | loss curve: {plot}")


def _print_sample(config: Config, model, tokenizer, say) -> None:
    prompt = config.logging.sample_prompt or ""
    temperature = config.logging.sample_temperature
    ids = generate(
        model,
        tokenizer.encode(prompt),
        config.logging.sample_tokens,
        temperature=temperature,
        top_k=40,
        eos_id=tokenizer.stop_ids,
        seed=config.training.seed,
    )
    ids = ids[:-1] if ids and ids[-1] in tokenizer.stop_ids else ids
    how = "greedy" if temperature <= 0 else f"temperature {temperature:g}, top-k 40"
    say(f"sample ({how}) continuing the prompt:")
    say("-" * 60)
    say(prompt + tokenizer.decode(ids))
    say("-" * 60)
