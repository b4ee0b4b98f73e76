"""The one ordered transform from a plain model on the meta device to this rank's `ParallelModel`.

Order (as in torchtitan), each step a module swap or a cut on the meta device until weights exist:

1. context parallelism: attention cores swapped for ones that attend across the ranks that
   split each sequence; tensor/sequence parallelism: linear layers and embeddings swapped for their parallel twins
   (on one rank, the embedding and output layer alone when the vocabulary is padded);
   expert parallelism: each MoE layer keeps this rank's experts and dispatches tokens to the others;
2. activation recomputation: the stack of blocks (or each attention core) swapped for a
   recomputing one;
3. pipeline stage split: what this rank does not run is dropped; under zero-bubble schedules
   the blocks' linear layers are swapped for ones that can defer their weight gradients;
4. weights materialized and initialized (in fp32), each rank initializing just its slice of
   every single-device tensor, from the seed and the tensor's name, drawing only the blocks of
   rows that meet it (never a whole tensor): every layout starts from the same model; then
   cast to bf16/fp16 for mixed precision, or sharded by FSDP2 (ZeRO-3) over fp32 shards
   computing in 16 bits;
5. data parallelism: the gradients' buckets (ZeRO 0-2) and the flat parameter buffers of the
   distributed optimizer (ZeRO 1/2): the dense parameters' over the data-parallel group, the
   experts' over the expert-data-parallel group;
6. the pipeline runtime, handed the gradient synchronizer it reports to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.precision import PRECISION_DTYPES
from paratron.config.schema import Config, ModelConfig
from paratron.distributed.init import synchronize
from paratron.distributed.rng import TENSOR_PARALLEL, TENSOR_PARALLEL_SEED_OFFSET, RNGStates
from paratron.distributed.topology import Axis, RankGroup, Topology
from paratron.errors import ConfigError
from paratron.model.batch import IGNORE_INDEX
from paratron.model.fused_loss import fused_token_losses
from paratron.model.gpt import GPT
from paratron.model.init import init_block_rows, init_rows
from paratron.model.loss import token_losses
from paratron.model.moe import grouped_gemm_available
from paratron.parallel.compile import apply_compile
from paratron.parallel.context.apply import apply_context_parallel
from paratron.parallel.data_parallel.ddp import DataParallelGradients, DataParallelSettings
from paratron.parallel.data_parallel.fully_sharded import held_boxes, local_tensor, shard_fully
from paratron.parallel.data_parallel.param_gather import FlatParameters
from paratron.parallel.expert.apply import ExpertGroups, apply_expert_parallel
from paratron.parallel.fp8 import convert_to_float8, precompute_weight_scales
from paratron.parallel.model import FusedLoss, ParallelModel, TokenLoss
from paratron.parallel.pipeline.p2p import ACTIVATION, GRADIENT, StageComm
from paratron.parallel.pipeline.runtime import PipelineRuntime
from paratron.parallel.pipeline.schedules import Schedule, build_schedule
from paratron.parallel.pipeline.stage import StageLayout, StageRunner, keep_stage
from paratron.parallel.pipeline.zero_bubble import WeightGradStore, defer_weight_gradients
from paratron.parallel.recompute import apply_recompute
from paratron.parallel.sharding import box_size, copy_info, full_shape, param_info, set_info, shard_of
from paratron.parallel.tensor.apply import apply_tensor_parallel, apply_vocab_parallel
from paratron.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratron.parallel.tensor.fused_cross_entropy import output_vocab_start, vocab_parallel_fused_token_losses
from paratron.parallel.tensor.layers import TPContext, VocabParallelOutput, padded_vocab_size


def parallelize(model: GPT, config: Config, topology: Topology, device: torch.device, layout: Layout) -> ParallelModel:
    """`model` is built on the meta device; returns this rank's part, materialized, with what
    trains it. `layout` is the one validation returned (`config.layout.resolve_layout`), passed down."""
    t = config.training
    if (
        config.model.num_experts
        and config.model.moe_grouped_gemm
        and not grouped_gemm_available(device, PRECISION_DTYPES[t.precision])
    ):
        raise ConfigError(
            f"{flag.moe_grouped_gemm}: this device ({device}) has no grouped matmul for {t.precision}; "
            "drop the flag to loop over the experts"
        )
    if topology.size(Axis.CP) > 1:
        apply_context_parallel(model, topology.group(Axis.CP), config.parallel.cp_comm_type)
    token_loss, rng = _model_parallel(model, config, topology, device)
    if t.fp8_format is not None and device.type != "meta":  # (torchao's fp8 layers; a dry run prices them as bf16)
        convert_to_float8(model, t)
    if t.recompute_granularity is not None:
        apply_recompute(model, t.recompute_granularity, t.recompute_method, t.recompute_num_layers, rng)
    stage = _cut_stage(model, layout, topology) if topology.size(Axis.PP) > 1 else None
    if t.compile:
        apply_compile(model, t.compile_backend)
    if not _fully_sharded(config, topology):  # (ZeRO-3 shards on the meta device, then fills only its shards)
        materialize(model, device, t.seed)
    gradients, flat = _data_parallel(model, config, topology, device, stage.runner if stage else None)
    pipeline = None
    if stage is not None:
        pipeline = _pipeline_runtime(stage, config, topology, device, token_loss, gradients)
    fused = _fused_loss(model, config, topology)
    scales = precompute_weight_scales if t.fp8_param_gather else None
    return ParallelModel(model, topology, token_loss, gradients, pipeline, flat, rng, fused, before_gathers=scales)


def parallelize_for_inference(
    model: GPT,
    config: Config,
    topology: Topology,
    ranges: list[range],
    device: torch.device,
    dtype: torch.dtype,
) -> GPT:
    """This rank's part of `model` (on the meta device) for inference: the tensor-parallel swap (no sequence
    parallelism), its pipeline stage of the layer `ranges` cut out, and its memory allocated in `dtype`, empty,
    for a checkpoint's weights (no initialization, no fp32 copy); in eval mode."""
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, sequence_parallel=False))
    _model_parallel(model, config, topology, device, pad_single_rank=False)  # (one process: the unpadded model)
    pp = topology.size(Axis.PP)
    if pp > 1:
        keep_stage(model, StageLayout(pp, 1, topology.pp_rank, ranges), topology.group(Axis.EMBEDDING))
    _allocate(model, device, dtype)  # (shared parameters stay shared: tied embeddings too)
    return model.eval()


