"""The work of one ring step: the local queries' chunks against the visiting keys' chunks.

Under context parallelism each rank holds two chunks of every row; at each step of the ring it
attends with each of its query chunks to each chunk of the visiting key/value block. The pattern
decides, from the chunks' places alone, how each pair is computed (`ring_plan`):

- not at all, when it connects no query of one chunk to any key of the other (half the pairs
  under a causal mask: the load balance's gain);
- whole, with no mask, or with SDPA's causal kernel on a chunk against itself;
- for a sparse pattern (a window, block-sparse), over only the key blocks each query block
  reaches, as `model.attention.blocked_attention` does for a whole row: linear memory in the
  chunk, not quadratic;
- otherwise with the pair's dense mask (and always with it for packed rows' documents).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from paratron.distributed.topology import RankGroup
from paratron.model.attention import (
    AttentionPattern,
    TokenPlaces,
    allowed,
    block_mask,
    from_query_blocks,
    gather_key_blocks,
    query_blocks,
)
from paratron.parallel.context.kernels import block_backward, block_forward
from paratron.parallel.context.split import chunk_ids


@dataclass(frozen=True)
class BlockPair:
    """One chunk of local queries against one chunk of the visiting keys."""

    queries: slice
    keys: slice
    mask: torch.Tensor | None
    causal: bool
    blocks: torch.Tensor | None = None
    """[n, m] for a sparse pair: the key blocks (of the key chunk) each of its n query blocks
    reaches, -1 padding; `mask` is then per query block over its gathered keys."""
    block: int = 0


@functools.lru_cache(maxsize=4096)
def _coverage(pattern: AttentionPattern, query_chunk: int, key_chunk: int, chunk: int) -> str:
    """How the pattern connects two chunks of a row: "none", "full", "causal" (exactly j <= i) or
    "partial". (Read a slice of query rows at a time: chunks of long rows are long.)"""
    keys = key_chunk * chunk + torch.arange(chunk)
    seen_any, seen_all, causal = False, True, query_chunk == key_chunk
    for first in range(0, chunk, 1024):
        rows = torch.arange(first, min(first + 1024, chunk))
        allows = pattern.allows((query_chunk * chunk + rows)[:, None], keys[None, :])
        seen_any, seen_all = seen_any or bool(allows.any()), seen_all and bool(allows.all())
        causal = causal and torch.equal(allows, rows[:, None] >= torch.arange(chunk)[None, :])
    if not seen_any:
        return "none"
    return "full" if seen_all else "causal" if causal else "partial"


def _sparse_pair(
    pattern: AttentionPattern, query_chunk: int, key_chunk: int, chunk: int, segments: torch.Tensor | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks (of the key chunk) each query block of a sparse pair reaches, [n, m] with -1
    padding, and the mask over them (`model.attention.block_mask`)."""
    b = pattern.block
    assert b is not None
    n = chunk // b
    table = pattern.key_blocks((query_chunk + 1) * n, device)  # (rows of earlier blocks do not depend on later ones)
    table = table[query_chunk * n : (query_chunk + 1) * n] - key_chunk * n
    table = table.masked_fill((table < 0) | (table >= n), -1).sort(dim=1, descending=True).values
    table = table[:, : int((table >= 0).sum(dim=1).max())]  # (valid blocks first; as many as a row needs)
    query_places = query_chunk * chunk + torch.arange(chunk, device=device).view(n, b)
    return table, block_mask(pattern, query_places, table, key_chunk * chunk, segments)


