"""Attention of an engine step: each sequence's new tokens over that sequence's keys in the paged cache.

A step's row holds the new tokens of many sequences; one masked attention over every key of the step would cost
(tokens x keys of all sequences), quadratic in the number of sequences. Instead:

- the decoding sequences (one new token each) attend together, as a batch with one row per sequence, over their
  own keys gathered from the cache and padded to the longest (padding masked out): cost (sequences x longest);
- each other sequence (a prompt, or a piece of one) attends alone over its own keys (SDPA's causal kernel when it
  is a whole prompt the pattern treats as causal).

The model's attention pattern (causal, sliding window, block-sparse) decides which keys each token sees.
`PagedAttention` takes the place of a layer's attention core while the engine runs a step (`paged_cores`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratron.inference.kv_cache import PagedLayerCache, StepPlan
from paratron.model.attention import AttentionPattern
from paratron.model.layer_kind import DecodeState


@dataclass
class DecodeBatch:
    """The decoding sequences of a step, batched: their rows in the step, their keys' slots [S, L] padded to the
    longest, and the mask of the keys each may see [S, 1, 1, L] (None: all of them)."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class Prompt:
    """A sequence with several new tokens: its rows, its keys' slots, and its mask (None: causal)."""

    rows: slice
    slots: torch.Tensor
    mask: torch.Tensor | None


def step_attention(plan: StepPlan, pattern: AttentionPattern) -> tuple[DecodeBatch | None, list[Prompt]]:
    """How the step's tokens attend (worked out once per step, for every layer)."""
    if "layout" in plan.attention:
        return plan.attention["layout"]
    fields = (plan.seq_rows, plan.seq_tokens, plan.seq_keys, plan.seq_lengths)
    rows, tokens, starts, lengths = (list(f) for f in torch.stack(fields).tolist())  # (one read to the host)
    decoding = [i for i, count in enumerate(tokens) if count == 1]
    batch = None
    if decoding:
        everyone = len(decoding) == len(tokens)
        pick = None if everyone else torch.tensor(decoding, device=plan.seq_rows.device)
        key_lengths = plan.seq_lengths if pick is None else plan.seq_lengths[pick]
        key_starts = plan.seq_keys if pick is None else plan.seq_keys[pick]
        longest = max(lengths[i] for i in decoding)
        places = torch.arange(longest, device=key_lengths.device)
        index = key_starts[:, None] + places[None, :]
        mask = None
        if len({lengths[i] for i in decoding}) > 1 or not pattern.causal_up_to(longest):
            present = places[None, :] < key_lengths[:, None]
            index = index.masked_fill(~present, 0)
            mask = (present & pattern.allows((key_lengths - 1)[:, None], places[None, :]))[:, None, None, :]
        batch_rows = plan.seq_rows if pick is None else plan.seq_rows[pick]
        batch = DecodeBatch(batch_rows, plan.key_slots[index], mask)
    prompts = []
    for i in sorted(set(range(len(tokens))) - set(decoding)):
        row, count, start, length = rows[i], tokens[i], starts[i], lengths[i]
        mask = None
        if not (count == length and pattern.causal_up_to(length)):  # (a whole prompt the causal kernel serves)
            queries = torch.arange(length - count, length, device=plan.key_slots.device)
            mask = pattern.allows(queries[:, None], torch.arange(length, device=queries.device)[None, :])[None, None]
        prompts.append(Prompt(slice(row, row + count), plan.key_slots[start : start + length], mask))
    plan.attention["layout"] = (batch, prompts)
    return batch, prompts


class PagedAttention(nn.Module):
    """A layer's attention over the paged cache during an engine step (see the module docstring)."""

    def __init__(self, pattern: AttentionPattern, cache: PagedLayerCache) -> None:
        super().__init__()
        self.pattern, self.cache = pattern, cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, places: object = None) -> torch.Tensor:
        """q [1, heads, T, head_dim] of the step's tokens (their keys and values already in the cache); the
        attention output [1, heads, T, head_dim]."""
        plan = self.cache.plan
        assert plan is not None
        keys, values = self.cache.keys, self.cache.values  # [slots, groups, head_dim]
        gqa = keys.size(1) != q.size(1)
        batch, prompts = step_attention(plan, self.pattern)
        if batch is not None and not prompts:  # (decoding only: the batch's rows are the step's, in order)
            y = self._decode(q[0].transpose(0, 1).unsqueeze(2), keys, values, batch, gqa)
            return y[:, :, 0].transpose(0, 1).unsqueeze(0)
        out = torch.empty_like(q)
        if batch is not None:
            y = self._decode(q[0, :, batch.rows].transpose(0, 1).unsqueeze(2), keys, values, batch, gqa)
            out[0, :, batch.rows] = y[:, :, 0].transpose(0, 1)
        for prompt in prompts:
            k_seq = keys.index_select(0, prompt.slots).transpose(0, 1).unsqueeze(0)
            v_seq = values.index_select(0, prompt.slots).transpose(0, 1).unsqueeze(0)
            out[:, :, prompt.rows] = F.scaled_dot_product_attention(
                q[:, :, prompt.rows], k_seq, v_seq, attn_mask=prompt.mask, is_causal=prompt.mask is None, enable_gqa=gqa
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: DecodeBatch, gqa: bool
    ) -> torch.Tensor:
        """Attention of the decoding sequences' queries [S, heads, 1, head_dim] over their own keys."""
        s, length = batch.slots.shape
        flat = batch.slots.flatten()
        k = keys.index_select(0, flat).view(s, length, *keys.shape[1:]).transpose(1, 2)  # [S, groups, L, head_dim]
        v = values.index_select(0, flat).view(s, length, *values.shape[1:]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, enable_gqa=gqa)


@contextlib.contextmanager
def paged_cores(cores: dict[nn.Module, PagedAttention]) -> Iterator[None]:
    """The `core` of each layer kind that keeps keys and values swapped for its paged one (`cores`: kind -> core)
    while the step runs. (Through the modules' child tables: `Module.__setattr__`'s checks cost a per-step tenth of
    a millisecond per layer.)"""
    saved = {kind: kind._modules["core"] for kind in cores}
    for kind, core in cores.items():
        kind._modules["core"] = core
    try:
        yield
    finally:
        for kind, core in saved.items():
            kind._modules["core"] = core


def key_value_kinds(model: nn.Module) -> dict[int, nn.Module]:
    """By layer number, the kind of each layer this rank holds that keeps keys and values between decoding steps
    (`DecodeState`): the layers the KV cache is for, and whose cores attend over it."""
    return {
        i: kind
        for i, layer in enumerate(model.layers)
        if layer is not None
        for kind in layer.kinds().values()
        if kind.decode_state is DecodeState.KEY_VALUE
    }