def _model_parallel(
    model: GPT, config: Config, topology: Topology, device: torch.device, pad_single_rank: bool = True
) -> tuple[TokenLoss, RNGStates | None]:
    """Step 1's tensor and expert parallelism (see `_tensor_parallel`)."""
    token_loss, rng = _tensor_parallel(model, config, topology, device, pad_single_rank)
    if config.model.num_experts:
        groups = ExpertGroups(topology.group(Axis.EP), topology.group(Axis.EXPERT_TP))
        tp, dispatcher = _tp_context(config, topology), config.parallel.moe_token_dispatcher_type
        apply_expert_parallel(model, groups, tp, dispatcher, rng)
    return token_loss, rng


def _tensor_parallel(
    model: GPT, config: Config, topology: Topology, device: torch.device, pad_single_rank: bool = True
) -> tuple[TokenLoss, RNGStates | None]:
    """Step 1: swap in the tensor-parallel layers (when TP > 1); returns the per-token loss (over
    vocabulary-parallel logits) and the random streams of tensor-parallel regions. On one rank only
    the vocabulary is padded (with `pad_single_rank`, when padding adds rows): the output matmul runs
    on the padded shape, the logits and the loss are the unpadded model's."""
    tp = _tp_context(config, topology)
    divisible_by = config.model.make_vocab_size_divisible_by
    if tp.size == 1:
        vocab = config.model.vocab_size or 0
        if pad_single_rank and padded_vocab_size(vocab, 1, divisible_by) != vocab:
            apply_vocab_parallel(model, tp, divisible_by)
        return token_losses, None
    rng = RNGStates(device)
    rng.add(TENSOR_PARALLEL, config.training.seed + TENSOR_PARALLEL_SEED_OFFSET + tp.rank)
    groups = config.model.num_query_groups
    kv_replicas = topology.create_subgroups(Axis.TP, tp.size // groups, "tp-kv-replicas") if groups < tp.size else None
    apply_tensor_parallel(model, tp, rng, divisible_by, kv_replicas)
    vocab_start = shard_of(model.output.weight).start
    return partial(_vocab_parallel_token_losses, vocab_start=vocab_start, group=tp.group), rng


def _tp_context(config: Config, topology: Topology) -> TPContext:
    return TPContext(
        topology.size(Axis.TP), topology.local_rank(Axis.TP), topology.group(Axis.TP), config.parallel.sequence_parallel
    )


@dataclass
class _Stage:
    """This rank's cut of a pipeline: what runs its chunks, the schedule, the deferred weight gradients."""

    runner: StageRunner
    schedule: Schedule
    store: WeightGradStore | None


def _cut_stage(model: GPT, layout: Layout, topology: Topology) -> _Stage:
    """Step 3: keep this rank's stages of `model` (still on meta); under zero-bubble schedules
    make the blocks' weight gradients deferrable."""
    plan = layout.pipeline
    assert plan.schedule is not None
    schedule = build_schedule(plan.schedule, layout.pp, layout.num_micro_batches, plan.chunks)
    stages = StageLayout(schedule.pp, schedule.chunks, topology.local_rank(Axis.PP), plan.ranges, schedule.v_shape)
    keep_stage(model, stages, topology.group(Axis.EMBEDDING))
    store = None
    if schedule.split_backward:
        # the first stage sends no input gradient back: nothing to hurry, so it keeps a whole backward
        deferred = [i for c in range(stages.chunks) if stages.stage(c) > 0 for i in stages.ranges[stages.stage(c)]]
        if deferred:
            store = WeightGradStore()
            defer_weight_gradients([model.layers[i] for i in deferred], store)
    return _Stage(StageRunner(model, stages), schedule, store)


def _data_parallel(
    model: GPT, config: Config, topology: Topology, device: torch.device, root: nn.Module | None
) -> tuple[DataParallelGradients, list[FlatParameters]]:
    """Steps 4b and 5: the weights in their compute type (or FSDP2-sharded at ZeRO-3, `root`
    being the module whose forward runs them), the gradients' synchronisation, and the flat
    parameter buffer of the distributed optimizer (ZeRO-1/2)."""
    p, cp = config.parallel, topology.size(Axis.CP)
    group = topology.group(Axis.DP_CP)  # (the data-parallel ranks; with CP > 1 also the context-parallel ones)
    dp = group.size
    settings = DataParallelSettings(
        bucket_size=p.gradient_bucket_size(dp),
        overlap_grad_reduce=p.overlap_grad_reduce,
        sync_every_micro_batch=p.ddp_sync_every_micro_batch,
        zero_stage=p.zero_stage,
        overlap_param_gather=p.overlap_param_gather,
        grad_dtype=torch.bfloat16 if p.grad_reduce_in_bf16 else torch.float32,
    )
    compute_dtype = PRECISION_DTYPES[config.training.precision]
    units = None
    if _fully_sharded(config, topology):
        dense, experts = topology.group(Axis.DP), topology.group(Axis.EXPERT_DP)
        separate = config.model.num_experts and experts.ranks != dense.ranks
        expert_group = experts if separate else None
        units = shard_fully(model, dense, device, root, compute_dtype, settings.grad_dtype, expert_group)
        materialize_shards(model, device, config.training.seed)
    else:
        model.to(compute_dtype)  # (in place: parameters keep their identity, ties and records)
    experts = topology.group(Axis.EXPERT_DP) if config.model.num_experts else None
    gradients = DataParallelGradients(model, group, settings, units, experts, context_size=cp)
    flats = []
    if settings.zero_stage in (1, 2):
        flats = [FlatParameters(model, r, r.group, settings.overlap_param_gather) for r in gradients.reducers]
    return gradients, flats


def _pipeline_runtime(
    stage: _Stage,
    config: Config,
    topology: Topology,
    device: torch.device,
    token_loss: TokenLoss,
    gradients: DataParallelGradients,
) -> PipelineRuntime:
    """Step 6: the runtime of this rank's chunks, reporting to the gradients' synchronisation."""
    # gradients travel in a group of their own, so each kind keeps its order between two ranks
    groups = {
        ACTIVATION: topology.group(Axis.PP),
        GRADIENT: topology.create_subgroups(Axis.PP, stage.schedule.pp, "pp-gradients"),
    }
    divisor = topology.size(Axis.TP) if config.parallel.sequence_parallel else 1
    comm = StageComm(
        groups,
        PRECISION_DTYPES[config.training.precision],
        device,
        config.model.hidden_size,
        divisor,
        config.parallel.variable_seq_lengths,
    )
    return PipelineRuntime(
        stage.runner, stage.schedule, comm, token_loss, gradients, stage.store, partial(synchronize, device)
    )


def _allocate(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Like `Module.to_empty`, but keeping shared parameters shared and their records (floating-point parameters
    in `dtype` when given)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                kind = dtype if dtype is not None and param.is_floating_point() else param.dtype
                new = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device), param.requires_grad)
                copy_info(param, new)
                made[id(param)] = new
            module._parameters[key] = made[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device=device)


