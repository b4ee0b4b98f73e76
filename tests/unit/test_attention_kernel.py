"""The start-up log names the SDPA kernel that serves the model's attention, as torch's dispatcher picks it:
on the CPU its flash kernel without dropout, math with it; Megatron-LM's unfused path where the flags ask."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend

from paratron.commands.train import train_config
from paratron.distributed.init import attention_kernel_priority
from paratron.model.attention_kernel import attention_kernel

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TINY += ["--max-position-embeddings", "32", "--micro-batch-size", "1", "--mock-data"]
CPU = torch.device("cpu")


def kernel(*flags: str, dtype: torch.dtype = torch.float32) -> str:
    return attention_kernel(train_config([*TINY, *flags]).model, 32, CPU, dtype)


def test_the_cpu_flash_kernel_without_dropout():
    line = kernel("--attention-dropout", "0")
    assert line == "SDPA flash (the CPU kernel) kernel on cpu (float32, head size 16, causal) while training"
    assert kernel("--attention-dropout", "0", "--group-query-attention", "--num-query-groups", "2").startswith(
        "SDPA flash (the CPU kernel)"
    )
    sliding = kernel("--attention-dropout", "0", "--attention-type", "sliding-window", "--window-size", "8")
    assert sliding.startswith("SDPA flash (the CPU kernel)") and "masked" in sliding


def test_dropout_sends_the_cpu_to_the_math_kernel():
    line = kernel("--attention-dropout", "0.1", dtype=torch.bfloat16)
    assert (
        line
        == "SDPA math (unfused, composite) kernel on cpu (bfloat16, head size 16, causal, dropout 0.1) while training"
    )


def test_layer_scaling_in_bf16_runs_unfused():
    assert kernel("--apply-query-key-layer-scaling", "--bf16", dtype=torch.bfloat16).startswith("unfused")


def test_the_cpu_keeps_torchs_own_priority():
    assert isinstance(attention_kernel_priority(CPU), contextlib.nullcontext)


def test_hopper_tries_cudnn_then_flash_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    before = torch._C._get_sdp_priority_order()
    with attention_kernel_priority(torch.device("cuda", 0)):
        order = torch._C._get_sdp_priority_order()
        assert order[:2] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)]
    assert torch._C._get_sdp_priority_order() == before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert isinstance(attention_kernel_priority(torch.device("cuda", 0)), contextlib.nullcontext)


def test_multi_latent_attention_names_its_query_and_value_widths():
    mla = ["--position-embedding-type", "rope", "--multi-latent-attention", "--qk-head-dim", "8"]
    line = kernel("--attention-dropout", "0", *mla, "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6")
    assert "(float32, head size 12, values 6, causal)" in line
