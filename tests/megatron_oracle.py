"""megatron-core's GPTModel built on CPU in this process: the outside oracle for model parity tests.

megatron-core 0.16.1 hard-codes CUDA in a few places that a CPU build still reaches (its RNG
tracker, scratch buffers on ``torch.cuda.current_device()``, ``torch.cuda.synchronize`` in the
torch_dist writer). ``cpu_megatron()`` redirects exactly those calls to CPU for the duration of a
test and restores them afterwards; paratron itself is never patched.

Typical use::

    with cpu_megatron():
        model, config = oracle_gpt(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   vocab_size=64, max_sequence_length=16)
        logits = oracle_logits(model, tokens)
    destroy_oracle()

``cpu_optimizer()`` (inside ``cpu_megatron()``) lets megatron-core's DistributedDataParallel and
distributed optimizer run on CPU too (their scratch tensors on 'cuda', ``.cuda()`` moves and CUDA
type-name checks).

``oracle_gpt`` initialises torch.distributed (gloo, world 1, unless a process group already
exists, e.g. inside a spawned multi-rank test) and megatron's model-parallel state with the
requested TP/PP sizes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# Model-level arguments of GPTModel; every other keyword goes to TransformerConfig.
_GPT_MODEL_KWARGS = (
    "vocab_size",
    "max_sequence_length",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "seq_len_interpolation_factor",
    "parallel_output",
    "fp16_lm_cross_entropy",
    "pre_process",
    "post_process",
)

# Fusions that need CUDA kernels; the oracle always runs the plain PyTorch paths.
_FUSIONS_OFF = {
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


class _CpuLayerNormAffine:
    """Stand-in for apex's FusedLayerNormAffineFunction so megatron's FusedLayerNorm (the only
    local norm that honours layernorm_zero_centered_gamma) runs on CPU; megatron's own module
    still computes the weight it passes (``weight + 1`` for zero-centred gamma)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shape: Any, eps: float) -> Any:
        """Signature megatron inspects (no ``memory_efficient`` argument)."""
        return torch.nn.functional.layer_norm(x, tuple(shape), weight, bias, eps)

    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shape: Any, eps: float) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, tuple(shape), weight, bias, eps)


