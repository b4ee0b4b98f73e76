"""The attention family: which keys each query may see (a pattern) and how that is computed.

A pattern is a rule on token places: `allows(i, j)` says whether the query at place i of its
row may attend to the key at place j (elementwise, on broadcastable tensors). Packed rows add
one more rule to every pattern: a token sees only tokens of its own segment (document or
conversation). `--attention-type` picks a pattern from `ATTENTION_TYPES`:

- `causal`: j <= i (the default; SDPA's fused causal kernel);
- `sliding-window`: i - W < j <= i, the W most recent tokens (`--window-size W`, Mistral's
  `sliding_window`);
- `document`: causal within each packed document (`--reset-attention-mask`, SFT packing);
- `block-sparse`: Child et al. (2019)'s strided pattern over blocks of `--sparse-block-size`
  tokens: the `--sparse-stride` S most recent blocks, and every S-th block before them;
- `bidirectional` (not a flag's value: the vision encoder's layers): every token sees every token of its row.

A sparse pattern also names, for each block of queries, the blocks of keys it can reach
(`key_blocks`); `attend` then runs SDPA on just those blocks, so at a fixed window time and
memory grow linearly with the sequence. Other patterns run SDPA with a dense mask (or its
causal kernel). Adding an attention is one subclass registered here (docs/attention.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig

# ---------------------------------------------------------------- where the tokens sit


@dataclass
class TokenPlaces:
    """Where the queries of an attention call sit in their rows.

    `index` [Tq] is each query's place in its row (0..T-1 for a whole row; a later range when
    decoding with a cache; scattered chunks when the row is split over ranks). `segments`
    [B, S] numbers the segment of every token of the whole row (None: one segment per row).
    Keys are the row's tokens from place 0 unless a caller says otherwise."""

    index: torch.Tensor
    segments: torch.Tensor | None = None
    whole_row: bool = False
    """`index` is 0..T-1: the queries are the whole row."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def row(
        cls, length: int, device: torch.device, start: int = 0, segments: torch.Tensor | None = None
    ) -> TokenPlaces:
        """Queries at places start .. start + length - 1 of their rows."""
        return cls(torch.arange(start, start + length, device=device), segments, whole_row=start == 0)

    def cached(self, key: object, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per `TokenPlaces` (one forward pass: every layer asks the same)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def mask(self, pattern: AttentionPattern, keys: int) -> torch.Tensor:
        """[B or 1, 1, Tq, Tk] True where a query may attend to a key at places 0 .. keys - 1."""
        index = self.index
        return self.cached(
            ("mask", pattern, keys),
            lambda: allowed(pattern, index, torch.arange(keys, device=index.device), self.segments),
        )


def allowed(
    pattern: AttentionPattern, query_index: torch.Tensor, key_index: torch.Tensor, segments: torch.Tensor | None
) -> torch.Tensor:
    """[B or 1, 1, Tq, Tk] boolean mask of `pattern` between queries and keys at these places of
    rows whose tokens belong to `segments` [B, S] (None: one segment per row)."""
    mask = pattern.allows(query_index[:, None], key_index[None, :]).unsqueeze(0)
    if segments is not None:
        mask = mask & (segments[:, query_index, None] == segments[:, None, key_index])
    return mask.unsqueeze(1)


# ---------------------------------------------------------------- patterns


class AttentionPattern:
    """Which keys a query may attend to. Subclasses set `name` (the --attention-type value) and
    `allows`; a sparse one also sets `block` and `key_blocks`."""

    name: ClassVar[str]
    needs_segments: ClassVar[bool] = False
    """True when the data must mark the segments of each row (documents)."""
    block: int | None = None
    """Tokens per block of sparse execution (None: dense)."""
    sees_all: ClassVar[bool] = False
    """Every query sees every key (no mask at all)."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> AttentionPattern:
        return cls()

    def allows(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Whether a query at place `query` may attend to a key at place `key` (broadcast)."""
        raise NotImplementedError

    def key_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """[num_blocks, m] the key blocks each query block can reach, -1 padding (sparse patterns)."""
        raise NotImplementedError

    def causal_up_to(self, length: int) -> bool:
        """Whether on rows of `length` tokens the pattern is exactly j <= i (SDPA's causal kernel
        then serves it: a window longer than the row, say)."""
        return False


class Causal(AttentionPattern):
    name = "causal"

    def allows(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return key <= query

    def causal_up_to(self, length: int) -> bool:
        return True


class Document(Causal):
    """Causal attention confined to each document of a packed row (the segments say which)."""

    name = "document"
    needs_segments = True


class SlidingWindow(AttentionPattern):
    """Each token sees itself and the W - 1 tokens before it (Mistral's `sliding_window` W)."""

    name = "sliding-window"

    def __init__(self, window: int) -> None:
        self.window = window
        self.block = max(1, math.ceil(window / 2))

    @classmethod
    def from_config(cls, config: ModelConfig) -> AttentionPattern:
        assert config.window_size is not None  # (validation says so by name)
        return cls(config.window_size)

    def allows(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return (key <= query) & (key > query - self.window)

    def causal_up_to(self, length: int) -> bool:
        return length <= self.window

    def key_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        b = self.block
        reach = math.ceil((self.window - 1) / b) + 1  # blocks a query block's window can touch
        blocks = torch.arange(num_blocks, device=device)[:, None] - torch.arange(reach - 1, -1, -1, device=device)
        return blocks.masked_fill(blocks < 0, -1)


class BlockSparse(AttentionPattern):
    """Child et al. (2019)'s strided sparse attention over blocks: a query in block I sees (causally)
    the keys of blocks I - S + 1 .. I and of every block I - kS before them (S = the stride)."""

    name = "block-sparse"

    def __init__(self, block: int, stride: int) -> None:
        self.block, self.stride = block, stride

    @classmethod
    def from_config(cls, config: ModelConfig) -> AttentionPattern:
        return cls(config.sparse_block_size, config.sparse_stride)

    def allows(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        apart = torch.div(query, self.block, rounding_mode="floor") - torch.div(key, self.block, rounding_mode="floor")
        return (key <= query) & ((apart < self.stride) | (apart % self.stride == 0))

    def causal_up_to(self, length: int) -> bool:
        return length <= self.block * self.stride

    def key_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        s = self.stride
        blocks = torch.arange(num_blocks, device=device)[:, None]
        local = blocks - torch.arange(s - 1, -1, -1, device=device)  # I - S + 1 .. I
        far = blocks - s * torch.arange((num_blocks - 1) // s, 0, -1, device=device)  # .. I - 2S, I - S
        table = torch.cat((far, local), dim=1)
        return table.masked_fill(table < 0, -1)


class Bidirectional(AttentionPattern):
    """Every token sees every token of its row (an encoder's attention)."""

    name = "bidirectional"
    sees_all = True

    def allows(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(query + key, dtype=torch.bool)


ATTENTION_TYPES: dict[str, type[AttentionPattern]] = {
    cls.name: cls for cls in (Causal, SlidingWindow, Document, BlockSparse)
}
"""--attention-type values and their patterns (a language model's)."""

PATTERNS: dict[str, type[AttentionPattern]] = {**ATTENTION_TYPES, Bidirectional.name: Bidirectional}
"""Every pattern by name: the language model's, and the vision encoder's `bidirectional`."""


def make_pattern(config: ModelConfig) -> AttentionPattern:
    return PATTERNS[config.attention_type].from_config(config)


# ---------------------------------------------------------------- computing it


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, dropout: float):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, enable_gqa=k.size(-3) != q.size(-3)
    )


def query_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, H, n*b, D] -> [B*n, H, b, D]: every block of queries a batch row of its own."""
    B, H, T, D = x.shape
    return x.view(B, H, T // block, block, D).transpose(1, 2).reshape(B * (T // block), H, block, D)


def from_query_blocks(x: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of `query_blocks`; also for per-query values [B*n, H, b]."""
    n = x.size(0) // batch
    x = x.view(batch, n, *x.shape[1:]).transpose(1, 2)
    return x.reshape(batch, x.size(1), n * x.size(3), *x.shape[4:])


def gather_key_blocks(x: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """[B, G, n*b, D] -> [B*n', G, m*b, D]: for each of the n' rows of `table` [n', m], the key blocks it
    names side by side (a -1 entry gathers block 0, which the mask then hides)."""
    B, G, T, D = x.shape
    n, m = table.shape
    blocks = x.view(B, G, T // block, block, D)[:, :, table.clamp(min=0)]  # [B, G, n, m, b, D]
    return blocks.permute(0, 2, 1, 3, 4, 5).reshape(B * n, G, m * block, D)


def block_mask(
    pattern: AttentionPattern,
    query_places: torch.Tensor,
    table: torch.Tensor,
    key_start: int,
    segments: torch.Tensor | None,
) -> torch.Tensor:
    """The mask of query blocks over their gathered key blocks: [B*n or n, 1, b, m*b] for queries at
    `query_places` [n, b] of their rows and the key blocks `table` [n, m] (-1: none) numbered from
    the key at place `key_start`."""
    b = query_places.size(1)
    n, m = table.shape
    offsets = torch.arange(b, device=table.device)
    key_places = (key_start + table.clamp(min=0)[:, :, None] * b + offsets).reshape(n, m * b)
    mask = pattern.allows(query_places[:, :, None], key_places[:, None, :])  # [n, b, m*b]
    mask = mask & (table >= 0).repeat_interleave(b, dim=1)[:, None, :]
    if segments is None:
        return mask.unsqueeze(1)
    same = segments[:, query_places, None] == segments[:, key_places][:, :, None, :]  # [B, n, b, m*b]
    return (mask & same).reshape(-1, 1, b, m * b)


def blocked_attention(
    pattern: AttentionPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA of a whole row's queries [B, H, T, D] on only the key blocks `pattern.key_blocks` names
    (keys and values [B, G, T, D]): one batched call over every query block, each with its reachable
    key blocks gathered beside it. Rows are padded to whole blocks with tokens of their own segment."""
    B, _, T, _ = q.shape
    b = pattern.block
    assert b is not None
    n = -(-T // b)
    pad = n * b - T
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        segments = segments if segments is not None else torch.zeros(B, T, dtype=torch.long, device=q.device)
        segments = F.pad(segments, (0, pad), value=-1)  # (padding: a segment of its own)
    table = pattern.key_blocks(n, q.device)  # [n, m]
    mask = block_mask(pattern, torch.arange(n * b, device=q.device).view(n, b), table, 0, segments)
    if mask.size(0) != B * n:
        mask = mask.repeat(B, 1, 1, 1)
    queries = query_blocks(q, b)
    out = _sdpa(queries, gather_key_blocks(k, table, b), gather_key_blocks(v, table, b), mask, False, dropout)
    return from_query_blocks(out, B)[:, :, :T]


def attend(
    pattern: AttentionPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    places: TokenPlaces | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """`pattern`'s attention of queries [B, H, Tq, D] at `places` (default: a whole row) over the
    keys and values [B, G, Tk, D] at places 0..Tk-1 of the same rows."""
    Tq, Tk = q.size(2), k.size(2)
    whole_row = places is None or (places.whole_row and Tq == Tk)
    segments = None if places is None else places.segments
    if whole_row and segments is None and pattern.causal_up_to(Tk):
        return _sdpa(q, k, v, None, True, dropout)
    if whole_row and segments is None and pattern.sees_all:
        return _sdpa(q, k, v, None, False, dropout)
    if whole_row and pattern.block is not None:
        return blocked_attention(pattern, q, k, v, segments, dropout)
    places = places or TokenPlaces.row(Tq, q.device)
    return _sdpa(q, k, v, places.mask(pattern, Tk), False, dropout)


def attend_unfused(
    pattern: AttentionPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    places: TokenPlaces | None,
    dropout: float = 0.0,
    score_divisor: int = 1,
) -> torch.Tensor:
    """`attend` computed step by step as Megatron-LM's unfused attention does: scores
    q.k / (sqrt(d) x `score_divisor`) in the inputs' precision, multiplied back by `score_divisor`
    in fp32, masked, softmax in fp32, probabilities cast back to the inputs' precision, then
    dropout and the weighted sum of values (grouped-query heads share their group's keys)."""
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    if k.size(1) != H:
        k, v = (t.repeat_interleave(H // t.size(1), dim=1) for t in (k, v))
    scores = torch.baddbmm(
        q.new_empty(B * H, Tq, Tk),
        q.reshape(B * H, Tq, D),
        k.reshape(B * H, Tk, D).transpose(1, 2),
        beta=0.0,
        alpha=1.0 / (math.sqrt(D) * score_divisor),
    ).view(B, H, Tq, Tk)
    scores = scores.float() * score_divisor if score_divisor != 1 else scores.float()
    mask = (places or TokenPlaces.row(Tq, q.device)).mask(pattern, Tk)
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = F.dropout(torch.softmax(scores, dim=-1).to(q.dtype), dropout)
    return torch.matmul(probs, v)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + the pattern's mask) v, with dropout on the attention weights.

    A module of its own so that parallelism can run it under its own random stream, recomputation
    can recompute just this part, and context parallelism can swap in a core that attends over the
    keys of every rank.

    `layer_scaling` (the layer number under --apply-query-key-layer-scaling) runs fp16/bf16 inputs
    through `attend_unfused`, Megatron-LM's numerics for that flag; otherwise, and always in fp32
    (where the numbers are the same), fused SDPA, whose kernels keep the softmax in fp32."""

    def __init__(self, pattern: AttentionPattern, dropout: float, layer_scaling: int | None = None) -> None:
        super().__init__()
        self.pattern = pattern
        self.dropout = dropout
        self.layer_scaling = layer_scaling

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, places: TokenPlaces | None = None
    ) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.layer_scaling is not None and q.dtype in (torch.float16, torch.bfloat16):
            return attend_unfused(self.pattern, q, k, v, places, dropout, self.layer_scaling)
        return attend(self.pattern, q, k, v, places, dropout)


# ---------------------------------------------------------------- what attention asks of a KV cache (for generation)


class LayerCache(Protocol):
    """What attention asks of a layer's KV cache: take the new keys and values, give back all it attends over (the
    inference engine's paged cache, `inference.kv_cache`)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerCaches(Protocol):
    """Every layer's cache, by layer number."""

    @property
    def layers(self) -> Sequence[LayerCache | None]: ...
