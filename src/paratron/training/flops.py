"""Model FLOPs for throughput and MFU (model FLOPs utilization, as in the PaLM paper).

Training FLOPs per token = 6 x P_matmul + 12 x L x s x d_attn, where
  P_matmul = weights of every matrix multiply a token goes through (attention and MLP
             projections, the output layer; under MoE the router, its top-k experts and the
             shared expert, the active parameters; embeddings are lookups and do not count),
  L = layers, s = the keys a query attends to, d_attn = heads x head width.
6 = 2 (multiply + add) x 3 (forward, and backward for inputs and for weights). The
attention term counts QK^T and attention x V over the full s x s square, like Megatron-LM, with
s the sequence length; a sparse pattern counts the keys it computes (a window of W: min(W, s);
block-sparse: its S local blocks and every S-th block before them).
Recomputation does not change model FLOPs: MFU measures useful work.
"""

from __future__ import annotations

import time

import torch

from paratron.config.schema import ModelConfig
from paratron.distributed.init import accelerator_peak_flops


def matmul_parameters(config: ModelConfig) -> int:
    """Weights of the matrix multiplies one token goes through: under MoE, the router, the top-k
    routed experts and the shared expert of each MoE layer (active parameters only)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or h // heads
    projections = 3 if config.activation == "swiglu" else 2
    attention = h * heads * head_dim * 2 + h * groups * head_dim * 2
    dense = projections * h * (config.ffn_hidden_size or 4 * h)
    moe = 0
    if config.num_experts:
        expert = projections * h * (config.moe_ffn_hidden_size or config.ffn_hidden_size or 4 * h)
        shared = projections * h * (config.moe_shared_expert_intermediate_size or 0)
        moe = config.num_experts * h + config.moe_router_topk * expert + shared + h * config.moe_shared_expert_gate
    layers = config.moe_layers()
    mlps = sum(moe if is_moe else dense for is_moe in layers)
    return config.num_layers * attention + mlps + h * (config.vocab_size or 0)


def attended_keys(config: ModelConfig, seq_length: int) -> int:
    """The keys counted per query for the attention term (see the module docstring)."""
    if config.attention_type == "sliding-window" and config.window_size:
        return min(seq_length, config.window_size)
    if config.attention_type == "block-sparse":
        blocks = -(-seq_length // config.sparse_block_size)
        return min(seq_length, (config.sparse_stride + blocks // config.sparse_stride) * config.sparse_block_size)
    return seq_length


def training_flops_per_token(config: ModelConfig, seq_length: int) -> float:
    heads = config.num_attention_heads
    d_attn = heads * (config.kv_channels or config.hidden_size // heads)
    keys = attended_keys(config, seq_length)
    return 6.0 * matmul_parameters(config) + 12.0 * config.num_layers * keys * d_attn


def probe_peak_flops(device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """Best measured FLOP/s of a square fp32 matmul (bf16 on accelerators): the CPU's practical peak."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type != "cpu":
        size *= 4
    generator = torch.Generator(device=device).manual_seed(0)  # leave the global RNG (dropout) untouched
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type != "cpu":
            torch.accelerator.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, configured_tflops: float | None) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number came from."""
    if configured_tflops:
        return configured_tflops * 1e12, "--peak-tflops"
    known = accelerator_peak_flops(device)
    if known:
        return known, "spec sheet"
    return probe_peak_flops(device), "matmul probe"
