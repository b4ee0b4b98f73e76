"""The paged KV cache: every layer's keys and values in blocks of a fixed number of tokens.

The cache is one pool of blocks per layer, allocated once to the size the memory budget allows. A sequence holds
whole blocks, listed in its block table: the keys of its token at position p sit in block table[p // block_size] at
offset p % block_size (its "slot"). Blocks are taken as a sequence grows and given back when it ends, so
requests of any length share the memory without padding, and one that finishes frees room at once.

An engine step runs the new tokens of several sequences as one row (`StepPlan`): each layer writes the new keys
and values to their slots, then each sequence's tokens attend over its own keys (`inference.paged_attention`). Two
sides:

- `BlockPool` (the controller rank): which blocks are free;
- `PagedKVCache` (every rank, for the layers it runs): the tensors, and the step's slots (`prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class BlockPool:
    """The free blocks of the cache (bookkeeping only: the controller decides, every rank's cache follows)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # (popped from the end: block 0 first)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def take(self, count: int) -> list[int]:
        """`count` free blocks (the caller checked that there are enough)."""
        if count > len(self._free):
            raise RuntimeError(f"{count} blocks asked of a pool with {len(self._free)} free")
        taken = self._free[len(self._free) - count :][::-1]
        del self._free[len(self._free) - count :]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class StepPlan:
    """One engine step, as every rank runs it: the new tokens of the step's S sequences side by side in one row.

    Tensors are on the device. `key_slots` lists, sequence after sequence, the slots of every position each sequence
    holds after the step (its cached tokens and its new ones); the `seq_*` fields say where each sequence's part of
    the row and of `key_slots` lies."""

    input_ids: torch.Tensor
    """[T] the new tokens."""
    positions: torch.Tensor
    """[T] their positions in their sequences."""
    slots: torch.Tensor
    """[T] where their keys and values go (block x block_size + offset)."""
    key_slots: torch.Tensor
    """[K] the slots of every key the step's tokens may attend to."""
    seq_rows: torch.Tensor
    """[S] each sequence's first token in the row."""
    seq_tokens: torch.Tensor
    """[S] its new tokens (1 for a decoding sequence; a prompt, or a piece of it, otherwise)."""
    seq_keys: torch.Tensor
    """[S] where its keys start in `key_slots`."""
    seq_lengths: torch.Tensor
    """[S] its keys: positions 0 .. length - 1."""
    logit_rows: torch.Tensor
    """[R] the tokens whose next-token logits the step returns (a sequence's last, and prompt tokens to score)."""
    images: torch.Tensor | None = None
    """[N, 3, H, W] the images whose placeholders are among the new tokens, in order (vision-language models)."""
    attention: dict = field(default_factory=dict, repr=False, compare=False)
    """What attention works out once per step for every layer (`inference.paged_attention`)."""

    SIZED = {
        "T": ("input_ids", "positions", "slots"),
        "K": ("key_slots",),
        "S": ("seq_rows", "seq_tokens", "seq_keys", "seq_lengths"),
        "R": ("logit_rows",),
    }
    """The index fields by the size they share (in the order they travel)."""


class PagedLayerCache:
    """One layer's keys and values: [num_blocks x block_size, key/value heads, head width] each (slot-major: the
    keys gathered for a step are whole rows of memory)."""

    def __init__(self, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(slots, heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.plan: StepPlan | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new keys and values k, v [1, heads, T, head_dim] in their slots (attention then reads
        each sequence's keys from the cache: `inference.paged_attention.PagedAttention`)."""
        plan = self.plan
        assert plan is not None, "PagedKVCache.prepare(plan) before running the layers"
        self.keys.index_copy_(0, plan.slots, k[0].transpose(0, 1).to(self.keys.dtype))
        self.values.index_copy_(0, plan.slots, v[0].transpose(0, 1).to(self.values.dtype))
        return k, v


class PagedKVCache:
    """The cache of the layers this rank runs (`layers[i]` None for the others); see the module's docstring."""

    def __init__(
        self,
        layer_numbers: list[int],
        num_layers: int,
        num_blocks: int,
        block_size: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        slots = num_blocks * block_size
        self.layers: list[PagedLayerCache | None] = [None] * num_layers
        for i in layer_numbers:
            self.layers[i] = PagedLayerCache(slots, heads, head_dim, dtype, device)

    def prepare(self, plan: StepPlan) -> None:
        """Make `plan` the step every layer reads its slots from."""
        for layer in self.layers:
            if layer is not None:
                layer.plan = plan


def bytes_per_token(layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Memory of one token's keys and values over `layers` layers of `heads` key/value heads."""
    return 2 * layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()
