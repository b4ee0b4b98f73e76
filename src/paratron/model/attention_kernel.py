"""Which kernel `scaled_dot_product_attention` runs the model's attention on, for the start-up log.

SDPA picks among its kernels (cuDNN, flash, memory-efficient, math; on the CPU its own flash kernel or
math) by device, dtype, head size, mask and the priority in force. `attention_kernel` asks torch's own
dispatcher for that choice on empty tensors of one micro-batch's shape, so the log says what the layers
will run, not what they might.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from paratron.config.schema import ModelConfig
from paratron.model.attention import TokenPlaces, make_pattern

KERNEL_NAMES = {
    SDPBackend.MATH: "math (unfused, composite)",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
    SDPBackend.CUDNN_ATTENTION: "cuDNN",
    SDPBackend.OVERRIDEABLE: "the device's own (overrideable)",
}


def sdpa_choice(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    dropout: float,
    v: torch.Tensor | None = None,
) -> SDPBackend:
    """The kernel SDPA dispatches these inputs to (torch's dispatcher, under the priority in force); values as wide
    as the keys unless `v` is given."""
    gqa = k.size(-3) != q.size(-3)
    return SDPBackend(torch._fused_sdp_choice(q, k, k if v is None else v, mask, dropout, causal, enable_gqa=gqa))


def attention_kernel(config: ModelConfig, seq_length: int, device: torch.device, dtype: torch.dtype) -> str:
    """One line naming the kernel that serves the model's attention over whole rows of `seq_length`
    tokens on `device` in `dtype` (packed or split rows use the pattern's mask, as here for non-causal ones)."""
    if config.apply_query_key_layer_scaling and dtype in (torch.float16, torch.bfloat16):
        return "unfused (--apply-query-key-layer-scaling: Megatron-LM's step-by-step attention)"
    pattern = make_pattern(config)
    heads, groups, size = config.num_attention_heads, config.num_query_groups, config.kv_channels
    values = size
    if config.multi_latent_attention:  # (queries and keys of the rotary width more, values of their own)
        size, values = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    q = torch.empty(1, heads, seq_length, size, device=device, dtype=dtype)
    k = torch.empty(1, groups, seq_length, size, device=device, dtype=dtype)
    v = torch.empty(1, groups, seq_length, values, device=device, dtype=dtype)
    causal = pattern.causal_up_to(seq_length)
    mask = None if causal or pattern.sees_all else TokenPlaces.row(seq_length, device).mask(pattern, seq_length)
    choice = sdpa_choice(q, k, mask, causal, config.attention_dropout, v)
    name = KERNEL_NAMES.get(choice, choice.name.lower())
    if device.type == "cpu" and choice == SDPBackend.FLASH_ATTENTION:
        name = "flash (the CPU kernel)"
    shape = "causal" if causal else ("no mask" if mask is None else "masked")
    dropout = f", dropout {config.attention_dropout:g}" if config.attention_dropout else ""
    kind = str(dtype).removeprefix("torch.")
    head = f"head size {size}" + (f", values {values}" if values != size else "")
    return f"SDPA {name} kernel on {device.type} ({kind}, {head}, {shape}{dropout}) while training"
