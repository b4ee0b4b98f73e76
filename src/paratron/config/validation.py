"""Consistency checks of a whole configuration, run before any worker process starts.

`validate(config, world_size)` checks each section in turn and returns the run's `Layout`.
Each failure is a ConfigError whose one-line message names the flag (taken from the field,
see `fields.flag`) and the fix. These checks read settings only; the files a run will read
are checked by `data.checks` and the training entry point.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Mapping
from typing import Any

from paratron.config.eval_tasks import check_eval_tasks
from paratron.config.faults import parse_faults
from paratron.config.fields import FieldInfo, all_fields, flag
from paratron.config.fim_checks import check_fim
from paratron.config.layout import Layout, check_schedule, resolve_layout
from paratron.config.pattern_checks import check_layer_pattern
from paratron.config.samples import batch_ramp, schedule_lengths, step_schedule
from paratron.config.schema import LORA_TARGETS, Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from paratron.config.vision_checks import check_added_image_token, check_vision_layout, check_vision_model
from paratron.errors import ConfigError


def parse_split(split: str) -> tuple[float, float, float]:
    """'969,30,1' -> normalized (train, valid, test) fractions."""
    parts = [p.strip() for p in split.strip("'\" ").replace("/", ",").split(",")]  # (quotes a script kept)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"{flag.split} {split!r}: expected up to three non-negative numbers such as 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def validate(config: Config, world_size: int, check_data: bool = True, needs_source: bool = True) -> Layout:
    """Raise ConfigError for the first inconsistent setting of a run on `world_size` processes;
    return the run's layout. `check_data=False` skips the data section (for library use that
    brings its own data); `needs_source=False` checks the data settings given but asks for no data
    source (for `--dry-run`, which reads no data)."""
    _check_bounds(config)
    _check_launch(config.parallel)
    _check_precision(config.training)
    _check_model(config.model, config.data)
    check_layer_pattern(config)
    check_vision_model(config.model, config.data.seq_length)
    check_added_image_token(config)
    _check_megatron_model_features(config)
    _check_step_batch_schedule(config, world_size)
    layout = resolve_layout(config, world_size)
    check_vision_layout(config, layout)
    _check_tensor_parallel(config, layout)
    _check_expert_parallel(config, layout)
    _check_context_parallel(config, layout)
    _check_recompute(config.training)
    _check_data_parallel(config, layout)
    _check_lr_schedule(config)
    _check_sample_based(config, layout)
    check_eval_tasks(config, layout)
    _check_debug_capture(config)
    parse_faults(config.training.fault_inject, world_size)
    _check_loss_spikes(config)
    _check_gradient_precision(config)
    check_fp8_settings(config, layout)
    if check_data:
        _check_data(config.data, config.training, config.model, needs_source)
        check_fim(config.data)
    return layout


def _check_launch(parallel: ParallelConfig) -> None:
    """Where the nodes meet, and this node's place among them."""
    if parallel.node_rank >= parallel.nnodes:
        raise ConfigError(
            f"{flag.node_rank} {parallel.node_rank} is out of range for {flag.nnodes} {parallel.nnodes}: "
            f"use 0 to {parallel.nnodes - 1}"
        )
    if parallel.master_addr is not None and parallel.rdzv_endpoint is not None:
        raise ConfigError(
            f"{flag.master_addr} and {flag.rdzv_endpoint} are two ways to meet: give one "
            f"({flag.rdzv_endpoint} to restart the nodes together)"
        )
    if parallel.nnodes > 1 and parallel.master_addr is None and parallel.rdzv_endpoint is None:
        raise ConfigError(
            f"{flag.nnodes} {parallel.nnodes} needs where the nodes meet: {flag.master_addr} HOST "
            f"(node 0's address) or {flag.rdzv_endpoint} HOST:PORT"
        )


def _check_bounds(config: Config) -> None:
    """Every setting within the limits of its field's metadata (a derived value is checked where it is used).

    A section found within its limits is remembered (sections are frozen): the planner validates thousands of
    candidate configs that share all but a few of their sections."""
    for name, limited in _limited_fields().items():
        section = getattr(config, name)
        held = _WITHIN_BOUNDS.get(id(section))
        if held is not None and held() is section:
            continue
        for info in limited:
            value = getattr(section, info.name)
            if value is None or info.name in getattr(section, "derived", ()):
                continue
            bound = _broken_bound(info.limits, value)
            if bound is not None:
                raise ConfigError(f"{info.flag} {value}: must be {bound}")
        _WITHIN_BOUNDS[id(section)] = weakref.ref(section)


