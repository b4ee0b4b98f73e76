"""What tensor, context, expert and data parallelism ask of the model and of each other, at the run's layout."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layout import Layout, check_expert_grid
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_tensor_parallel(config: Config, layout: Layout) -> None:
    """Heads, key/value groups, MLP width and (with sequence parallelism) rows split over the tensor-parallel ranks."""
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


def check_expert_parallel(config: Config, layout: Layout) -> None:
    """Expert parallelism: the experts' grid folded over each pipeline stage's ranks (`check_expert_grid`,
    which `resolve_layout` runs too when the grid does not fold); experts that split evenly over it."""
    m = config.model
    check_expert_grid(config, layout.tp, layout.cp, layout.tp * layout.cp * layout.dp)
    if not m.num_experts:
        return
    expert_tp = layout.etp
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


def check_context_parallel(config: Config, layout: Layout) -> None:
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
        (m.multi_latent_attention, flag.multi_latent_attention, "use tensor or pipeline parallelism for now"),
    )
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"{flag.context_parallel_size} {cp} does not serve {what} yet; {fix}")


def check_data_parallel(config: Config, layout: Layout) -> None:
    """Overlapped weight gathers need ZeRO; ZeRO-3 needs a pipeline schedule without deferred weight gradients."""
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