def _fused_loss(model: GPT, config: Config, topology: Topology) -> FusedLoss | None:
    """--cross-entropy-loss-fusion: the loss that applies `model`'s output layer itself (vocabulary-parallel under
    tensor parallelism); None without the flag."""
    if not config.training.cross_entropy_loss_fusion:
        return None
    if topology.size(Axis.TP) > 1 or isinstance(model.output, VocabParallelOutput):  # (padded on one rank too)
        start = output_vocab_start(model.output) if model.output is not None else 0  # (None: not the last stage)
        return partial(_vocab_parallel_fused, model=model, vocab_start=start)
    return partial(_single_device_fused, model=model)


def _single_device_fused(hidden: torch.Tensor, labels: torch.Tensor, model: GPT) -> torch.Tensor:
    return fused_token_losses(hidden, model.output.weight, labels)  # (read at each call: materializing swaps it)


def _vocab_parallel_fused(hidden: torch.Tensor, labels: torch.Tensor, model: GPT, vocab_start: int) -> torch.Tensor:
    return vocab_parallel_fused_token_losses(hidden, labels, model.output, vocab_start)


def _vocab_parallel_token_losses(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: RankGroup
) -> torch.Tensor:
    trained = labels != IGNORE_INDEX
    return vocab_parallel_cross_entropy(logits, labels.masked_fill(~trained, 0), vocab_start, group) * trained


