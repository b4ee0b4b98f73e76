"""--compile: each block compiled once (blocks of one shape share one graph: no recompiles across
layers or steps), no graph break inside a block on one device, the same losses as eager. The
backend here is aot_eager (dynamo's tracing and autograd's graphs without code generation, which
takes tens of seconds on a CPU); inductor is what --compile uses by default."""

from __future__ import annotations

import pytest
import torch._dynamo

from paratron.parallel.compile import CompileReport, apply_compile, is_compiled

from tiny import training_records

SETTINGS = dict(
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
    eval_iters=0,
    mock_data=True,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    hidden_dropout=0.0,
    attention_dropout=0.0,
    progress_bar=False,
    tensorboard=False,
    log_interval=1,
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