_WITHIN_BOUNDS: dict[int, weakref.ReferenceType] = {}
"""Sections already found within their limits, by identity (the reference tells a reused id from its section)."""


@functools.cache
def _limited_fields() -> dict[str, list[FieldInfo]]:
    """The fields with limits, by section."""
    out: dict[str, list[FieldInfo]] = {}
    for info in all_fields().values():
        if info.limits:
            out.setdefault(info.section, []).append(info)
    return out


def _broken_bound(limits: Mapping[str, Any], value: Any) -> str | None:
    """How `value` must be instead, or None when it is within `limits`."""
    low, above, below = limits.get("min"), limits.get("above"), limits.get("below")
    if below is not None:
        return None if (low is None or low <= value) and value < below else f"in [{low}, {below})"
    if above is not None and not value > above:
        return f"at least {above + 1}"
    if low is not None and not value >= low:
        return "zero or more" if low == 0 else f"at least {low}"
    return None


def _check_precision(t: TrainingConfig) -> None:
    if t.loss_scale is not None and t.precision != "fp16":
        raise ConfigError(
            f"{flag.loss_scale} applies to fp16 training only (this run is {t.precision}); add --fp16 or drop it"
        )
    if t.min_loss_scale > t.initial_loss_scale:
        raise ConfigError(
            f"{flag.min_loss_scale} {t.min_loss_scale:g} exceeds {flag.initial_loss_scale} "
            f"{t.initial_loss_scale:g}; lower the first or raise the second"
        )


def _check_model(m: ModelConfig, d: DataConfig) -> None:
    heads, groups = m.num_attention_heads, m.num_query_groups
    if "kv_channels" in m.derived and m.hidden_size % heads:
        raise ConfigError(
            f"{flag.hidden_size} {m.hidden_size} is not divisible by {flag.num_attention_heads} "
            f"{heads}; change one of them or set {flag.kv_channels}"
        )
    if groups > heads or heads % groups:
        raise ConfigError(
            f"{flag.num_attention_heads} {heads} is not a multiple of {flag.num_query_groups} "
            f"{groups}; use a divisor of the head count"
        )
    head_dim = m.kv_channels
    if m.position_embedding_type == "rope" and head_dim % 2:
        raise ConfigError(
            f"rotary embeddings need an even head width, got {head_dim}; change {flag.kv_channels} "
            f"or {flag.hidden_size}"
        )
    if d.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"{flag.seq_length} {d.seq_length} exceeds {flag.max_position_embeddings} "
            f"{m.max_position_embeddings}; lower the first or raise the second"
        )
    _check_attention(m)
    _check_experts(m)
    if m.lora_rank is not None and m.lora_rank < 1:
        raise ConfigError(f"{flag.lora_rank} {m.lora_rank}: must be at least 1 (leave it unset to train every weight)")
    if m.lora_rank is not None and m.num_experts:
        raise ConfigError(f"{flag.lora_rank} with {flag.num_experts}: LoRA adapters on experts are not supported yet")
    if m.lora_alpha <= 0:
        raise ConfigError(f"{flag.lora_alpha} {m.lora_alpha:g}: must be positive")
    unknown = [t for t in m.lora_targets if t not in LORA_TARGETS]
    if unknown or not m.lora_targets:
        raise ConfigError(
            f"{flag.lora_targets} {','.join(m.lora_targets)}: "
            f"{'unknown layer ' + unknown[0] if unknown else 'names no layer'}; choose from {','.join(LORA_TARGETS)}"
        )


def _check_attention(m: ModelConfig) -> None:
    """The attention pattern has what it needs (see docs/attention.md)."""
    windowed = m.attention_type == "sliding-window"
    if windowed != (m.window_size is not None):
        if windowed:
            raise ConfigError(f"{flag.attention_type} sliding-window needs {flag.window_size} W (tokens each one sees)")
        raise ConfigError(
            f"{flag.window_size} applies to {flag.attention_type} sliding-window (this run's is {m.attention_type}); "
            "add it or drop the window"
        )
    if windowed and m.window_size is not None and m.window_size > m.max_position_embeddings:
        raise ConfigError(
            f"{flag.window_size} {m.window_size} exceeds {flag.max_position_embeddings} {m.max_position_embeddings}: "
            f"no sequence is longer than the window, which is plain causal attention; use {flag.attention_type} "
            "causal or a smaller window"
        )