def _fully_sharded(config: Config, topology: Topology) -> bool:
    """ZeRO-3 in effect: FSDP2 over more than one data-parallel rank (or expert-data-parallel one)."""
    sharded = topology.size(Axis.DP_CP) > 1 or (bool(config.model.num_experts) and topology.size(Axis.EXPERT_DP) > 1)
    return config.parallel.zero_stage == 3 and sharded


def materialize_shards(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """ZeRO-3: allocate only this rank's FSDP2 shards and fill each from the blocks of its tensor's
    single-device init that meet it: a rank never holds more than its shards and one block."""
    records = {
        (id(m), key): param_info(p) for m in model.modules() for key, p in m._parameters.items() if p is not None
    }
    model.to_empty(device=device)  # (FSDP2's own path from the meta device: the shards, ties kept)
    for module in model.modules():  # (the conversion may swap a parameter's attributes away with its storage)
        for key, param in module._parameters.items():
            if param is not None:
                set_info(param, records[(id(module), key)])
    if torch.device(device).type == "meta":
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_from_init(name, param, model.config, seed)
        for buffer in model.buffers():
            buffer.zero_()


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """Allocate the weights on `device` and give each parameter its part of the single-device init
    (on the meta device there is nothing to initialize: the shapes are the dry run's result)."""
    _allocate(model, device)
    if torch.device(device).type == "meta":
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_from_init(name, param, model.config, seed)
        for buffer in model.buffers():  # (the MoE router's expert bias and load counters start at zero)
            buffer.zero_()


@torch.no_grad()
def fill_from_init(name: str, param: torch.Tensor, config: ModelConfig, seed: int) -> None:
    """Write what this rank holds of parameter `name` (`held_boxes`: tensor-, expert- and
    FSDP2-parallel parts) into its local tensor, from the single-device init drawn one block of
    rows at a time, so no rank allocates the whole tensor; padding no box covers is zero."""
    local = local_tensor(param)
    shape = full_shape(param)
    if local.dim() == 0:
        init_rows(name, shape, slice(None), local, config, seed)
        return
    pairs = held_boxes(param)
    if sum(box_size(mine) for _, mine in pairs) < local.numel():
        local.zero_()  # (vocabulary padding)
    step = init_block_rows(name, shape)
    needed = sorted({b for whole, _ in pairs for b in range(whole[0].start // step, -(-whole[0].stop // step))})
    if not needed:
        return
    buffer = local.new_empty((min(step, shape[0]), *shape[1:]))  # (one block, reused)
    for block in needed:
        first, last = block * step, min((block + 1) * step, shape[0])
        values = buffer[: last - first]
        init_rows(name, shape, slice(first, last), values, config, seed)
        for whole, mine in pairs:
            lo, hi = max(whole[0].start, first), min(whole[0].stop, last)
            if lo < hi:
                shift = mine[0].start - whole[0].start
                local[(slice(lo + shift, hi + shift), *mine[1:])] = values[(slice(lo - first, hi - first), *whole[1:])]
