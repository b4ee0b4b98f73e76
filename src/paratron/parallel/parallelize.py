"""The one ordered transform from a plain model on the meta device to this rank's parallel model.

Order (as in torchtitan): tensor/sequence parallelism -> activation recomputation ->
pipeline stage split -> weights materialized and initialized (in fp32, then cast to bf16/fp16
for mixed precision) -> data parallelism (bucketed fp32 gradient reduction; ZeRO-1/2 flat
parameter buffer, or ZeRO-3 FSDP2 units over fp32 shards computing in 16 bits).
Weights are created only after the layout is known, each rank initializing just its slice
of every single-device tensor, from the seed and the tensor's name: every layout starts
from the same model.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from paratron.config.schema import Config
from paratron.distributed.rng import TENSOR_PARALLEL, TENSOR_PARALLEL_SEED_OFFSET, RNGStates
from paratron.distributed.topology import Topology
from paratron.model.gpt import GPT, init_parameter
from paratron.distributed.init import synchronize
from paratron.parallel.data import DataParallel, DataParallelSettings
from paratron.parallel.data.fully_sharded import shard_fully
from paratron.parallel.pipeline.p2p import ACTIVATION, GRADIENT, StageComm
from paratron.parallel.pipeline.runtime import PipelineRuntime
from paratron.parallel.pipeline.stage import StageLayout, StageRunner, keep_stage, plan_pipeline, stage_ranges
from paratron.parallel.pipeline.zero_bubble import WeightGradStore, defer_weight_gradients
from paratron.parallel.recompute import apply_recompute
from paratron.parallel.sharding import full_shape, shard_of, take_slice
from paratron.parallel.tensor.apply import apply_tensor_parallel
from paratron.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratron.parallel.tensor.layers import TPContext
from paratron.model.loss import language_model_loss
from paratron.optim.mixed_precision import DTYPES


def parallelize(model: GPT, config: Config, topology: Topology, device: torch.device) -> DataParallel:
    """`model` is built on the meta device; returns this rank's part, materialized and wrapped."""
    seed = config.training.seed
    tp = TPContext(topology.size("tp"), topology.local_rank("tp"), topology.group("tp"),
                   config.parallel.sequence_parallel)
    loss_function, rng = language_model_loss, None
    if tp.size > 1:
        rng = RNGStates(device)
        rng.add(TENSOR_PARALLEL, seed + TENSOR_PARALLEL_SEED_OFFSET + tp.rank)
        groups = config.model.num_query_groups or config.model.num_attention_heads
        kv_replicas = topology.create_subgroups("tp", tp.size // groups) if groups < tp.size else None
        apply_tensor_parallel(model, tp, rng, config.model.make_vocab_size_divisible_by, kv_replicas)
        vocab_start = shard_of(model.output.weight).start
        loss_function = partial(_vocab_parallel_loss, vocab_start=vocab_start, group=tp.group)
    t = config.training
    compute_dtype = DTYPES[t.precision]
    if t.recompute_granularity is not None:
        apply_recompute(model, t.recompute_granularity, t.recompute_method, t.recompute_num_layers, rng)
    pipeline = None
    if topology.size("pp") > 1:
        pipeline = _split_pipeline(model, config, topology, device, loss_function, compute_dtype)
    materialize(model, device, seed)
    p = config.parallel
    dp = topology.size("dp")
    settings = DataParallelSettings(bucket_size=p.ddp_bucket_size or max(40_000_000, 1_000_000 * dp),
                                    overlap_grad_reduce=p.overlap_grad_reduce,
                                    sync_every_micro_batch=p.ddp_sync_every_micro_batch, zero_stage=p.sharding_stage,
                                    overlap_param_gather=p.overlap_param_gather)
    units = None
    if settings.zero_stage == 3 and dp > 1:
        units = shard_fully(model, topology.group("dp"), device, pipeline.runner if pipeline is not None else None,
                            compute_dtype)
    else:
        model.to(compute_dtype)  # (in place: parameters keep their identity, ties and tags)
    wrapped = DataParallel(model, topology.group("dp"), dp, loss_function, tp.group, tp.size, rng,
                           model_group=topology.group("model"), pipeline=pipeline, settings=settings,
                           sharded_units=units)
    if pipeline is not None:
        pipeline.grad_sync = wrapped.require_grad_sync
        if pipeline.store is not None and wrapped.reducer is not None:
            pipeline.store.on_accumulated = wrapped.reducer.grad_ready
    return wrapped


def _split_pipeline(model: GPT, config: Config, topology: Topology, device: torch.device,
                    loss_function, compute_dtype: torch.dtype) -> PipelineRuntime:
    """Keep this rank's stages of `model` (still on meta) and build the runtime that runs them."""
    plan = plan_pipeline(config, topology.size("dp"))
    schedule = plan.schedule
    assert schedule is not None
    pp = schedule.pp
    layout = StageLayout(pp, schedule.chunks, topology.local_rank("pp"), stage_ranges(plan.counts), schedule.v_shape)
    keep_stage(model, layout, topology.group("embedding"))
    store = None
    if schedule.split_backward:
        # the first stage sends no input gradient back: nothing to hurry, so it keeps a whole backward
        deferred = [i for c in range(layout.chunks) if layout.stage(c) > 0 for i in layout.ranges[layout.stage(c)]]
        if deferred:
            store = WeightGradStore()
            defer_weight_gradients([model.layers[i] for i in deferred], store)
    # gradients travel in a group of their own, so each kind keeps its order between two ranks
    groups = {ACTIVATION: topology.group("pp"), GRADIENT: topology.create_subgroups("pp", pp)}
    comm = StageComm(groups, compute_dtype, device, config.parallel.variable_seq_lengths)
    divisor = topology.size("tp") if config.parallel.sequence_parallel else 1
    return PipelineRuntime(StageRunner(model, layout), schedule, comm, topology.ranks("pp"), loss_function,
                           config.model.hidden_size, divisor, store, synchronize=partial(synchronize, device))


def _allocate(model: nn.Module, device: torch.device | str) -> None:
    """Like `Module.to_empty`, but keeping shared parameters shared and their tags (`shard`, ...)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad)
                new.__dict__.update(param.__dict__)
                made[id(param)] = new
            module._parameters[key] = made[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device=device)


def _vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, labels, vocab_start, group).mean()


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """Allocate the weights on `device` and give each parameter its slice of the single-device init."""
    _allocate(model, device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.empty(full_shape(param), device=param.device, dtype=param.dtype)
            init_parameter(name, full, model.config, seed)
            param.copy_(take_slice(full, param))
