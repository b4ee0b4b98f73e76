"""RMSNorm, rotary embeddings and SwiGLU as one compiled kernel each (model/fused_ops.py): inductor's
kernels give eager's outputs and gradients within 1e-5 (fp32) and do not recompile for another
sequence length; the model trains alike with the fusions on and off; a block compiled whole traces
the eager functions (nothing compiled twice); the settings and Megatron-LM's flags for them."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from paratron.commands.train import parser as train_parser
from paratron.config import build_config
from paratron.config.arguments import parse_config_arguments
from paratron.model import fused_ops
from paratron.model.fused_ops import FusibleOp, fusion_wanted
from paratron.model.gpt import GPT
from paratron.model.mlp import _swiglu
from paratron.model.norms import _rms_norm
from paratron.model.rotary import fused_rotation, rotary_cos_sin

TOLERANCE = dict(rtol=1e-5, atol=1e-5)

LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=97,
    seq_length=16,
    max_position_embeddings=16,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    rotary_percent=0.5,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _inputs(seq: int) -> dict[str, tuple]:
    """Each op's arguments after its setting, fp32, the tensors needing gradients."""
    gen = torch.Generator().manual_seed(seq)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_()

    cos, sin = rotary_cos_sin(torch.arange(seq), 8, 10000.0)
    return {
        "rms_norm": (leaf(2, seq, 32), (32,), leaf(32), 1e-5),
        "rotary": (leaf(2, 4, seq, 16), leaf(2, 2, seq, 16), cos, sin, False),
        "swiglu": (leaf(2, seq, 48), leaf(2, seq, 48)),
    }


OPS: dict[str, FusibleOp] = {"rms_norm": _rms_norm, "rotary": fused_rotation, "swiglu": _swiglu}


def _run(op: FusibleOp, fused: bool, args: tuple) -> list[torch.Tensor]:
    """Outputs and the gradients of the tensor arguments, from fresh copies of them."""
    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    out = op(fused, *args)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o * torch.linspace(-1, 1, o.size(-1))).square().sum() for o in outs).backward()
    return [*outs, *(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)]


@pytest.mark.spawns  # (inductor compiles its C++ kernels with the system compiler)
def test_inductor_kernels_equal_eager_with_gradients_and_no_recompile_for_another_length():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for name, op in OPS.items():
        op.compiled.clear()
        for seq in (12, 20):  # (the second length runs the same kernels)
            args = _inputs(seq)[name]
            fused, eager = _run(op, True, args), _run(op, False, args)
            assert len(fused) == len(eager) >= 2
            for got, want in zip(fused, eager):
                torch.testing.assert_close(got, want, **TOLERANCE)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(OPS)
    assert all(list(op.compiled) == ["inductor"] for op in OPS.values())


def _losses(settings: dict, steps: int = 3) -> list[float]:
    model = GPT(build_config(dict(LLAMA, **settings)).model)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_model_trains_alike_with_the_fusions_on_and_off(monkeypatch):
    monkeypatch.setattr(fused_ops, "BACKEND", "aot_eager")  # (inductor's kernels are checked above)
    on = dict(persist_layer_norm=True, apply_rope_fusion=True, bias_swiglu_fusion=True)
    fused = _losses(on)
    assert all("aot_eager" in op.compiled for op in OPS.values())
    assert fused == pytest.approx(_losses({}), rel=1e-5)


def test_a_compiled_block_traces_the_eager_functions():
    config = build_config(dict(LLAMA, persist_layer_norm=True, apply_rope_fusion=True, bias_swiglu_fusion=True))
    block = GPT(config.model).layers[0]
    for op in OPS.values():
        op.compiled.clear()
    cos_sin = rotary_cos_sin(torch.arange(16), 4, 10000.0)
    x = torch.randn(2, 16, 32)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # (a graph break would raise)
    out = compiled(x, cos_sin)
    assert all(not op.compiled for op in OPS.values())
    block.attention_norm.fused = block.mlp_norm.fused = block.attention.rope_fusion = block.mlp.swiglu_fusion = False
    torch.testing.assert_close(out, block(x, cos_sin), **TOLERANCE)


def test_settings_and_megatron_flags():
    assert not fusion_wanted(None, torch.device("cpu")) and not fusion_wanted(None, torch.device("meta"))
    assert fusion_wanted(None, torch.device("cuda")) and fusion_wanted(True, torch.device("cpu"))
    assert not fusion_wanted(False, torch.device("cuda"))
    names = ("persist_layer_norm", "apply_rope_fusion", "bias_swiglu_fusion")
    for argv, expected in [
        ([], None),
        (["--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion"], False),
        (["--persist-layer-norm", "--apply-rope-fusion", "--bias-swiglu-fusion"], True),
    ]:
        recipe, overrides, _ = parse_config_arguments(train_parser(), argv)
        model = build_config(overrides, recipe).model
        assert [getattr(model, name) for name in names] == [expected] * 3, argv
