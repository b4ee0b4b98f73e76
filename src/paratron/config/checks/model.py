"""The model's shape: heads and widths that fit, attention patterns, experts, LoRA and rotary settings."""

from __future__ import annotations

import dataclasses

from paratron.config.fields import flag
from paratron.config.schema import LORA_TARGETS, MLA_SETTINGS, Config, DataConfig, ModelConfig
from paratron.errors import ConfigError


def check_model(m: ModelConfig, d: DataConfig) -> None:
    """Heads and widths that divide, a sequence the positions cover, attention, experts and LoRA settings."""
    heads, groups = m.num_attention_heads, m.num_query_groups
    mla = m.multi_latent_attention  # (its head widths are its own settings)
    if "kv_channels" in m.derived and m.hidden_size % heads and not mla:
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
    if m.position_embedding_type == "rope" and head_dim % 2 and not mla:
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
    _check_multi_latent_attention(m)
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


_YARN_SETTINGS = (
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
"""The settings of YaRN's rotary tables and softmax scale (--rope-type yarn)."""


def _check_multi_latent_attention(m: ModelConfig) -> None:
    """Multi-latent attention's settings: only with it, and with nothing it cannot be combined with yet."""
    if not m.multi_latent_attention:
        changed = [name for name in MLA_SETTINGS[1:] if getattr(m, name) != getattr(_MODEL_DEFAULTS, name)]
        if changed:
            setting = getattr(flag, changed[0])
            raise ConfigError(f"{setting} applies to {flag.multi_latent_attention}; add that or drop this")
        return
    mla = flag.multi_latent_attention
    refusals = (
        (m.position_embedding_type != "rope", f"{flag.position_embedding_type} rope (its rotary parts need it)"),
        (
            m.group_query_attention or m.num_query_groups != m.num_attention_heads,
            f"no {flag.group_query_attention} / {flag.num_query_groups} (its heads share one latent, not key/value "
            "groups)",
        ),
        (m.attention_output_gate, f"no {flag.attention_output_gate} (not supported with it yet)"),
        (m.lora_rank is not None, f"no {flag.lora_rank} (LoRA adapters on its projections are not supported yet)"),
        (m.rotary_percent < 1.0, f"no {flag.rotary_percent} below 1 (its rotary part is {flag.qk_pos_emb_head_dim})"),
        (
            m.rotary_interleaved,
            f"no {flag.rotary_interleaved} (its rotary features always turn in interleaved pairs, DeepSeek's layout)",
        ),
        (m.qk_pos_emb_head_dim % 2 == 1, f"an even {flag.qk_pos_emb_head_dim} (rotary features turn in pairs)"),
    )
    for refused, fix in refusals:
        if refused:
            raise ConfigError(f"{mla} needs {fix}")
    yarn_given = m.rope_type == "yarn" and "rope_type" not in m.derived
    if yarn_given and m.rotary_scaling_factor <= 1:
        raise ConfigError(
            f"{flag.rope_type} yarn needs {flag.rotary_scaling_factor} above 1 (at 1 it stretches nothing; "
            f"DeepSeek-V3's is 40); set it or use {flag.rope_type} rope"
        )
    if m.rope_type == "rope":
        changed = [name for name in _YARN_SETTINGS if getattr(m, name) != getattr(_MODEL_DEFAULTS, name)]
        if changed:
            raise ConfigError(f"{getattr(flag, changed[0])} applies to {flag.rope_type} yarn; set that or drop this")


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
    _check_expert_groups(m)
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


def _check_expert_groups(m: ModelConfig) -> None:
    """Group-limited routing: both settings, groups that split the experts evenly, and chosen groups that hold the
    top-k experts and a score for each group (the sum of its best top-k / group top-k experts)."""
    groups, chosen, experts, topk = m.moe_router_num_groups, m.moe_router_group_topk, m.num_experts, m.moe_router_topk
    if groups is None and chosen is None:
        return
    if groups is None or chosen is None:
        given, missing = flag.moe_router_num_groups, flag.moe_router_group_topk
        if groups is None:
            given, missing = missing, given
        raise ConfigError(f"{given} needs {missing} too (group-limited routing takes both); add it or drop {given}")
    if groups < 1 or experts % groups:
        raise ConfigError(
            f"{flag.moe_router_num_groups} {groups} does not divide {flag.num_experts} {experts} into equal groups; "
            "use a divisor of the expert count"
        )
    if not 1 <= chosen <= groups:
        raise ConfigError(
            f"{flag.moe_router_group_topk} {chosen}: must be between 1 and {flag.moe_router_num_groups} {groups}"
        )
    if chosen * (experts // groups) < topk:
        raise ConfigError(
            f"{flag.moe_router_group_topk} {chosen} opens {chosen * (experts // groups)} experts, fewer than "
            f"{flag.moe_router_topk} {topk}; choose more groups or fewer experts per token"
        )
    if chosen > topk:
        raise ConfigError(
            f"{flag.moe_router_group_topk} {chosen} exceeds {flag.moe_router_topk} {topk}: a group's score is the sum "
            f"of its best top-k / group top-k experts, none here; choose at most {topk} groups"
        )


_MODEL_DEFAULTS = ModelConfig()
"""Every model setting's default, built once (`_check_experts` compares against it on each of the planner's
thousands of candidates)."""


def check_rotary(config: Config) -> None:
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