def _check_context_parallel(config: Config, layout: Layout) -> None:
    """Context parallelism: rows that split into 2 x CP chunks, and what the ring can serve."""
    m, p, cp = config.model, config.parallel, layout.cp
    if cp == 1:
        return
    seq = config.data.seq_length
    if seq % (2 * cp):
        raise ConfigError(
            f"{flag.seq_length} {seq} is not divisible by 2 x {flag.context_parallel_size} {cp} = {2 * cp} (each "
            f"rank holds two of {2 * cp} chunks); choose a multiple of {2 * cp}"
        )
    if p.sequence_parallel and (seq // cp) % layout.tp:
        raise ConfigError(
            f"{flag.seq_length} {seq} / {flag.context_parallel_size} {cp} is not divisible by "
            f"{flag.tensor_model_parallel_size} {layout.tp}, which {flag.sequence_parallel} needs; choose a multiple"
        )
    refusals = (
        (m.attention_dropout > 0, f"{flag.attention_dropout} {m.attention_dropout:g}", "set it to 0"),
        (
            bool(m.num_experts) and m.moe_expert_capacity_factor is not None,
            f"{flag.moe_expert_capacity_factor} {m.moe_expert_capacity_factor}",
            "leave it unset for dropless experts (which tokens an expert drops depends on the whole sequence, "
            "which no rank holds)",
        ),
        (p.zero_stage == 3, f"{flag.zero_stage} 3", f"use {flag.zero_stage} 1 or 2"),
        (p.variable_seq_lengths, flag.variable_seq_lengths, "drop it (rows must split evenly)"),
    )
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"{flag.context_parallel_size} {cp} does not serve {what} yet; {fix}")


