"""Rotary position embeddings: the cos/sin tables (plain, or with YaRN's frequency interpolation for multi-latent
attention) and the rotation of queries and keys by them.

YaRN (Peng et al., 2023; DeepSeek-V2/V3's `rope_scaling`) stretches a context trained at --original-max-position-
embeddings to --rotary-scaling-factor times that: rotary frequency pairs that turn more than --beta-fast times over the
original context are kept, those that turn fewer than --beta-slow times are divided by the factor, and a linear ramp
over the feature pairs between them mixes the two; the tables are multiplied by m(--mscale) / m(--mscale-all-dim) and
the softmax scale by m(--mscale-all-dim)^2, where m(a) = 0.1 a ln(factor) + 1. The arithmetic follows transformers'
`_compute_yarn_parameters` (which DeepSeek-V3 uses) and megatron-core's `YarnRotaryEmbedding` step by step.
"""

from __future__ import annotations

import math

import torch

from paratron.config.schema import ModelConfig
from paratron.model.fused_ops import FusibleOp


def rotary_width(config: ModelConfig) -> int:
    """Features of each head that rotate: int(head width x --rotary-percent), as Megatron-LM counts them."""
    head_dim = config.kv_channels
    return int(head_dim * config.rotary_percent) if config.rotary_percent < 1.0 else head_dim


def rotary_cos_sin(
    positions: torch.Tensor, width: int, base: float, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings of `width` features, computed in fp32: [T, width] for
    positions [T], [B, 1, T, width] (one table per row, broadcast over heads) for positions [B, T].
    Pair k turns at base^(-2k / width) per position; its two features sit at k and k + width/2
    (halves) or at 2k and 2k + 1 (`interleaved`)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, width, 2, device=positions.device, dtype=torch.float32) / width))
    return _tables(positions, inv_freq, interleaved)


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles position x frequency, laid out as `rotary_cos_sin` says."""
    angles = positions.float().unsqueeze(-1) * inv_freq
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    if positions.dim() == 2:
        angles = angles.unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.size(-1) features of x [B, heads, T, head_dim] by position-dependent angles,
    pairs (i, i + width/2) or, `interleaved`, (2k, 2k + 1); the other features pass through."""
    width = cos.size(-1)
    turned, passed = x[..., :width], x[..., width:]
    if interleaved:
        even, odd = turned[..., 0::2], turned[..., 1::2]
        rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:
        first, second = turned.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    turned = (turned.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat((turned, passed), dim=-1) if passed.size(-1) else turned


def rotate_queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` of the queries and of the keys (one function, so that a fused kernel does both)."""
    return apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)


fused_rotation = FusibleOp(rotate_queries_and_keys)
"""`rotate_queries_and_keys`, one compiled kernel where --apply-rope-fusion is in effect (every attention kind's)."""


def rotary_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's cos/sin tables for `positions` ([T] or [B, T]); None without rotary embeddings. Multi-latent
    attention rotates --qk-pos-emb-head-dim features per head in interleaved pairs, with YaRN's tables under
    --rope-type yarn."""
    if config.position_embedding_type != "rope":
        return None
    if not config.multi_latent_attention:
        return rotary_cos_sin(positions, rotary_width(config), config.rotary_base, config.rotary_interleaved)
    width = config.qk_pos_emb_head_dim  # (pairs (2k, 2k + 1): DeepSeek's layout, which megatron-core's MLA keeps)
    if config.rope_type == "rope":
        return rotary_cos_sin(positions, width, config.rotary_base, interleaved=True)
    cos, sin = _tables(positions, yarn_inverse_frequencies(config, positions.device), interleaved=True)
    concentration = yarn_mscale(config.rotary_scaling_factor, config.mscale) / yarn_mscale(
        config.rotary_scaling_factor, config.mscale_all_dim
    )
    return cos * concentration, sin * concentration


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's m(a) = 0.1 a ln(factor) + 1 (1 where the factor stretches nothing)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_factor(config: ModelConfig) -> float:
    """What multi-latent attention's softmax scale 1/sqrt(query head width) is multiplied by: m(--mscale-all-dim)^2
    under YaRN, 1 otherwise."""
    if config.rope_type != "yarn":
        return 1.0
    return yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2


def yarn_inverse_frequencies(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The frequency of each rotary feature pair of multi-latent attention under YaRN [width / 2]: the plain ones
    (extrapolated) for the fast pairs, divided by the scaling factor (interpolated) for the slow ones, a linear ramp
    between the pairs the correction range's ends (rounded outwards to whole pairs) name."""
    width, base, factor = config.qk_pos_emb_head_dim, config.rotary_base, config.rotary_scaling_factor
    powers = base ** (torch.arange(0, width, 2, device=device, dtype=torch.float32) / width)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    context = config.original_max_position_embeddings

    def pair_turning(rotations: float) -> float:
        """The (fractional) feature index whose pair turns `rotations` times over the original context."""
        return width * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(config.beta_fast)), 0)
    high = min(math.ceil(pair_turning(config.beta_slow)), width - 1)
    span = (high - low) or 0.001  # (a single pair: a step, not a division by zero)
    ramp = ((torch.arange(width // 2, device=device, dtype=torch.float32) - low) / span).clamp(0, 1)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept
