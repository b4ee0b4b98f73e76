"""Attention of query blocks over one block of keys at a time, with the log-sum-exp of every
query's scores, and its backward given the whole attention's output and log-sum-exp: what a ring
needs to merge blocks that arrive one by one (the flash-attention recurrence).

On CPU these are PyTorch's own fused SDPA kernels (`_scaled_dot_product_flash_attention_for_cpu`
and its backward, which take a mask and return the log-sum-exp); elsewhere the same quantities
in plain tensor operations (scores of one block pair at a time, never kept).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads [B, G, S, D] repeated for grouped-query attention: [B, heads, S, D]."""
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _fold_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The dual of `_expand_groups` for gradients: sums each group's copies."""
    B, H, S, D = t.shape
    return t if H == groups else t.view(B, groups, H // groups, S, D).sum(dim=2)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, NEG_INF)


def _fused(q: torch.Tensor, fused: bool | None) -> bool:
    return q.device.type == "cpu" if fused is None else fused


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Tq, D] over k, v [B, G, Tk, D] alone (`mask` [B|1, 1, Tq, Tk], True
    where allowed; or `causal`, Tq == Tk): (output [B, H, Tq, D], log-sum-exp [B, H, Tq] in fp32).
    A query with no allowed key gets output 0 and log-sum-exp -inf. `fused`: PyTorch's CPU kernel
    (default on CPU) or the plain operations."""
    k, v = _expand_groups(k, q.size(1)), _expand_groups(v, q.size(1))
    if _fused(q, fused):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype)
        )
        lse = lse.float()
        if mask is not None:
            lse = lse.masked_fill(~mask.any(dim=-1), NEG_INF)
        return out, lse
    scores = _scores(q, k, mask, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs.to(v.dtype) @ v), lse


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of one block's share of an attention whose whole output is `out` and
    whole log-sum-exp is `lse` (every query has some allowed key somewhere)."""
    groups = k.size(1)
    k, v = _expand_groups(k, q.size(1)), _expand_groups(v, q.size(1))
    if _fused(q, fused):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype)
        )
    else:
        scale = q.size(-1) ** -0.5
        probs = torch.exp(_scores(q, k, mask, causal) - lse.unsqueeze(-1)).to(q.dtype)
        dv = probs.transpose(-1, -2) @ grad_out
        delta = (grad_out.float() * out.float()).sum(dim=-1, keepdim=True)
        dscores = (probs.float() * ((grad_out @ v.transpose(-1, -2)).float() - delta)).to(q.dtype)
        dq = (dscores @ k) * scale
        dk = (dscores.transpose(-1, -2) @ q) * scale
    return dq, _fold_groups(dk, groups), _fold_groups(dv, groups)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.size(-1) ** -0.5
    if causal:
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
    return scores if mask is None else scores.masked_fill(~mask, NEG_INF)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same queries over disjoint keys (out in fp32)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), 0.0, new)  # (queries that saw no key yet: both -inf)
    old_weight = torch.exp(lse - safe).unsqueeze(-1)
    block_weight = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * old_weight + block_out.float() * block_weight, new
