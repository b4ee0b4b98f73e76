"""--compile: each block compiled once (blocks of one shape share one graph: no recompiles across
layers or steps), no graph break inside a block on one device, the same losses as eager. The
backend here is aot_eager (dynamo's tracing and autograd's graphs without code generation, which
takes tens of seconds on a CPU); inductor is what --compile uses by default."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from torch import nn

from paratron.distributed.rng import Forked, RNGStates, draws, single_fork
from paratron.model.moe import ExpertKernels
from paratron.parallel.compile import CompileReport, apply_compile, compiled_expert_kernels, is_compiled
from paratron.parallel.pipeline.zero_bubble import WeightGradStore, defer_weight_gradients
from paratron.parallel.recompute import Recomputed

from tiny import LLAMA_STYLE, QUIET, training_records

SETTINGS = dict(
    QUIET,
    **LLAMA_STYLE,
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=97,
    seq_length=16,
    max_position_embeddings=16,
    micro_batch_size=2,
    global_batch_size=4,
    train_iters=4,
    lr=1e-3,
    mock_data=True,
)


def test_compiled_blocks_train_as_eager_in_one_graph_without_breaks(tmp_path, capsys):
    eager = training_records(dict(SETTINGS, run_dir=str(tmp_path / "eager")))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = training_records(
        dict(SETTINGS, run_dir=str(tmp_path / "compiled"), compile=True, compile_backend="aot_eager")
    )
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert [r["grad_norm"] for r in compiled] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-5)
    made = CompileReport.now()
    assert (made.graphs, made.graph_breaks) == (1, 0)  # (three blocks, four steps: one graph)
    assert "compile (aot_eager): 1 graph(s) for the blocks, 0 graph break(s)" in capsys.readouterr().out


def test_every_block_is_compiled_in_place():
    from paratron.config import build_config
    from paratron.model.gpt import GPT

    model = GPT(build_config(dict(SETTINGS)).model)
    assert apply_compile(model, "eager") == 3
    assert all(is_compiled(block) for block in model.layers) and not is_compiled(model)


def test_a_fork_whose_module_draws_nothing_does_not_switch_streams():
    rng = RNGStates("cpu")
    rng.add("tensor-parallel", 1)
    before = rng.states["tensor-parallel"].clone()
    quiet = Forked(nn.Dropout(0.0), rng)
    quiet(torch.ones(8))
    assert torch.equal(rng.states["tensor-parallel"], before)  # not entered
    noisy = Forked(nn.Dropout(0.5), rng)
    noisy(torch.ones(8))
    assert not torch.equal(rng.states["tensor-parallel"], before)  # drawn from the stream
    assert draws(nn.Dropout(0.1)) and not draws(nn.Dropout(0.0)) and not draws(nn.Linear(2, 2))

    block = nn.Sequential(Forked(nn.Dropout(0.1), rng), nn.Linear(2, 2), Forked(nn.Dropout(0.1), rng))
    assert single_fork(block) == (rng, "tensor-parallel")  # every draw under one fork: switched outside
    assert single_fork(nn.Sequential(block, nn.Dropout(0.1))) is None  # a draw outside it
    assert single_fork(nn.Sequential(Forked(nn.Dropout(0.0), rng))) is None  # nothing draws


def test_a_block_under_one_fork_draws_what_eager_draws_when_compiled():
    """The stream switched around the compiled call: the same masks as eager's, one graph, no break."""

    def twins() -> tuple[nn.Module, RNGStates]:
        torch.manual_seed(0)
        rng = RNGStates("cpu")
        rng.add("tensor-parallel", 3)
        inner = nn.Sequential(nn.Linear(4, 4), Forked(nn.Dropout(0.5), rng), nn.Linear(4, 4))
        block = nn.Sequential(inner, Forked(nn.Dropout(0.5), rng))
        return block, rng

    x = torch.ones(3, 4)
    eager, _ = twins()
    compiled, rng = twins()
    model = type("Blocks", (), {"layers": [compiled]})()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(model, "aot_eager")
    torch.manual_seed(1)
    expected = [eager(x) for _ in range(2)]
    torch.manual_seed(1)
    got = [compiled(x) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert (CompileReport.now().graphs, CompileReport.now().graph_breaks) == (1, 0)


def test_a_block_drawing_in_and_out_of_a_fork_draws_what_eager_draws_when_compiled():
    """Dropout inside the tensor-parallel stream (recomputed, as selective recomputation does the attention core)
    and plain dropout outside it (tensor parallelism without sequence parallelism): switched outside the graph,
    the plain dropout drawing outside the fork. Eager's masks, eager's gradients, one graph, no break."""

    def twins() -> tuple[nn.Module, RNGStates]:
        torch.manual_seed(0)
        rng = RNGStates("cpu")
        rng.add("tensor-parallel", 3)
        forked = Recomputed(Forked(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), rng), rng)
        inner = nn.Sequential(nn.Linear(4, 4), forked, nn.Linear(4, 4))
        return _Residual(nn.Sequential(inner, nn.Dropout(0.5), nn.Linear(4, 4), nn.Dropout(0.5))), rng

    x = torch.ones(3, 4, requires_grad=True)
    eager, _ = twins()
    compiled, rng = twins()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(type("Blocks", (), {"layers": [compiled]})(), "aot_eager")
    for block in (eager, compiled):
        torch.manual_seed(1)
        block.outputs = [block(x) for _ in range(2)]
        block.grads = torch.autograd.grad(sum(y.sum() for y in block.outputs), [x, *block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(compiled.outputs, eager.outputs))
    assert all(torch.allclose(a, b) for a, b in zip(compiled.grads, eager.grads))
    assert (CompileReport.now().graphs, CompileReport.now().graph_breaks) == (1, 0)


class _Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def test_the_experts_matmuls_run_one_graph_for_any_count_of_rows():
    """Each expert receives what the routing sends it, 0 and 1 rows included: one graph, no recompile,
    eager's numbers and gradients."""
    torch.manual_seed(0)
    w_in = torch.randn(3, 16, 8, requires_grad=True)
    w_out = torch.randn(3, 8, 8, requires_grad=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = ExpertKernels(), compiled_expert_kernels("aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (5, 0, 1, 7):
            x, probs = torch.randn(rows, 8), torch.rand(rows)
            for e in range(3):
                got = compiled.one(x, probs, w_in[e], w_out[e], True, "none")
                want = eager.one(x, probs, w_in[e], w_out[e], True, "none")
                assert torch.allclose(got, want, atol=1e-6)
                grads = torch.autograd.grad(got.sum(), (w_in, w_out), allow_unused=True, materialize_grads=True)
                expected = torch.autograd.grad(want.sum(), (w_in, w_out), allow_unused=True, materialize_grads=True)
                assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(grads, expected))
    assert (CompileReport.now().graphs, CompileReport.now().graph_breaks) == (1, 0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def test_a_compiled_block_defers_its_weight_gradients_to_w():
    """Zero-bubble's split backward inside a compiled block: B gives the input gradient only, W the weight
    gradients, all equal to eager's; outside a capture B gives both. Two blocks, one graph."""
    torch.manual_seed(0)
    plain = [_Block() for _ in range(2)]
    x = torch.randn(3, 4, 8, requires_grad=True)
    expected_input_grad = torch.autograd.grad(plain[1](plain[0](x)).sum(), x)[0]
    eager = [[p for p in block.parameters()] for block in plain]
    want = torch.autograd.grad(plain[1](plain[0](x)).sum(), [p for ps in eager for p in ps])
    store = WeightGradStore()
    defer_weight_gradients(plain, store)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(type("Blocks", (), {"layers": plain})(), "aot_eager")
    ready = []
    for captured in (True, False):
        for p in (p for ps in eager for p in ps):
            p.grad = None
        with store.capture("m0") if captured else contextlib.nullcontext():
            got_input_grad = torch.autograd.grad(plain[1](plain[0](x)).sum(), x)[0]
        assert torch.allclose(got_input_grad, expected_input_grad, atol=1e-6)
        if captured:
            assert all(p.grad is None for ps in eager for p in ps)  # B left them to W
            store.run("m0", ready.append)
            assert len(ready) == 6  # (two blocks: two weights and a bias each)
        assert all(torch.allclose(p.grad, w, atol=1e-6) for p, w in zip((p for ps in eager for p in ps), want))
    assert (CompileReport.now().graphs, CompileReport.now().graph_breaks) == (1, 0)
