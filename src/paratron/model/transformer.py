"""The Transformer's pieces, shared by the language model (`model/gpt.py`) and the vision encoder
(`model/vision.py`): rotary positions, the KV cache, attention, norms, the pre-norm block and the stack of
blocks. Plain single-device PyTorch; head counts are derived from weight shapes (`view(B, T, -1, head_dim)`), so
tensor parallelism can swap `nn.Linear` for its sharded twins without touching this file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.attention import AttentionCore, TokenPlaces, make_pattern
from paratron.model.fused_ops import FusibleOp
from paratron.model.mlp import MLP, Projections
from paratron.model.moe import MoELayer

# ---------------------------------------------------------------- positions


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


_rotate = FusibleOp(rotate_queries_and_keys)


# ---------------------------------------------------------------- KV cache (for generation)


class LayerCache(Protocol):
    """What attention asks of a layer's KV cache: take the new keys and values, give back all it attends over (the
    contiguous `LayerKVCache` below; the inference engine's paged one, `inference.kv_cache`)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerCaches(Protocol):
    """Every layer's cache, by layer number."""

    @property
    def layers(self) -> Sequence[LayerCache | None]: ...


class LayerKVCache:
    """Keys and values of one layer for the positions seen so far; allocated on first use."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        """Positions held so far: the next keys and values go after them."""
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the keys and values of the new positions; all of them so far."""
        if self.keys is None:
            shape = (k.size(0), k.size(1), self.max_length, k.size(3))
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        start, end = self.length, self.length + k.size(2)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v  # type: ignore[index]
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # type: ignore[index]


class KVCache:
    """Per-layer caches; `length` is the number of positions already processed."""

    def __init__(self, num_layers: int, max_length: int) -> None:
        self.layers = [LayerKVCache(max_length) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


# ---------------------------------------------------------------- attention


class Attention(nn.Module):
    """Self-attention of the configured pattern (causal, sliding window, ...: `model/attention.py`);
    grouped-query when there are fewer key/value heads than query heads. `layer_number` (from 1, as
    Megatron-LM numbers layers) divides the scores under --apply-query-key-layer-scaling."""

    def __init__(self, config: ModelConfig, layer_number: int = 1) -> None:
        super().__init__()
        heads = config.num_attention_heads
        groups = config.num_query_groups
        self.head_dim = config.kv_channels
        bias = config.add_bias_linear
        widths = {"q": heads * self.head_dim, "k": groups * self.head_dim, "v": groups * self.head_dim}
        self.in_proj = Projections(config.hidden_size, widths, bias or config.add_qkv_bias)
        self.out_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.core = AttentionCore(
            make_pattern(config),
            config.attention_dropout,
            layer_scaling=layer_number if config.apply_query_key_layer_scaling else None,
        )
        self.rotary_interleaved = config.rotary_interleaved
        self.rope_fusion = config.apply_rope_fusion
        self.output_dropout = nn.Dropout(config.hidden_dropout)
        # (--qk-layernorm: each head's queries and keys normalized, as Qwen3's q_norm / k_norm)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_layernorm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        q, k, v = self.in_proj(x)
        if rotary is not None or self.q_norm is not None:
            # (v is a slice of the projections' one output: kept alone for backward, it would keep the unrotated
            # queries and keys alive beside their rotated copies)
            v = v.contiguous()
        B, T = q.shape[:2]  # (not x's: with sequence parallelism x holds only part of the sequence)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, groups, T, hd]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = _rotate(self.rope_fusion, q, k, *rotary, self.rotary_interleaved)
        if cache is not None:
            k, v = cache.update(k, v)
        y = self.core(q, k, v, places).transpose(1, 2).reshape(B, T, -1)
        return self.output_dropout(self.out_proj(y))


# ---------------------------------------------------------------- block and model


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm with zero-centred gamma (--apply-layernorm-1p): the scale applied is 1 + weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


_rms_norm = FusibleOp(F.rms_norm)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same parameter), run as one compiled kernel where `fused` (--persist-layer-norm) is in effect."""

    def __init__(self, size: int, eps: float, fused: bool | None = None) -> None:
        super().__init__(size, eps=eps)
        self.fused = fused

    def scale(self) -> torch.Tensor | None:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.fused, x, tuple(self.normalized_shape), self.scale(), self.eps)


class RMSNorm1P(RMSNorm):
    """RMSNorm with zero-centred gamma (--apply-layernorm-1p): the scale applied is 1 + weight."""

    def scale(self) -> torch.Tensor | None:
        return self.weight + 1


def make_norm(config: ModelConfig, size: int | None = None) -> nn.Module:
    """The model's norm over `size` features (default: the hidden size)."""
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        rms = RMSNorm1P if config.apply_layernorm_1p else RMSNorm
        return rms(size, config.norm_epsilon, config.persist_layer_norm)
    return (LayerNorm1P if config.apply_layernorm_1p else nn.LayerNorm)(size, eps=config.norm_epsilon)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)); in an MoE layer the
    MLP is a mixture of experts (`model/moe.py`)."""

    def __init__(self, config: ModelConfig, moe: bool = False, layer_number: int = 1) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config, layer_number)
        self.mlp_norm = make_norm(config)
        self.mlp = MoELayer(config) if moe else MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotary, cache, places)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLayers(nn.ModuleList):
    """The stack of blocks. `forward` runs a contiguous range of them in order: all of them in
    the whole model, its own layers in a pipeline stage. (A module of its own, so that
    recomputation can swap in a stack that recomputes groups of layers.)"""

    def forward(
        self,
        x: torch.Tensor,
        indices: range,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCaches | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        for i in indices:
            x = self[i](x, rotary, cache.layers[i] if cache is not None else None, places)
        return x
