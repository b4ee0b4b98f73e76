"""Consistency checks of --hybrid-layer-pattern (part of `config.validation`): the pattern reads, its symbols are
kinds paratron builds, its mixture-of-experts layers have experts, and its pipeline stages (`|`) are the run's."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layer_pattern import read_layer_pattern
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_layer_pattern(config: Config) -> None:
    """Raise ConfigError for the first setting the layer pattern contradicts."""
    m, p = config.model, config.parallel
    if not m.hybrid_layer_pattern:
        return
    try:
        pattern = read_layer_pattern(m.hybrid_layer_pattern)
    except ValueError as exc:
        raise ConfigError(f"{flag.hybrid_layer_pattern} {m.hybrid_layer_pattern}: {exc}") from None
    if "E" in pattern.symbols and not m.num_experts:
        raise ConfigError(f"{flag.hybrid_layer_pattern} has 'E' layers (mixture of experts): give {flag.num_experts}")
    if m.num_experts and "E" not in pattern.symbols:
        raise ConfigError(
            f"{flag.num_experts} {m.num_experts} with {flag.hybrid_layer_pattern} {m.hybrid_layer_pattern}: the "
            "pattern places the experts; add 'E' layers to it, or drop --num-experts"
        )
    if m.moe_layer_freq != "1":
        raise ConfigError(
            f"{flag.moe_layer_freq} with {flag.hybrid_layer_pattern}: the pattern's 'E' symbols place the experts; "
            f"drop {flag.moe_layer_freq}"
        )
    stages = len(pattern.stage_sizes)
    if stages > 1:
        pp, chunks = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
        if p.pipeline_schedule == "zb-v" and pp > 1:  # (zb-v places two chunks per rank itself)
            chunks = 2
        if stages != pp * chunks:
            raise ConfigError(
                f"{flag.hybrid_layer_pattern} {m.hybrid_layer_pattern} has {stages} pipeline stages ('|' between "
                f"them) but the run has {pp * chunks} ({flag.pipeline_model_parallel_size} {pp}"
                + (f" x {chunks} virtual stages)" if chunks > 1 else ")")
                + "; give as many stages, or drop the '|'"
            )
        if p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None:
            raise ConfigError(
                f"{flag.hybrid_layer_pattern}'s '|' places every stage's layers; drop "
                f"{flag.decoder_first_pipeline_num_layers} / {flag.decoder_last_pipeline_num_layers}"
            )