def _check_experts(m: ModelConfig) -> None:
    """Mixture-of-experts settings: sizes that fit, and no MoE setting without experts."""
    if not m.num_experts:
        defaults = _MODEL_DEFAULTS
        changed = [
            f.name
            for f in dataclasses.fields(m)
            if f.name.startswith("moe_") and getattr(m, f.name) != getattr(defaults, f.name)
        ]
        if m.num_experts is not None or changed:
            what = f"{flag.num_experts} {m.num_experts}" if m.num_experts is not None else getattr(flag, changed[0])
            raise ConfigError(f"{what}: a mixture-of-experts setting needs {flag.num_experts} 1 or more")
        return
    if not 1 <= m.moe_router_topk <= m.num_experts:
        raise ConfigError(
            f"{flag.moe_router_topk} {m.moe_router_topk}: must be between 1 and {flag.num_experts} {m.num_experts}"
        )
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise ConfigError(
            f"{flag.moe_expert_capacity_factor} {m.moe_expert_capacity_factor:g}: must be positive (leave it unset "
            "for dropless experts)"
        )
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError(f"{flag.moe_pad_expert_input_to_capacity} needs {flag.moe_expert_capacity_factor}")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        raise ConfigError(f"{flag.moe_router_pre_softmax} applies to {flag.moe_router_score_function} softmax only")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        raise ConfigError(f"{flag.moe_shared_expert_gate} needs {flag.moe_shared_expert_intermediate_size}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if (getattr(m, name) or 0) < 0:
            raise ConfigError(f"{getattr(flag, name)} {getattr(m, name):g}: must not be negative")
    if len(m.moe_layer_pattern) != m.num_layers:
        raise ConfigError(
            f"{flag.moe_layer_freq} {m.moe_layer_freq}: give a positive integer or a list of {m.num_layers} "
            "0s and 1s such as [0,1,1,1] (one per layer)"
        )


def _check_expert_parallel(config: Config, layout: Layout) -> None:
    """Expert parallelism: the experts' grid (expert-TP x EP x expert-DP) folded over each pipeline
    stage's TP x CP x DP ranks, as Megatron-Core lays it; experts that split evenly over it."""
    m, p = config.model, config.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    stage = layout.tp * layout.cp * layout.dp
    if ep < 1:
        raise ConfigError(f"{flag.expert_model_parallel_size} {ep}: must be at least 1")
    if etp is not None and stage % etp:
        raise ConfigError(
            f"{flag.expert_tensor_parallel_size} {etp} does not divide the {stage} ranks of a pipeline stage "
            f"(TP {layout.tp} x CP {layout.cp} x DP {layout.dp}); choose a divisor"
        )
    if not m.num_experts:  # (Megatron-LM accepts an expert tensor-parallel size for a dense model; it changes nothing)
        if ep > 1:
            raise ConfigError(
                f"{flag.expert_model_parallel_size} needs a mixture-of-experts model: add {flag.num_experts}"
            )
        return
    if m.num_experts % ep:
        raise ConfigError(
            f"{flag.num_experts} {m.num_experts} is not divisible by {flag.expert_model_parallel_size} {ep}; "
            "choose an expert-parallel size that divides the number of experts"
        )
    expert_tp = layout.tp if etp is None else etp
    if stage % (ep * expert_tp):
        raise ConfigError(
            f"{flag.expert_model_parallel_size} {ep} x expert tensor-parallel size {expert_tp} = {ep * expert_tp} "
            f"does not divide the {stage} ranks of a pipeline stage (TP {layout.tp} x CP {layout.cp} x DP "
            f"{layout.dp}), over which the experts' grid is laid; choose sizes whose product divides it"
        )
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if ffn % expert_tp:
        raise ConfigError(
            f"{flag.moe_ffn_hidden_size} {ffn} is not divisible by the experts' tensor-parallel size {expert_tp}; "
            f"choose a multiple or set {flag.expert_tensor_parallel_size} 1"
        )
    if m.moe_grouped_gemm:  # torch's grouped matmul reads rows that start on 16-byte boundaries
        multiple = 16 // (4 if config.training.precision == "fp32" else 2)
        for what, size in (
            (f"{flag.hidden_size} {m.hidden_size}", m.hidden_size),
            (f"the experts' width per tensor-parallel rank {ffn // expert_tp}", ffn // expert_tp),
        ):
            if size % multiple:
                raise ConfigError(
                    f"{flag.moe_grouped_gemm}: torch's grouped matmul needs rows of a multiple of 16 bytes, and "
                    f"{what} is not a multiple of {multiple} in {config.training.precision}; "
                    "choose a multiple or drop the flag to loop over the experts"
                )
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % layout.tp:
        raise ConfigError(
            f"{flag.moe_shared_expert_intermediate_size} {shared} is not divisible by "
            f"{flag.tensor_model_parallel_size} {layout.tp}; choose a multiple"
        )


def _check_tensor_parallel(config: Config, layout: Layout) -> None:
    m, p = config.model, config.parallel
    tp, heads, groups = layout.tp, m.num_attention_heads, m.num_query_groups
    if heads % tp:
        raise ConfigError(
            f"{flag.num_attention_heads} {heads} is not divisible by {flag.tensor_model_parallel_size} "
            f"{tp}; choose a tensor-parallel size that divides the head count"
        )
    if groups % tp and tp % groups:
        raise ConfigError(
            f"{flag.num_query_groups} {groups} and {flag.tensor_model_parallel_size} {tp}: one must "
            "divide the other (key/value heads are split over the ranks, or replicated when fewer)"
        )
    ffn = m.ffn_hidden_size
    if ffn % tp:
        raise ConfigError(
            f"{flag.ffn_hidden_size} {ffn} is not divisible by {flag.tensor_model_parallel_size} {tp}; "
            "choose a tensor-parallel size that divides it"
        )
    if p.sequence_parallel and tp == 1:
        raise ConfigError(f"{flag.sequence_parallel} needs {flag.tensor_model_parallel_size} above 1")
    if p.sequence_parallel and config.data.seq_length % tp:
        raise ConfigError(
            f"{flag.seq_length} {config.data.seq_length} is not divisible by "
            f"{flag.tensor_model_parallel_size} {tp}, which {flag.sequence_parallel} needs; "
            "choose a multiple"
        )


def _check_recompute(t: TrainingConfig) -> None:
    if t.recompute_granularity == "full" and t.recompute_method is None:
        raise ConfigError(f"{flag.recompute_granularity} full needs {flag.recompute_method} uniform or block")
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        raise ConfigError(
            f"{flag.recompute_method} and {flag.recompute_num_layers} apply to "
            f"{flag.recompute_granularity} full; add it or drop them"
        )
    if t.recompute_method == "block" and t.recompute_num_layers is None:
        raise ConfigError(
            f"{flag.recompute_method} block needs {flag.recompute_num_layers} (layers per pipeline chunk)"
        )


def _check_data_parallel(config: Config, layout: Layout) -> None:
    p = config.parallel
    stage = p.zero_stage
    if p.overlap_param_gather and stage not in (1, 2, 3):  # (at stage 3 FSDP2 prefetches the next unit's anyway)
        raise ConfigError(
            f"{flag.overlap_param_gather} needs the distributed optimizer: add "
            f"--use-distributed-optimizer (or {flag.zero_stage} 1, 2 or 3)"
        )
    schedule = layout.pipeline.schedule
    if stage == 3 and schedule in ("zb-h1", "zb-v"):
        raise ConfigError(
            f"{flag.zero_stage} 3 does not combine with {flag.pipeline_schedule} {schedule}, whose "
            "deferred weight gradients would miss FSDP's reduction; use 1f1b, interleaved or gpipe, "
            f"or {flag.zero_stage} 1 or 2"
        )


def _check_lr_schedule(config: Config) -> None:
    s, o, t = config.lr_schedule, config.optimizer, config.training
    decay_iters = s.lr_decay_iters or t.train_iters
    if s.lr_warmup_iters > decay_iters:
        raise ConfigError(
            f"{flag.lr_warmup_iters} {s.lr_warmup_iters} exceeds the decay length {decay_iters}; "
            f"lower it or raise {flag.lr_decay_iters}"
        )
    if s.min_lr > o.lr:
        raise ConfigError(f"{flag.min_lr} {s.min_lr} exceeds {flag.lr} {o.lr}; lower {flag.min_lr}")


def _check_sample_based(config: Config, layout: Layout) -> None:
    """Megatron-LM's rules for iteration- and sample-based runs (never mixed), the batch ramp, and
    what its learning-rate scheduler asserts. One exception: a batch ramp with --train-iters, which
    Megatron-LM refuses although its own GPT-3 example asks for it, runs (the ramp and the schedule
    count consumed samples either way)."""
    s, t, o = config.lr_schedule, config.training, config.optimizer
    by_samples = {
        flag.lr_decay_samples: s.lr_decay_samples is not None,
        flag.lr_warmup_samples: s.lr_warmup_samples != 0,
        flag.lr_wsd_decay_samples: s.lr_wsd_decay_samples is not None,
    }
    by_iters = {
        flag.lr_decay_iters: (s.lr_decay_iters is not None, flag.lr_decay_samples),
        flag.lr_warmup_iters: (s.lr_warmup_iters != 0, flag.lr_warmup_samples),
        flag.lr_wsd_decay_iters: (s.lr_wsd_decay_iters is not None, flag.lr_wsd_decay_samples),
    }
    if t.train_samples is None:
        for name, given in by_samples.items():
            if given:
                raise ConfigError(f"{name} is for sample-based runs: give {flag.train_samples} instead of iterations")
    else:
        for name, (given, instead) in by_iters.items():
            if given:
                raise ConfigError(f"{name} counts iterations but {flag.train_samples} is set; use {instead}")
        if t.global_batch_size is None:
            raise ConfigError(f"{flag.train_samples} needs {flag.global_batch_size} (the samples of one full step)")
        if t.train_iters < 1:
            raise ConfigError(
                f"{flag.train_samples} {t.train_samples} is less than one step of {flag.global_batch_size} "
                f"{t.global_batch_size}; raise it"
            )
    if s.lr_warmup_fraction is not None and (s.lr_warmup_iters or s.lr_warmup_samples):
        which = flag.lr_warmup_iters if s.lr_warmup_iters else flag.lr_warmup_samples
        raise ConfigError(f"{flag.lr_warmup_fraction} and {which} both set the warmup; give one")
    _check_rampup(config, layout)
    _check_step_batch_pipeline(config, layout)
    lengths = schedule_lengths(s, t, layout.global_batch_size)
    if lengths.decay <= 0:
        raise ConfigError(f"the learning-rate decay is {lengths.decay} samples long; it must be positive")
    if lengths.warmup >= lengths.decay:
        raise ConfigError(
            f"the warmup ({lengths.warmup:g} samples) is not shorter than the decay ({lengths.decay} samples); "
            "shorten the warmup or lengthen the decay"
        )
    if s.lr_decay_style == "WSD" and lengths.wsd_decay is None:
        which = flag.lr_wsd_decay_samples if t.train_samples is not None else flag.lr_wsd_decay_iters
        raise ConfigError(f"{flag.lr_decay_style} WSD needs {which} (the length of the final annealing)")
    if s.lr_warmup_init > o.lr:
        raise ConfigError(f"{flag.lr_warmup_init} {s.lr_warmup_init} exceeds {flag.lr} {o.lr}; lower it")
    if s.min_lr < 0:
        raise ConfigError(f"{flag.min_lr} {s.min_lr} is negative; use 0 or more")
    if s.use_checkpoint_opt_param_scheduler and s.override_opt_param_scheduler:
        raise ConfigError(
            f"{flag.use_checkpoint_opt_param_scheduler} and {flag.override_opt_param_scheduler} contradict; give one"
        )


def _check_rampup(config: Config, layout: Layout) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES: a ramp that reaches the global batch, in batches
    every data-parallel rank can split into micro-batches (and the pipeline schedule can run)."""
    t = config.training
    if not t.rampup_batch_size:
        return
    try:
        ramp_values = t.rampup()
    except ValueError:
        ramp_values = None
    where = f"{flag.rampup_batch_size} {' '.join(t.rampup_batch_size)}"
    if ramp_values is None:
        raise ConfigError(f"{where}: expected three integers START INCREMENT SAMPLES")
    ramp = batch_ramp(ramp_values, layout.global_batch_size)
    if ramp is None:
        raise ConfigError(
            f"{where}: START, INCREMENT and SAMPLES must be positive, START below "
            f"{flag.global_batch_size} {layout.global_batch_size}, and INCREMENT must step from START to it"
        )
    unit = layout.micro_batch_size * layout.dp
    if ramp.start % unit or ramp.increment % unit:
        raise ConfigError(
            f"{where}: START and INCREMENT must be multiples of {flag.micro_batch_size} x data-parallel size "
            f"({unit}) so that every batch of the ramp splits into micro-batches"
        )
    plan = layout.pipeline
    if plan.schedule is not None:
        for batch in range(ramp.start, layout.global_batch_size, ramp.increment):
            try:
                check_schedule(plan.schedule, layout.pp, batch // unit, plan.chunks)
            except ValueError as exc:
                raise ConfigError(f"{where}: the ramp's batch of {batch}: {exc}; change the ramp") from None


def _check_data(d: DataConfig, t: TrainingConfig, m: ModelConfig, needs_source: bool = True) -> None:
    """The data settings agree with each other (whether the files exist is `data.checks`' part);
    one source of data is given, unless `needs_source` is False (then at most one)."""
    per_split = bool(d.train_data_path or d.valid_data_path or d.test_data_path)
    sources = [
        name
        for name, on in (
            (flag.mock_data, d.mock_data),
            (flag.corpus, d.corpus),
            (flag.data_path, bool(d.data_path)),
            (flag.train_data_path, per_split),
        )
        if on
    ]
    if len(sources) > 1 or (needs_source and not sources):
        what = "none" if not sources else " and ".join(sources)
        raise ConfigError(
            f"give exactly one of {flag.data_path}, {flag.train_data_path} (with "
            f"{flag.valid_data_path}), {flag.corpus} stdlib or {flag.mock_data} (got {what})"
        )
    documents = [
        name
        for name, on in (
            (flag.reset_position_ids, d.reset_position_ids),
            (flag.reset_attention_mask, d.reset_attention_mask),
            (flag.eod_mask_loss, d.eod_mask_loss),
            (f"{flag.attention_type} document", m.attention_type == "document" and not d.sft),
        )
        if on
    ]
    if documents and d.mock_data:
        raise ConfigError(
            f"{documents[0]} reads the documents of each sample, and {flag.mock_data} has none (no end-of-document "
            f"token); give {flag.data_path} or {flag.corpus} stdlib"
        )
    if d.sft and (d.mock_data or d.corpus):
        raise ConfigError(f"{flag.sft} trains on conversations: give {flag.data_path} FILE.jsonl ... instead")
    sft_only = [
        f
        for f, on in (
            (flag.sft_truncation, d.sft_truncation != "truncate"),
            (f"--no-{flag.truncate[2:]}", not d.truncate),
        )
        if on
    ]
    if sft_only and not d.sft:
        raise ConfigError(f"{sft_only[0]} applies to fine-tuning data; add {flag.sft}")
    if d.sft and (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        raise ConfigError(
            f"{flag.reset_position_ids}, {flag.reset_attention_mask} and {flag.eod_mask_loss} are for pretraining "
            f"documents; {flag.sft} already gives each conversation its own positions, attention and loss mask"
        )
    if per_split and not d.train_data_path:
        raise ConfigError(f"{flag.valid_data_path} and {flag.test_data_path} need {flag.train_data_path} too")
    batches = t.eval_batches(d.sft)
    evaluation = f"{flag.eval_iters} {batches}" if batches is not None else f"validation (unset {flag.eval_iters})"
    if per_split and t.eval_iters != 0 and not d.valid_data_path:
        raise ConfigError(f"{evaluation} needs {flag.valid_data_path}; give it or set {flag.eval_iters} 0")
    kind = d.tokenizer_type
    if kind == "HuggingFaceTokenizer" and not d.tokenizer_model:
        raise ConfigError(
            f"{flag.tokenizer_type} HuggingFaceTokenizer needs {flag.tokenizer_model} PATH (a tokenizer.json)"
        )
    if kind == "NullTokenizer" and not m.vocab_size:
        raise ConfigError(f"{flag.tokenizer_type} NullTokenizer needs {flag.vocab_size}")
    _, valid_share, _ = parse_split(d.split)
    if t.eval_iters != 0 and valid_share == 0 and (d.data_path or d.corpus):
        raise ConfigError(
            f"{flag.split} {d.split} leaves no validation data for {evaluation}; "
            f"give the split a validation share or set {flag.eval_iters} 0"
        )


def _check_megatron_model_features(config: Config) -> None:
    """Megatron-LM's rotary settings: --rotary-percent must leave an even, non-zero number of rotating
    features per head (without rotary embeddings both rotary settings are ignored with a warning, as
    Megatron-LM ignores them: config.megatron.adjust_like_megatron)."""
    m = config.model
    if not 0.0 < m.rotary_percent <= 1.0:
        raise ConfigError(f"{flag.rotary_percent} {m.rotary_percent:g}: must be above 0 and at most 1")
    head_dim = m.kv_channels
    width = int(head_dim * m.rotary_percent)
    if m.position_embedding_type == "rope" and m.rotary_percent < 1.0 and (width < 2 or width % 2):
        raise ConfigError(
            f"{flag.rotary_percent} {m.rotary_percent:g} rotates {width} of each head's {head_dim} features; "
            "choose a fraction that gives a positive even number"
        )


def _check_debug_capture(config: Config) -> None:
    """--debug-capture maps every rank's piece to the single-device tensor at every layout (tensor,
    sequence, pipeline, context, expert and data parallelism, ZeRO stages 0-3); its folder must be one."""
    folder = config.logging.debug_capture
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"{flag.debug_capture} {folder} is a file; give a folder (new or one of earlier captures)")


def _check_loss_spikes(config: Config) -> None:
    """--loss-spike-zscore's window must give a standard deviation, --on-spike rollback a checkpoint to go back to."""
    t = config.training
    if t.loss_spike_zscore is None:
        return
    if t.loss_spike_window < 2:
        raise ConfigError(
            f"{flag.loss_spike_window} {t.loss_spike_window}: a loss spike is judged against the spread of at least "
            f"2 recent losses; give {flag.loss_spike_window} 2 or more (50 by default)"
        )
    if t.on_spike == "rollback" and not config.checkpoint.save:
        raise ConfigError(
            f"{flag.on_spike} rollback reloads the newest checkpoint of {flag.save}: give {flag.save} DIR "
            f"(and {flag.save_interval} N), or choose {flag.on_spike} warn or skip"
        )


_MODEL_DEFAULTS = ModelConfig()
"""Every model setting's default, built once (`_check_experts` compares against it on each of the planner's
thousands of candidates)."""


def _check_step_batch_schedule(config: Config, world_size: int) -> None:
    """--step-batch-size-schedule: well formed, not with --rampup-batch-size, ending at the global batch, and each
    batch one that every data-parallel rank splits into micro-batches (checked before the layout, which would name
    only --global-batch-size)."""
    t, p = config.training, config.parallel
    text = t.step_schedule_text()
    if text is None:
        return
    where = f"{flag.step_batch_size_schedule} {text!r}"
    if t.rampup_batch_size:
        raise ConfigError(f"{where} and {flag.rampup_batch_size} both change the batch size; give one")
    try:
        schedule = step_schedule(text, config.data.seq_length)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if t.global_batch_size is not None and schedule.global_batch_size != t.global_batch_size:
        raise ConfigError(
            f"{where} ends at a batch of {schedule.global_batch_size} but {flag.global_batch_size} is "
            f"{t.global_batch_size}; drop {flag.global_batch_size} or make it the schedule's last batch"
        )
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    if world_size % model_parallel:
        return  # (the layout names it)
    unit = t.micro_batch_size * world_size // model_parallel
    for batch in schedule.batch_sizes():
        if batch % unit:
            raise ConfigError(
                f"{where}: the batch of {batch} is not a multiple of {flag.micro_batch_size} x data-parallel size "
                f"({unit}); make every batch one"
            )


def _check_step_batch_pipeline(config: Config, layout: Layout) -> None:
    """Each batch of --step-batch-size-schedule is a micro-batch count the pipeline schedule can run."""
    text, plan = config.training.step_schedule_text(), layout.pipeline
    if text is None or plan.schedule is None:
        return
    unit = layout.micro_batch_size * layout.dp
    for batch in step_schedule(text, config.data.seq_length).batch_sizes():
        try:
            check_schedule(plan.schedule, layout.pp, batch // unit, plan.chunks)
        except ValueError as exc:
            raise ConfigError(
                f"{flag.step_batch_size_schedule} {text!r}: the batch of {batch}: {exc}; change the schedule"
            ) from None


def _check_gradient_precision(config: Config) -> None:
    """bf16 gradients go with bf16 weights only (Megatron-LM reads the flag only with --bf16): fp16 training scales
    the loss so that small gradients keep fp16's 10 mantissa bits, which bf16's 7 would throw away, and fp32 training
    keeps everything in fp32."""
    precision = config.training.precision
    if config.parallel.grad_reduce_in_bf16 and precision != "bf16":
        raise ConfigError(
            f"{flag.grad_reduce_in_bf16} keeps gradients in bf16 next to bf16 weights, but this run is {precision} "
            f"(fp16 and fp32 runs accumulate and reduce gradients in fp32): add --bf16 or drop "
            f"{flag.grad_reduce_in_bf16}"
        )


def check_fp8_settings(config: Config, layout: Layout) -> None:
    """fp8 matmuls run inside bf16 training; fp8 weight gathers need ZeRO-3, one scale per weight and no tensor
    parallelism. Whether the device has fp8 matmuls is asked later, of the device (parallel/fp8.py)."""
    t = config.training
    if t.fp8_format is None:
        if t.fp8_param_gather:
            raise ConfigError(f"{flag.fp8_param_gather} gathers fp8 weights; add {flag.fp8_format} e4m3 or hybrid")
        return
    if t.precision != "bf16":
        raise ConfigError(
            f"{flag.fp8_format} {t.fp8_format} runs inside bf16 training (this run is {t.precision}); add --bf16"
        )
    if t.fp8_param_gather and layout.tp > 1:
        tp = flag.tensor_model_parallel_size
        raise ConfigError(
            f"{flag.fp8_param_gather} with {tp} {layout.tp}: the tensor-parallel fp8 layers gather their weights "
            f"in bf16; drop {flag.fp8_param_gather} or use {tp} 1"
        )
    if t.fp8_param_gather and config.parallel.zero_stage != 3:
        raise ConfigError(
            f"{flag.fp8_param_gather} gathers ZeRO-3's weight shards in fp8, and this run is "
            f"{flag.zero_stage} {config.parallel.zero_stage}; add {flag.zero_stage} 3 or drop {flag.fp8_param_gather}"
        )
    if t.fp8_param_gather and t.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"{flag.fp8_param_gather} needs one scale per weight ({flag.fp8_recipe} tensorwise), not "
            f"{flag.fp8_recipe} {t.fp8_recipe}; change one of the two"
        )