@contextlib.contextmanager
def cpu_megatron(fake_cuda_seed: int = 0) -> Iterator[None]:
    """Redirect megatron-core's hard-coded CUDA calls to CPU while the block runs.

    The "CUDA" RNG megatron's tracker forks is a private CPU generator, so seeding it never
    disturbs torch's default CPU generator (which megatron's CPU initialisation draws from).
    """
    import megatron.core.tensor_parallel.random as mrandom  # start-up speed: megatron is heavy
    from megatron.core.fusions import fused_layer_norm

    fake_cuda = torch.Generator(device="cpu")
    fake_cuda.manual_seed(fake_cuda_seed)

    def get_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        return fake_cuda.get_state()

    def set_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        fake_cuda.set_state(state)

    def manual_seed(seed: int) -> None:
        fake_cuda.manual_seed(int(seed))

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "get_rng_state", get_state),
        (torch.cuda, "set_rng_state", set_state),
        (torch.cuda, "manual_seed", manual_seed),
        (torch.cuda, "manual_seed_all", manual_seed),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda.random, "get_rng_state", get_state),
        (mrandom, "_get_cuda_rng_state", get_state),
        (mrandom, "_set_cuda_rng_state", set_state),
        (fused_layer_norm, "FusedLayerNormAffineFunction", _CpuLayerNormAffine),
        (fused_layer_norm, "HAVE_FUSED_LAYER_NORM", True),
    ]
    saved = [(owner, name, getattr(owner, name, None), hasattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value, existed in reversed(saved):
            if existed:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


class _CudaOnCpu(TorchFunctionMode):
    """Tensors made for 'cuda' are made on the CPU, `.cuda()` keeps a tensor where it is, and a CPU
    tensor's `.type()` reports the CUDA type name that megatron-core's optimizers check for."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_optimizer() -> Iterator[None]:
    """Let megatron-core's DistributedDataParallel and (distributed) optimizers run on CPU while the
    block runs (inside ``cpu_megatron()``): they allocate scratch tensors with ``device='cuda'``,
    move tensors with ``.cuda()`` and accept only parameters whose ``type()`` names CUDA. Every torch
    call in the block goes through this redirection, so keep paratron's own code outside it."""
    with _CudaOnCpu():
        yield


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_oracle_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234) -> None:
    """Process group (gloo, world 1 unless one exists), megatron's parallel state and its RNG tracker.

    Call inside ``cpu_megatron()``. Inside a spawned multi-rank test, initialise the default group
    first (world = TP x PP x DP) and call this on every rank.
    """
    from megatron.core import parallel_state  # start-up speed: megatron is heavy
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    model_parallel_cuda_manual_seed(seed)


def oracle_spec(config: Any, local_norm_is_apex: bool | None = None) -> Any:
    """megatron's local (non-TE) GPT layer spec for this TransformerConfig.

    Without apex, megatron's local spec uses torch's LayerNorm, which refuses zero-centred gamma;
    then (or when ``local_norm_is_apex``) the spec uses megatron's FusedLayerNorm with the CPU
    stand-in for apex's kernel installed by ``cpu_megatron()``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # start-up speed

    with _apex_norm(_wants_apex_norm(config) if local_norm_is_apex is None else local_norm_is_apex):
        return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def _wants_apex_norm(config: Any) -> bool:
    return config.normalization == "LayerNorm" and bool(config.layernorm_zero_centered_gamma)


@contextlib.contextmanager
def _apex_norm(enabled: bool) -> Iterator[None]:
    """Make megatron's local spec and block-final norm its FusedLayerNorm (apex path) while building."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm  # start-up speed
    from megatron.core.models import backends
    from megatron.core.transformer import transformer_block

    saved = backends.LNImpl, transformer_block.LayerNormImpl
    if enabled:
        backends.LNImpl = transformer_block.LayerNormImpl = FusedLayerNorm
    try:
        yield
    finally:
        backends.LNImpl, transformer_block.LayerNormImpl = saved


def oracle_gpt(
    tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234, **kwargs: Any
) -> tuple[torch.nn.Module, Any]:
    """Build megatron-core's GPTModel on CPU in fp32 (unless ``params_dtype`` says otherwise).

    Keywords named in ``_GPT_MODEL_KWARGS`` go to GPTModel (``vocab_size`` and
    ``max_sequence_length`` are required; embeddings are tied unless
    ``share_embeddings_and_output_weights=False``); all others go to TransformerConfig
    (``num_layers``, ``hidden_size``, ``num_attention_heads`` required). Dropout defaults to 0.
    Must run inside ``cpu_megatron()``. Returns ``(model, transformer_config)``.
    """
    from megatron.core.models.gpt import GPTModel  # start-up speed: megatron is heavy
    from megatron.core.transformer import TransformerConfig

    model_kwargs = {key: kwargs.pop(key) for key in _GPT_MODEL_KWARGS if key in kwargs}
    model_kwargs.setdefault("share_embeddings_and_output_weights", True)
    config_kwargs: dict[str, Any] = {
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "tensor_model_parallel_size": tensor_parallel,
        "pipeline_model_parallel_size": pipeline_parallel,
        **_FUSIONS_OFF,
        **kwargs,
    }
    init_oracle_parallel(tensor_parallel, pipeline_parallel, seed)
    config = TransformerConfig(**config_kwargs)
    torch.manual_seed(seed)
    with _apex_norm(_wants_apex_norm(config)):
        model = GPTModel(config=config, transformer_layer_spec=oracle_spec(config), **model_kwargs)
    return model.eval(), config


@torch.no_grad()
def oracle_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab(/TP)] of megatron's GPTModel for ``tokens`` [batch, seq], causal."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    # megatron's mask convention: True marks positions that must NOT be attended.
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)
    return model(tokens, position_ids, causal_mask.view(1, 1, seq, seq))


def destroy_oracle(destroy_process_group: bool = False) -> None:
    """Tear down megatron's model-parallel state (and the default process group if asked)."""
    from megatron.core import parallel_state  # start-up speed: megatron is heavy

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
