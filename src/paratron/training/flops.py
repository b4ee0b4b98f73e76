"""Model FLOPs for throughput and MFU (model FLOPs utilization, as in the PaLM paper).

Training FLOPs per token = 6 x P_matmul + 12 x L x s x d_attn, where
  P_matmul = weights of every matrix multiply a token goes through (attention and MLP
             projections, the output layer; under MoE the router, its top-k experts and the
             shared expert, the active parameters; embeddings are lookups and do not count),
  L x d_attn = the attention layers' heads x head width, summed, s = the keys a query attends to.
6 = 2 (multiply + add) x 3 (forward, and backward for inputs and for weights). The
attention term counts QK^T and attention x V over the full s x s square, like Megatron-LM, with
s the sequence length; a sparse pattern counts the keys it computes (a window of W: min(W, s);
block-sparse: its S local blocks and every S-th block before them).
Recomputation does not change model FLOPs: MFU measures useful work. A vision-language model adds its images'
encoder and projector FLOPs (`vision_flops_per_image`), counted per image (tile) the step ran.
"""

from __future__ import annotations

import time

import torch

from paratron.config.precision import PRECISION_DTYPES
from paratron.config.schema import ModelConfig
from paratron.distributed.init import accelerator_peak_flops, synchronize
from paratron.model.transformer import layer_kinds


def matmul_parameters(config: ModelConfig) -> int:
    """Weights of the matrix multiplies one token goes through, as each layer's kinds count them
    (`LayerKind.matmul_weights`: under MoE the router, the top-k routed experts and the shared expert, the active
    parameters only), and the output layer."""
    layers = sum(kind.matmul_weights(config) for kinds in layer_kinds(config) for kind in kinds)
    return layers + config.hidden_size * (config.vocab_size or 0)


def attention_width(config: ModelConfig) -> int:
    """Heads x head width of the attention scores of every layer, summed (`LayerKind.attention_width`)."""
    return sum(kind.attention_width(config) for kinds in layer_kinds(config) for kind in kinds)


def attended_keys(config: ModelConfig, seq_length: int) -> int:
    """The keys counted per query for the attention term (see the module docstring)."""
    if config.attention_type == "sliding-window" and config.window_size:
        return min(seq_length, config.window_size)
    if config.attention_type == "block-sparse":
        blocks = -(-seq_length // config.sparse_block_size)
        return min(seq_length, (config.sparse_stride + blocks // config.sparse_stride) * config.sparse_block_size)
    return seq_length


def training_flops_per_token(config: ModelConfig, seq_length: int) -> float:
    keys = attended_keys(config, seq_length)
    return 6.0 * matmul_parameters(config) + 12.0 * keys * attention_width(config)


def vision_flops_per_image(config: ModelConfig) -> float:
    """Training FLOPs of one image through the vision encoder and the projector (0 without an encoder).

    Counted as the language model's: 2 per multiply-add, forward + backward. The encoder's layers that run
    (`config.vision_run_layers`) see T = patches (+ CLIP's class token) tokens: 6 x (4 w^2 + 2 w f) x T for their
    projections and MLP and 12 x T^2 x w for the attention scores and their product with the values (w the
    encoder's width, f its MLP width). The patch embedding is a matmul of 3 p^2 x w weights over the patches whose
    input (pixels) takes no gradient: 4 x weights x patches. The projector runs over the image tokens. A frozen
    encoder runs forward only (nothing in it needs a gradient), and the projector's first matmul then takes no input
    gradient."""
    if not config.has_vision:
        return 0.0
    width, ffn = config.vision_hidden_size, config.vision_ffn_hidden_size
    tokens = config.num_patches + int(config.class_token)
    layers = config.vision_run_layers
    trains = config.encoder_trains
    passes = 6.0 if trains else 2.0  # (forward; + input and weight gradients)
    layer_weights = 4 * width * width + 2 * width * ffn
    encoder = passes * layers * (layer_weights * tokens + 2 * tokens * tokens * width)
    patch_weights = 3 * config.patch_dim**2 * width
    encoder += (4.0 if trains else 2.0) * patch_weights * config.num_patches
    lm = config.hidden_size
    second = lm * lm if config.vision_projection == "mlp" else 0  # (its input comes from trained weights)
    projector = (6.0 if trains else 4.0) * width * lm + 6.0 * second
    return encoder + projector * config.image_tokens


_PROBED: dict[tuple, float] = {}
"""Probes made in this process (a device's peak does not change while it runs; tests train many runs in one)."""
SLOW_MATMUL_S = 0.1
"""A probe matmul that took longer (a type the CPU has no fast instructions for: bf16 without AVX-512 BF16 or AMX)
is measured once, and no larger size is tried: its rate is known well enough, and a 1024-wide bf16 matmul can
take seconds."""


def probe_peak_flops(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    sizes: tuple[int, ...] = (),
    repeats: int = 3,
    size: int | None = None,
) -> float:
    """Best measured FLOP/s of square matmuls in `dtype` (and in fp32, whichever is faster), over a
    few sizes: a practical peak of the device for the precision the model computes in. A 16-bit
    matmul can be several times faster than fp32 on a CPU with bf16 instructions, so a probe in
    fp32 alone understates a bf16 run's peak (MFU above 100%). About 20 ms on a CPU with fast
    matmuls in `dtype`, well under a second without; once per process and settings. `size` probes
    that one size only."""
    sizes = (size,) if size else sizes or ((512, 1024) if device.type == "cpu" else (4096,))
    key = (device, dtype, sizes, repeats, torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _probe(device, dtype, sizes, repeats)
    return _PROBED[key]


def _probe(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], repeats: int) -> float:
    generator = torch.Generator(device=device).manual_seed(0)  # leave the global RNG (dropout) untouched
    best = 0.0
    for kind in dict.fromkeys((dtype, torch.float32)):
        for size in sizes:
            a = torch.randn(size, size, device=device, generator=generator).to(kind)
            b = torch.randn(size, size, device=device, generator=generator).to(kind)
            fastest = float("inf")
            for run in range(repeats + 1):  # (the first warms up, unless it is slow: then it is the measure)
                synchronize(device)
                start = time.perf_counter()
                a @ b
                synchronize(device)
                elapsed = time.perf_counter() - start
                if run or elapsed > SLOW_MATMUL_S:
                    fastest = min(fastest, elapsed)
                if elapsed > SLOW_MATMUL_S:
                    break
            best = max(best, 2.0 * size**3 / fastest)
            if fastest > SLOW_MATMUL_S:
                break
    return best


def peak_flops(device: torch.device, configured_tflops: float | None, precision: str = "fp32") -> tuple[float, str]:
    """Peak FLOP/s of one device for a run in `precision` and where the number came from."""
    if configured_tflops:
        return configured_tflops * 1e12, "--peak-tflops"
    known = accelerator_peak_flops(device)
    if known:
        return known, "spec sheet"
    dtype = PRECISION_DTYPES[precision] if device.type == "cpu" else torch.bfloat16
    return probe_peak_flops(device, dtype), f"{str(dtype).removeprefix('torch.')} matmul probe"


def bounded_mfu(achieved: float, peak: float) -> tuple[float, float, bool]:
    """MFU never above 1: a step faster than the peak (a probe that ran while the machine was
    busy) raises the peak to what was achieved. Returns (mfu, the peak, whether it was raised)."""
    if achieved > peak > 0:
        return 1.0, achieved, True
    return (achieved / peak if peak > 0 else 0.0), peak, False
