"""Projections as one matmul (`model/fused_linear.py`): the same outputs and gradients as its layers
called one by one, with and without biases, LoRA adapters and autocast; parameters and their names
unchanged; layers with hooks or of other kinds still called themselves."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratron.inference.loading import FewRowLinear, keep_projections_stacked, use_few_row_linears
from paratron.model import fused_linear
from paratron.model.fused_linear import FewRowChoices, StackedLinears, few_row_linear, linears
from paratron.model.gpt import build_model
from paratron.model.lora import LoRALinear
from paratron.model.mlp import Projections

from tiny import tiny_config

WIDTHS = {"q": 24, "k": 8, "v": 8}


def _projections(bias: bool, seed: int = 0) -> Projections:
    torch.manual_seed(seed)
    projections = Projections(16, WIDTHS, bias)
    with torch.no_grad():
        for param in projections.parameters():
            param.normal_()
    return projections


def _layer_by_layer(projections: Projections, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(layer(x) for layer in projections.values())


def _outputs_and_grads(projections: Projections, x: torch.Tensor, stacked: bool) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    projections.zero_grad(set_to_none=True)
    outputs = projections(x) if stacked else _layer_by_layer(projections, x)
    weights = torch.linspace(-1, 1, sum(o.size(-1) for o in outputs))
    (torch.cat(outputs, -1).float() * weights).square().sum().backward()
    grads = [p.grad for _, p in sorted(projections.named_parameters()) if p.requires_grad]
    return [*outputs, x.grad, *grads]


@pytest.mark.parametrize("bias", [False, True])
def test_one_matmul_equals_the_layers_called_one_by_one(bias):
    projections = _projections(bias)
    x = torch.randn(2, 5, 16)
    names = [n for n, _ in projections.named_parameters()]
    assert names == [f"{p}.{w}" for p in WIDTHS for w in (("weight", "bias") if bias else ("weight",))]
    stacked = _outputs_and_grads(projections, x, stacked=True)
    plain = _outputs_and_grads(projections, x, stacked=False)
    assert [t.shape for t in stacked] == [t.shape for t in plain]
    for got, expected in zip(stacked[:3], plain[:3]):  # forward: the same rows of a wider matmul (whose blocking
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # may sum in another order on some CPUs)
    for got, expected in zip(stacked[3:], plain[3:]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_lora_projections_stack_with_their_adapters_and_train_only_them():
    projections = _projections(bias=True)
    for name in list(projections.keys()):
        adapted = LoRALinear(projections[name], rank=2, alpha=4.0)
        with torch.no_grad():
            adapted.lora_a.normal_()
            adapted.lora_b.normal_()
        projections[name] = adapted
    for name, param in projections.named_parameters():
        param.requires_grad_(name.endswith(("lora_a", "lora_b")))
    x = torch.randn(2, 5, 16)
    stacked = _outputs_and_grads(projections, x, stacked=True)
    plain = _outputs_and_grads(projections, x, stacked=False)
    assert len(stacked) == 3 + 1 + 6  # outputs, x, (A, B) of three layers; the frozen base has no gradient
    for got, expected in zip(stacked, plain):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for n, p in projections.named_parameters() if not p.requires_grad)


def test_autocast_runs_the_matmul_in_its_type_and_returns_gradients_in_the_parameters():
    projections = _projections(bias=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = projections(x)
        expected = _layer_by_layer(projections, x)
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    sum(o.float().sum() for o in outputs).backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in projections.parameters())


def test_a_hooked_or_foreign_layer_is_called_itself():
    projections = _projections(bias=False)
    seen = []
    projections["k"].register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    x = torch.randn(2, 5, 16)
    projections(x)
    assert seen == [torch.Size([2, 5, 8])]

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    other = _projections(bias=False)
    doubled = Doubled(16, 8, bias=False)
    doubled.weight = other["v"].weight
    other["v"] = doubled
    torch.testing.assert_close(other(x)[2], 2 * F.linear(x, doubled.weight))


def test_meta_device_and_frozen_weights():
    with torch.device("meta"):
        projections = Projections(16, WIDTHS, bias=True)
        q, k, v = projections(torch.empty(2, 5, 16))
    assert (q.shape, k.shape, v.shape, q.device.type) == ((2, 5, 24), (2, 5, 8), (2, 5, 8), "meta")

    weights = [torch.randn(4, 6, requires_grad=True), torch.randn(3, 6), torch.randn(2, 6, requires_grad=True)]
    x = torch.randn(5, 6, requires_grad=True)
    out = linears(x, [weights[0], None, weights[1], None, weights[2], None])
    assert out.shape == (5, 9) and isinstance(out.grad_fn, StackedLinears._backward_cls)
    out.square().sum().backward()
    reference = [w.detach().clone().requires_grad_(w.requires_grad) for w in weights]
    x_ref = x.detach().clone().requires_grad_()
    torch.cat([F.linear(x_ref, w) for w in reference], -1).square().sum().backward()
    assert weights[1].grad is None
    for got, want in [(x.grad, x_ref.grad), (weights[0].grad, reference[0].grad), (weights[2].grad, reference[2].grad)]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_weights_laid_out_for_inference_are_read_without_a_copy_and_follow_their_changes(bias, monkeypatch):
    """An engine's model keeps each group's weights in one storage (`keep_projections_stacked`): its forwards
    without autograd concatenate nothing; the parameters are the same objects with the same values, a weight
    changed in place is what the next forward reads, and training through them gives the same gradients."""
    projections = _projections(bias)
    x = torch.randn(3, 16)
    params = dict(projections.named_parameters())
    with torch.no_grad():
        before = projections(x)
        expected = [t.clone() for t in before]
    keep_projections_stacked(projections)
    assert dict(projections.named_parameters()) == params
    assert len({p.untyped_storage().data_ptr() for p in projections.parameters()}) == (2 if bias else 1)
    cat = torch.cat
    joins = []
    monkeypatch.setattr(torch, "cat", lambda *a, **k: joins.append(1) or cat(*a, **k))
    with torch.no_grad():
        after = projections(x)
        assert joins == []
        for got, want in zip(after, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        projections["k"].weight.mul_(2.0)  # (an update in place: read at once, nothing cached)
        changed = projections(x)
    torch.testing.assert_close(changed[1], F.linear(x, projections["k"].weight, projections["k"].bias))
    assert joins == []
    monkeypatch.setattr(torch, "cat", cat)
    batch = torch.randn(2, 4, 16)
    separate = _projections(bias)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(projections.named_parameters(), separate.named_parameters()):
            theirs.copy_(mine)
    laid_out = _outputs_and_grads(projections, batch, stacked=True)
    for got, want in zip(laid_out, _outputs_and_grads(separate, batch, stacked=True), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Timed(FewRowChoices):
    """Choices whose measurements are given: each `_seconds` call takes the next of `times` and is counted."""

    def __init__(self, times: list[float]) -> None:
        super().__init__()
        self.times, self.measured = iter(times), 0

    def _seconds(self, run) -> float:
        run()
        self.measured += 1
        return next(self.times)


def test_few_rows_are_measured_once_per_shape_and_power_of_two_and_keep_their_values(monkeypatch):
    """Inference's linear maps of a few rows: both ways measured the first time a (weight shape, rows rounded up to a
    power of two) is met, the transposed way kept only when clearly faster; its values are F.linear's up to the
    order of the sums; one row, many rows, autograd and deterministic runs never ask."""
    weight, bias = torch.randn(48, 16), torch.randn(48)
    # plain 1.0 s against transposed 0.5 s (taken), then 1.0 against 0.95 (within the margin: plain kept)
    choices = _Timed([1.0, 0.5, 1.0, 0.95])
    monkeypatch.setattr(fused_linear, "FEW_ROWS", choices)
    turned = []
    product = fused_linear._transposed_product
    monkeypatch.setattr(fused_linear, "_transposed_product", lambda x, w: turned.append(x.size(0)) or product(x, w))
    with torch.no_grad():
        for rows in (3, 4, 1, 65, 5, 8):
            x = torch.randn(1, rows, 16)
            torch.testing.assert_close(few_row_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert choices.measured == 4  # rows 3 (bucket 4, both ways) and 5 (bucket 8); 4 and 8 reuse them
    assert choices.transposed == {(48, 16, torch.float32, 4): True, (48, 16, torch.float32, 8): False}
    assert turned == [3, 3, 4, 5]  # (rows 3's measurement, rows 3 and 4, rows 5's measurement: plain kept)
    x = torch.randn(3, 16)
    few_row_linear(x, weight, bias)  # autograd on: F.linear
    with torch.no_grad(), deterministic():
        few_row_linear(x, weight, bias)
    assert turned == [3, 3, 4, 5]


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_engine_s_own_model_computes_its_linear_layers_by_few_rows_and_stays_tied(monkeypatch):
    """`use_few_row_linears`: every plain linear layer outside the stacked projections becomes a `FewRowLinear`
    (the same module and parameters: the tied output layer still shares the embedding), and the model's outputs
    are the same with every few-row matmul computed transposed."""

    class Always(FewRowChoices):
        def use_transposed(self, flat, weight) -> bool:
            return True

    config = tiny_config(Path("unused"), untie_embeddings_and_output_weights=False).model
    model = build_model(config).eval()
    reference = build_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 5))
    names = dict(model.named_parameters())
    use_few_row_linears(model)
    assert dict(model.named_parameters()) == names
    assert isinstance(model.output, FewRowLinear) and model.output.weight is model.embedding.weight
    for layer in model.layers:
        assert isinstance(layer.attention.out_proj, FewRowLinear) and isinstance(layer.mlp.out_proj, FewRowLinear)
        assert all(type(child) is nn.Linear for child in layer.attention.in_proj.values())
    monkeypatch.setattr(fused_linear, "FEW_ROWS", Always())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