def ring_plan(pattern: AttentionPattern, places: TokenPlaces, group: RankGroup) -> list[list[BlockPair]]:
    """For each ring step, the block pairs to compute (the visitor at step s is rank i - s's block)."""
    cp, rank, chunk = group.size, group.rank, places.index.numel() // 2
    device = places.index.device
    sparse = pattern.block is not None and pattern.block < chunk and chunk % pattern.block == 0
    steps = []
    for step in range(cp):
        pairs = []
        for a, query_chunk in enumerate(chunk_ids(cp, rank)):
            for b, key_chunk in enumerate(chunk_ids(cp, (rank - step) % cp)):
                how = _coverage(pattern, query_chunk, key_chunk, chunk)
                if how == "none":
                    continue
                window = slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
                if how == "partial" and sparse:
                    table, mask = _sparse_pair(pattern, query_chunk, key_chunk, chunk, places.segments, device)
                    pairs.append(BlockPair(*window, mask, False, table, pattern.block))  # type: ignore[arg-type]
                    continue
                mask = None
                if how == "partial" or places.segments is not None:
                    q = torch.arange(query_chunk * chunk, (query_chunk + 1) * chunk, device=device)
                    k = torch.arange(key_chunk * chunk, (key_chunk + 1) * chunk, device=device)
                    mask = allowed(pattern, q, k, places.segments)
                pairs.append(BlockPair(*window, mask, how == "causal" and mask is None))
        steps.append(pairs)
    return steps


# ---------------------------------------------------------------- sparse pairs: blocks side by side


def _from_key_blocks(grad: torch.Tensor, table: torch.Tensor, b: int, shape: torch.Size) -> torch.Tensor:
    """Sum the gradients of gathered key blocks [B*n, G, m*b, D] back into [B, G, n*b, D]."""
    B, G, T, D = shape
    n, m = table.shape
    grad = grad.view(B, n, G, m, b, D).permute(0, 2, 1, 3, 4, 5)  # [B, G, n, m, b, D]
    grad = grad * (table >= 0)[None, None, :, :, None, None]
    out = grad.new_zeros(B, G, n, b, D)
    out.index_add_(2, table.clamp(min=0).flatten(), grad.reshape(B, G, n * m, b, D))
    return out.view(B, G, T, D)


def pair_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pair: BlockPair
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp of the pair's queries over its keys (`kernels.block_forward`)."""
    q, k, v = q[:, :, pair.queries], k[:, :, pair.keys], v[:, :, pair.keys]
    if pair.blocks is None:
        return block_forward(q, k, v, pair.mask, pair.causal)
    table, b = pair.blocks, pair.block
    queries = query_blocks(q, b)
    out, lse = block_forward(
        queries, gather_key_blocks(k, table, b), gather_key_blocks(v, table, b), _per_block_mask(pair, queries), False
    )
    return from_query_blocks(out, q.size(0)), from_query_blocks(lse, q.size(0))


def _per_block_mask(pair: BlockPair, queries: torch.Tensor) -> torch.Tensor:
    """The pair's mask for every row's query blocks (B*n of them: one mask shared by the rows unless
    their documents differ)."""
    assert pair.mask is not None
    return (
        pair.mask
        if pair.mask.size(0) == queries.size(0)
        else pair.mask.repeat(queries.size(0) // pair.mask.size(0), 1, 1, 1)
    )


def pair_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pair: BlockPair,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the pair's queries, keys and values given the whole attention's output and
    log-sum-exp (`kernels.block_backward`)."""
    qs, ks = pair.queries, pair.keys
    q, k, v, grad_out, out, lse = (
        q[:, :, qs],
        k[:, :, ks],
        v[:, :, ks],
        grad_out[:, :, qs],
        out[:, :, qs],
        lse[:, :, qs],
    )
    if pair.blocks is None:
        return block_backward(grad_out, q, k, v, out, lse, pair.mask, pair.causal)
    table, b = pair.blocks, pair.block
    queries = query_blocks(q, b)
    dq, dk, dv = block_backward(
        query_blocks(grad_out, b),
        queries,
        gather_key_blocks(k, table, b),
        gather_key_blocks(v, table, b),
        query_blocks(out, b),
        query_blocks(lse.unsqueeze(-1), b).squeeze(-1),
        _per_block_mask(pair, queries),
        False,
    )
    return (
        from_query_blocks(dq, q.size(0)),
        _from_key_blocks(dk, table, b, k.shape),
        _from_key_blocks(dv, table, b, v.shape),
    )
