"""The attention family against references written from each pattern's definition: a dense
boolean mask built by looping over (query, key) pairs, run through plain softmax attention.
Forward outputs and the gradients of queries, keys and values must agree; the sparse execution
must touch a number of key blocks that does not grow with the sequence."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from paratron.config import build_config
from paratron.config.schema import ModelConfig
from paratron.model.attention import (
    ATTENTION_TYPES,
    BlockSparse,
    Causal,
    Document,
    SlidingWindow,
    TokenPlaces,
    attend,
)
from paratron.model.gpt import build_model

from tiny import LLAMA_FLAVOUR, decoding_error


def reference_mask(name: str, length: int, segments: torch.Tensor | None, **settings) -> torch.Tensor:
    """[B, 1, T, T] from the documented rule, one pair at a time."""

    def allowed(i: int, j: int) -> bool:
        if j > i:
            return False
        if name == "sliding-window":
            return i - j < settings["window"]
        if name == "block-sparse":
            apart = i // settings["block"] - j // settings["block"]
            return apart < settings["stride"] or apart % settings["stride"] == 0
        return True

    base = torch.tensor([[allowed(i, j) for j in range(length)] for i in range(length)])
    if segments is None:
        return base[None, None]
    same = segments[:, :, None] == segments[:, None, :]
    return (base & same).unsqueeze(1)


def reference_attention(q, k, v, mask):
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


PATTERNS = {
    "causal": (Causal(), {}),
    "sliding-window": (SlidingWindow(5), {"window": 5}),
    "sliding-window-wide": (SlidingWindow(16), {"window": 16}),
    "block-sparse": (BlockSparse(4, 2), {"block": 4, "stride": 2}),
    "block-sparse-stride-3": (BlockSparse(3, 3), {"block": 3, "stride": 3}),
    "document": (Document(), {}),
}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("case", list(PATTERNS))
def test_each_pattern_equals_its_dense_masked_definition_with_gradients(case, packed):
    pattern, settings = PATTERNS[case]
    torch.manual_seed(0)
    B, H, G, T, D = 2, 4, 2, 37, 8  # (37: not a multiple of any block, so rows are padded)
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, G, T, D), torch.randn(B, G, T, D)
    segments = None
    if packed:
        segments = torch.tensor([[0] * 11 + [1] * 20 + [2] * 6, [0] * 30 + [1] * 7])
    places = TokenPlaces.row(T, q.device, segments=segments)
    name = case.rsplit("-", 1)[0] if case.endswith(("-wide", "-3")) else case
    if case == "block-sparse-stride-3":
        name = "block-sparse"
    mask = reference_mask(name, T, segments, **settings)

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(pattern, *inputs, places)
    expected_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*expected_inputs, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for got, want in zip(inputs, expected_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


def test_a_window_reaches_a_fixed_number_of_key_blocks_whatever_the_length():
    window = SlidingWindow(64)
    widths = {n: window.key_blocks(n, torch.device("cpu")).shape[1] for n in (4, 64, 1024)}
    assert set(widths.values()) == {3}  # (blocks of W/2: its own, and the two before)
    table = window.key_blocks(6, torch.device("cpu"))
    assert table[0].tolist() == [-1, -1, 0] and table[5].tolist() == [3, 4, 5]
    sparse = BlockSparse(4, 2).key_blocks(7, torch.device("cpu"))
    assert sparse[6].tolist() == [0, 2, 4, 5, 6]  # every second block back (0, 2, 4), then the local 5, 6


def test_decoding_with_a_cache_gives_the_logits_of_the_whole_window_run():
    """Prompt pieces of 5 and decoded tokens past the window of 6 attend over the cached keys the window keeps."""
    config = dataclasses.replace(LLAMA_FLAVOUR, attention_type="sliding-window", window_size=6)
    model = build_model(config, seed=1).eval()
    prompt = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    assert decoding_error(model, prompt, new_tokens=8, chunk=5) < 1e-4


def test_document_attention_trains_each_document_as_if_alone():
    """Packed documents: the summed loss's gradient equals the sum of each document's own."""
    config = dataclasses.replace(LLAMA_FLAVOUR, attention_type="document")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    lengths = [7, 11, 6]
    segments = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]])
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    packed_model, alone_model = build_model(config, seed=3), build_model(config, seed=3)
    packed_model(ids, position_ids=positions, segment_ids=segments).sum().backward()
    start = 0
    for n in lengths:
        alone_model(ids[:, start : start + n]).sum().backward()
        start += n
    for (name, a), b in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_registry_names_every_documented_type():
    assert set(ATTENTION_TYPES) == {"causal", "sliding-window", "document", "block-sparse"}
    choices = re.findall(r"'([^']+)'", ModelConfig.__dataclass_fields__["attention_type"].type)
    assert set(choices) == set(ATTENTION_TYPES)  # (the flag's choices are the registry)
    config = build_config({"attention_type": "block-sparse", "sparse_block_size": 8, "sparse_stride": 2})
    model = build_model(dataclasses.replace(config.model, vocab_size=97), seed=0)
    pattern = model.layers[0].attention.core.pattern
    assert isinstance(pattern, BlockSparse) and (pattern.block, pattern.stride) == (8, 2)


def test_model_flops_count_the_keys_a_sparse_pattern_computes():
    from paratron.training.flops import attended_keys, training_flops_per_token

    window = dataclasses.replace(LLAMA_FLAVOUR, attention_type="sliding-window", window_size=16)
    sparse = dataclasses.replace(LLAMA_FLAVOUR, attention_type="block-sparse", sparse_block_size=8, sparse_stride=2)
    assert attended_keys(LLAMA_FLAVOUR, 64) == 64 and attended_keys(window, 64) == 16 and attended_keys(window, 8) == 8
    assert attended_keys(sparse, 64) == 48  # 2 local blocks and 4 strided ones (of 8) of 8 tokens
    assert training_flops_per_token(window, 64) < training_flops_per_token(LLAMA_FLAVOUR, 64)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "plain-ops"])
def test_ring_block_kernels_merge_to_whole_attention(fused):
    """The per-block kernels of context parallelism (PyTorch's CPU flash kernel, and the plain
    operations other devices use): blocks of keys merged by log-sum-exp give the whole attention,
    and each block's backward against the whole output gives its gradients, with a query that
    sees no key of one block."""
    from paratron.parallel.context.kernels import NEG_INF, block_backward, block_forward, merge

    torch.manual_seed(0)
    B, H, G, T, D = 2, 4, 2, 12, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, G, T, D), torch.randn(B, G, T, D)
    mask = reference_mask("sliding-window", T, None, window=4)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*inputs, mask)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out, lse = torch.zeros(B, H, T, D), torch.full((B, H, T), NEG_INF)
    blocks = (slice(0, 6), slice(6, 12))  # (queries 0-5 see nothing of the second block)
    for keys in blocks:
        part, part_lse = block_forward(q, k[:, :, keys], v[:, :, keys], mask[..., keys], False, fused)
        out, lse = merge(out, lse, part, part_lse)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys in blocks:
        a, b, c = block_backward(grad, q, k[:, :, keys], v[:, :, keys], out, lse, mask[..., keys], False, fused)
        dq += a
        dk[:, :, keys] += b
        dv[:, :, keys] += c
    for got, (name, want) in zip((dq, dk, dv), zip("qkv", inputs)):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-5, msg=name)
