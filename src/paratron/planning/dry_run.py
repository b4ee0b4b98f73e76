"""`paratron train --dry-run --world-size N`: every rank role of a run, built for real on the
meta device, and its memory.

For each pipeline rank (ranks of one pipeline stage hold tensors of the same shapes, whatever
their tensor-, context-, expert- or data-parallel coordinates: the shards are equal by
construction), this process joins a fake world of N ranks as that stage's first rank, creates
the topology's process groups, builds the model on the meta device and hands it to the real
`parallelize` and `build_optimizer`; one optimizer step on meta tensors creates the optimizer
state. The training state is then counted by the same ledger `--log-memory` uses
(`parallel/data_parallel/state_memory.py`), so weights, gradients, master weights and optimizer state are
those of the built shards, not of a second copy of the sharding rules. Activations and
communication buffers come from the formulas of `planning/activations.py`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.schema import Config
from paratron.config.validation import validate
from paratron.data.build import DEFAULT_BPE_VOCAB, MOCK_VOCAB
from paratron.data.tokenizer import tokenizer_for
from paratron.distributed.fake import fake_world
from paratron.distributed.init import peak_memory_bytes
from paratron.distributed.topology import Topology
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.model.registry import count_parameters
from paratron.optim.build import build_optimizer
from paratron.optim.master_weights import MasterWeightsOptimizer
from paratron.parallel.data_parallel.state_memory import training_state_elements
from paratron.parallel.model import ParallelModel
from paratron.parallel.parallelize import parallelize
from paratron.planning.activations import CPU, CUDA, Kernels, activation_peak, buffer_bytes
from paratron.planning.calibration import device_memory_gb, read_calibration
from paratron.planning.hardware import hardware_from
from paratron.planning.memory_prediction import CATEGORIES, RankMemory
from paratron.planning.vision import images_per_micro_batch

META = torch.device("meta")
BPE = "ByteLevelBPE"
"""The tokenizer a run trains on its data when none is named."""


def with_vocabulary(config: Config) -> Config:
    """`config` with the vocabulary size a run would find: --vocab-size, mock data's, the named
    tokenizer's, or the size a trained BPE aims for."""
    m, d = config.model, config.data
    if m.vocab_size:
        return config
    if d.mock_data:
        vocab = MOCK_VOCAB
    elif d.resolved_tokenizer_type != BPE:
        vocab = tokenizer_for(d, None).vocab_size
    else:
        vocab = DEFAULT_BPE_VOCAB
    return replace(config, model=replace(m, vocab_size=vocab))


def _has_source(config: Config) -> bool:
    """Whether any data source is given (the dry run reads none, but its vocabulary may come from it)."""
    d = config.data
    return bool(d.blend_flags() or d.corpus or d.mock_data)


def _first_step(model: ParallelModel, optimizer: MasterWeightsOptimizer) -> None:
    """What the first step leaves behind: gradients taken by the optimizer, and its state."""
    optimizer.prepare_grads()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:  # (on meta nothing backward would fill exists yet)
                param.grad = torch.zeros_like(param)
    optimizer.step()


def build_role(config: Config, layout: Layout, stage: int) -> tuple[dict[str, int], int, int]:
    """The training-state bytes per category of the first rank of pipeline stage `stage`, built
    through `parallelize` on the meta device in a fake world of `layout.world_size` ranks; also
    the elements it trains and its largest layer's (before ZeRO-3 sharding)."""
    dims = layout.dims
    rank = dims.rank_of(pp=stage)
    with fake_world(layout.world_size, rank):
        topology = Topology(dims, rank)
        topology.create_groups()
        with META:
            model = GPT(config.model)
        parallel = parallelize(model, config, topology, META, layout)
        optimizer = build_optimizer(parallel, config.optimizer)
        _first_step(parallel, optimizer)
        counted = training_state_elements(parallel, optimizer)
        trained = sum(q.numel() for q in parallel.trained_parameters)
        layers = [sum(q.numel() for q in layer.parameters()) for layer in parallel.module.layers if layer is not None]
        del model, parallel, optimizer
        gc.collect()  # (FSDP's state must go before the world it was built in)
    state = {c: counted[c]["bytes"] for c in ("parameters", "gradients", "master", "optimizer_state")}
    return state, trained, max(layers, default=0)


