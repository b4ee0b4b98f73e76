"""Engines from checkpoints (`open_engine`) and from models already built (`engine_for_model`).

A checkpoint's model is built for inference at the run's tensor x pipeline layout: the plain model on the meta
device, the tensor-parallel swap (without sequence parallelism), this rank's pipeline stage cut out, then memory
allocated in the checkpoint's precision (or the one asked for) and filled from the checkpoint: never initialized
at random nor held in fp32 first. The KV cache takes the memory the settings give it, in the model's precision.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratron.checkpoint.load import load_model_weights, weight_catalog
from paratron.checkpoint.model_of import converting_reader, is_hf_folder, paratron_checkpoint, saved_tokenizer
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint
from paratron.config.fields import flag
from paratron.config.inference import InferenceConfig
from paratron.config.layout import Layout, resolve_layout
from paratron.config.loading import Resolution, override, resolve_settings
from paratron.config.precision import PRECISION_DTYPES
from paratron.config.schema import Config, ModelConfig
from paratron.data.build import Log, cache_root
from paratron.distributed import comm
from paratron.distributed.init import collective_device
from paratron.distributed.topology import Axis, Topology, worker_topology
from paratron.errors import ConfigError
from paratron.inference.engine import Engine
from paratron.inference.kv_cache import PagedKVCache, bytes_per_token
from paratron.inference.paged_attention import key_value_kinds
from paratron.inference.runner import ModelRunner, ReplicaGroups
from paratron.model.fused_linear import few_row_linear, lay_out_stacked
from paratron.model.gpt import GPT
from paratron.model.mlp import Projections
from paratron.parallel.model import ParallelModel
from paratron.parallel.parallelize import parallelize_for_inference
from paratron.parallel.tensor.layers import ColumnParallelProjections

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

DEFAULT_CACHE_TOKENS = 65536
"""The KV cache's size when no setting gives one: room for --max-running-requests requests of the whole context,
but at most this many tokens (and at least one whole context)."""


HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(load: Path, info: CheckpointInfo) -> torch.dtype:
    """The precision a checkpoint's model runs in: a Hugging Face folder's `dtype` (`torch_dtype`); the precision of
    the run that saved a paratron or Megatron-LM checkpoint, or that of its stored weights when they are narrower."""
    if is_hf_folder(load):
        hf = json.loads((load / "config.json").read_text(encoding="utf-8"))
        return HF_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    with weight_catalog(info) as catalog:
        name = "embedding.weight" if "embedding.weight" in catalog.boxes else next(iter(catalog.boxes))
        box = catalog.boxes[name][0]
        stored = SAFETENSORS_DTYPES.get(catalog.handle(box.file).get_slice(box.key).get_dtype(), torch.float32)
    return stored if stored != torch.float32 else PRECISION_DTYPES[info.config.training.precision]


def engine_settings(overrides: dict[str, Any], recipe: str | None, command: str, purpose: str, log: Log) -> Resolution:
    """The settings of a command that runs the engine (`paratron generate | serve | evaluate --tasks`) over the
    model of its --load checkpoint, as a one-step run on mock data for the layout's checks (the engine reads no
    samples). A Hugging Face folder is converted once into the cache and that copy is loaded. `purpose` says what
    the checkpoint is for, in the line that asks for one."""
    resolution = resolve_settings(overrides, recipe, read_checkpoint=converting_reader(log))
    if not resolution.config.checkpoint.load:
        raise ConfigError(f"paratron {command} needs {flag.load} CKPT ({purpose})")
    config = resolution.config
    positions = config.model.max_position_embeddings or config.data.seq_length
    config = override(
        config, eval_iters=0, train_iters=1, lr_warmup_iters=0, finetune=True, mock_data=True, seq_length=positions
    )
    return dataclasses.replace(resolution, config=config)


def open_engine(config: Config, log: Log = print, precision: str | None = None, layout: Layout | None = None) -> Engine:
    """The engine of `config.checkpoint.load` (a paratron or Megatron-LM checkpoint or a Hugging Face folder) at
    `config`'s tensor x pipeline layout over every rank of the process group (collective). The weights keep the
    checkpoint's precision (`checkpoint_dtype`) unless `precision` (fp32, bf16, fp16: the user's flag) says.
    `layout` is the one validation worked out for `config` (the commands pass it); without one it is worked
    out here, once."""
    assert config.checkpoint.load is not None
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    p = config.parallel
    if world != p.tensor_model_parallel_size * p.pipeline_model_parallel_size:
        raise ConfigError(
            f"inference runs one model replica: --nproc {world} must equal --tensor-model-parallel-size "
            f"{p.tensor_model_parallel_size} x --pipeline-model-parallel-size {p.pipeline_model_parallel_size}"
        )
    load = Path(config.checkpoint.load).expanduser()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    info = read_checkpoint(paratron_checkpoint(load, cache_root(config), True, local_rank, log))
    tokenizer = saved_tokenizer(load, info)
    dtype = PRECISION_DTYPES[precision] if precision is not None else checkpoint_dtype(load, info)
    model_config = info.config.model
    if tokenizer is not None and model_config.vocab_size is None:
        model_config = dataclasses.replace(model_config, vocab_size=tokenizer.vocab_size)
    config = dataclasses.replace(config, model=model_config)
    layout = layout or resolve_layout(config, world)
    topology = worker_topology(layout, world, rank)
    device = collective_device()
    with torch.device("meta"):
        model = GPT(model_config)
    model = parallelize_for_inference(model, config, topology, layout.pipeline.ranges, device, dtype)
    load_model_weights(info, model, whole=topology.size(Axis.PP) == 1)
    lay_out_for_decoding(model)
    name = load.name if load.name and not load.name.startswith("iter_") else load.resolve().parent.name
    return _engine(model, model_config, tokenizer, config.inference, _groups(topology), dtype, name)


def engine_for_model(
    model: GPT | ParallelModel,
    tokenizer: object,
    settings: InferenceConfig,
    topology: Topology | None = None,
    model_name: str = "paratron",
    progress: Callable[[], None] | None = None,
    owns_model: bool = False,
) -> Engine:
    """An engine over a model already built: a single-device `GPT`, or this rank's part of a training run's
    `ParallelModel` (with its `topology`; each data-parallel replica runs its own engine). `progress` is called at
    every step and keep-alive, on every rank (`ModelRunner`). `owns_model`: nothing but inference will use the
    model, so it may be laid out for decoding (`lay_out_for_decoding`)."""
    module = model.module if isinstance(model, ParallelModel) else model
    assert isinstance(module, GPT)
    if owns_model:
        lay_out_for_decoding(module)
    groups = _groups(topology) if topology is not None else ReplicaGroups.single()
    dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
    return _engine(module, module.config, tokenizer, settings, groups, dtype, model_name, progress)


def lay_out_for_decoding(model: torch.nn.Module) -> None:
    """A model only inference will use, made faster to decode with the same parameters and values: stacked weights
    in one storage (`keep_projections_stacked`), few-row linear layers (`use_few_row_linears`)."""
    keep_projections_stacked(model)
    use_few_row_linears(model)


def keep_projections_stacked(model: torch.nn.Module) -> None:
    """Each group of projections of one input (queries, keys and values; gate and up) with its weights, and its
    biases, one after another in one storage: the stacked matmul then reads them as they lie, where it would
    concatenate them at every forward (a decoding step's largest overhead on a CPU). LoRA adapters' A matrices
    are not laid out: such groups concatenate as before."""
    for module in model.modules():
        if isinstance(module, (Projections, ColumnParallelProjections)):
            layers = list(module.values())
            for name in ("weight", "bias"):
                params = [getattr(layer, name, None) for layer in layers]
                if all(isinstance(p, torch.Tensor) for p in params):
                    lay_out_stacked(params)


class FewRowLinear(torch.nn.Linear):
    """A linear layer of a model only inference uses: `few_row_linear`, which computes the few rows of a decoding
    step the way the CPU runs faster (the same values up to the order of the sums)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x, self.weight, self.bias)