def dry_run(
    config: Config, layout: Layout, kernels: Kernels, progress: Callable[[int], None] | None = None
) -> list[RankMemory]:
    """Each pipeline stage's memory per rank (see the module docstring); `config` has its vocabulary."""
    roles = []
    for stage in range(layout.pp):
        state, trained, largest = build_role(config, layout, stage)
        roles.append(
            RankMemory(
                stage=stage,
                ranks=layout.world_size // layout.pp,
                activations=activation_peak(config, layout, stage, kernels),
                buffers=buffer_bytes(config, layout, stage, kernels, trained, largest),
                **state,
            )
        )
        if progress is not None:
            progress(stage)
    return roles


def kernels_for(hardware: str | None) -> Kernels:
    """The kernels of the devices planned for: --hardware's (a GPU preset: CUDA's), else this machine's."""
    if hardware is None:
        return CUDA if torch.accelerator.is_available() else CPU
    return CPU if hardware == "cpu" else CUDA


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f}"


def format_roles(roles: list[RankMemory], device_gb: float | None) -> list[str]:
    """The per-stage table of `paratron train --dry-run` (GB = 10^9 bytes)."""
    header = ["stage", "ranks", "params", "grads", "master", "optim", "activations", "buffers", "total"]
    if device_gb:
        header.append(f"of {device_gb:g} GB")
    rows = []
    for role in roles:
        row = [str(role.stage), f"{role.ranks:,}"]
        row += [_gb(getattr(role, c)) for c in CATEGORIES] + [_gb(role.total)]
        if device_gb:
            row.append(f"{role.total / (device_gb * 1e9):.0%}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]


def run_dry_run(config: Config) -> int:
    """`paratron train --dry-run`: validate `config` for --world-size ranks, build each rank role
    on the meta device, print its memory, and fail (ConfigError) when a rank does not fit."""
    world = config.planning.world_size or config.parallel.nproc_per_node * config.parallel.nnodes
    guessed = not (config.model.vocab_size or _has_source(config)) and config.data.resolved_tokenizer_type == BPE
    config = with_vocabulary(config)
    layout = validate(config, world, needs_source=False)  # (it reads no data: none need be given)
    planning = config.planning
    device_gb = planning.device_memory_gb
    if device_gb is None and planning.calibration is not None:
        device_gb = device_memory_gb(read_calibration(planning.calibration), min(world, 8))
    if device_gb is None and planning.hardware is not None:
        device_gb = hardware_from(planning, gpus_per_node=min(world, 8)).device_memory_gb
    kernels = kernels_for(planning.hardware)
    started = time.perf_counter()
    roles = dry_run(config, layout, kernels)
    elapsed = time.perf_counter() - started
    dims = layout.dims
    n_params = count_parameters(config.model)
    images = images_per_micro_batch(config, config.training.micro_batch_size) if config.model.has_vision else 0
    print(
        f"dry run: {Topology(dims).describe()}; {n_params / 1e9:,.2f}B parameters, {config.training.precision}, "
        f"ZeRO stage {config.parallel.zero_stage}, {layout.num_micro_batches} micro-batch(es) of "
        f"{config.training.micro_batch_size} x {config.data.seq_length} tokens per rank"
        + (
            f" and {images} image(s) ({flag.plan_images_per_sample} {planning.plan_images_per_sample})"
            if images
            else ""
        )
        + f", {kernels.name} kernels"
    )
    print("memory per rank (GB = 10^9 bytes), one line per pipeline stage (its ranks hold tensors of the same shapes):")
    for line in format_roles(roles, device_gb):
        print("  " + line)
    print(
        f"built {len(roles)} rank role(s) on the meta device through parallelize in {elapsed:.1f}s; "
        f"peak resident memory of this process {peak_memory_bytes(torch.device('cpu')) / 2**20:,.0f} MiB"
    )
    worst = max(roles, key=lambda role: role.total)
    if device_gb is not None and worst.total > device_gb * 1e9:
        raise ConfigError(
            f"pipeline stage {worst.stage} needs {_gb(worst.total)} GB per rank, more than the {device_gb:g} GB of "
            f"{flag.device_memory_gb if planning.device_memory_gb else flag.hardware}; shard more (tensor, pipeline, "
            "ZeRO stage), recompute, or lower the micro-batch size: `paratron plan` finds a layout that fits"
        )
    if guessed:
        print(
            f"(no data was given: counted with a vocabulary of {config.model.vocab_size:,}, what a trained {BPE} "
            f"tokenizer aims for; give {flag.vocab_size} or your tokenizer's flags for yours)"
        )
    if device_gb is not None:
        share = worst.total / (device_gb * 1e9)
        print(f"fits: the fullest rank (stage {worst.stage}) uses {share:.0%} of {device_gb:g} GB")
    return 0