def use_few_row_linears(model: torch.nn.Module) -> None:
    """Every plain linear layer of `model` outside the stacked projections (which compute their own way) a
    `FewRowLinear`: the same module, retyped, so that its parameters stay its own (a tied output layer tied)."""
    for module in model.modules():
        if isinstance(module, (Projections, ColumnParallelProjections)):
            continue
        for child in module.children():
            if type(child) is torch.nn.Linear and not (child._forward_hooks or child._forward_pre_hooks):
                child.__class__ = FewRowLinear


def _groups(topology: Topology) -> ReplicaGroups:
    return ReplicaGroups(topology.group(Axis.MODEL), topology.group(Axis.TP), topology.group(Axis.PP))


def _engine(
    model: GPT,
    config: ModelConfig,
    tokenizer: object,
    settings: InferenceConfig,
    groups: ReplicaGroups,
    dtype: torch.dtype,
    name: str,
    progress: Callable[[], None] | None = None,
) -> Engine:
    """The KV cache sized from `settings` (the same number of blocks on every rank of the replica), the runner,
    the engine."""
    if config.multi_latent_attention:
        raise ConfigError(
            f"{flag.multi_latent_attention}: the inference engine's key/value cache does not hold multi-latent "
            "attention's keys and values yet; score such a model with paratron evaluate"
        )
    device = next(p.device for p in model.parameters())
    heads = max(1, config.num_query_groups // groups.tensor.size)
    layers = list(key_value_kinds(model))
    per_token = bytes_per_token(len(layers), heads, config.kv_channels, dtype)
    block = settings.kv_block_size
    context = config.max_position_embeddings
    if settings.kv_cache_tokens is not None:
        tokens = settings.kv_cache_tokens
    elif settings.kv_cache_gb is not None:
        tokens = int(settings.kv_cache_gb * 1e9 // per_token)
    else:
        tokens = max(context, min(settings.max_running_requests * context, DEFAULT_CACHE_TOKENS))
    if tokens < block and settings.kv_cache_tokens is None:
        raise ConfigError(f"--kv-cache-gb {settings.kv_cache_gb}: too small for one block of the KV cache; give more")
    blocks = torch.tensor([-(-tokens // block)], device=device)
    if groups.model.size > 1:
        comm.all_reduce(blocks, groups.model, op=dist.ReduceOp.MIN)
    num_blocks = int(blocks)
    cache = PagedKVCache(layers, len(model.layers), num_blocks, block, heads, config.kv_channels, dtype, device)
    runner = ModelRunner(model, groups, cache, config.vocab_size, progress)
    return Engine(runner, tokenizer, settings, context, num_blocks, name)
