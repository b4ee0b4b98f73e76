"""--compile on two gloo ranks: fp32 loss curves equal eager's under tensor + sequence parallelism (with dropout
in and out of the tensor-parallel regions), tensor parallelism without sequence parallelism (dropout in and out of
the tensor-parallel stream, the attention core recomputed), pipeline parallelism (zero-bubble: compiled blocks defer
their weight gradients to W), context parallelism's ring and expert parallelism (all-to-all), each block one graph
(an MoE block one per region around the token exchange), no graph break, no recompile; and after one step the
graphs and breaks of zb-v (one graph per kind of block), context parallelism's all-gather, the experts' all-gather
dispatcher and attention dropout alone under tensor parallelism. One spawn for all of it; the backend is aot_eager
(tracing without code generation)."""

from __future__ import annotations

import pytest
import torch._dynamo

from paratron.config import build_config
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.parallel.compile import CompileReport
from paratron.training.run import run_training

from tiny import LLAMA_STYLE, QUIET, no_loss_plot

pytestmark = pytest.mark.spawns

SETTINGS = dict(
    QUIET,
    **LLAMA_STYLE,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=97,
    seq_length=16,
    max_position_embeddings=16,
    micro_batch_size=2,
    global_batch_size=4,
    lr=3e-3,
    seed=5,
    mock_data=True,
)
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
ONE = (1, 0)
MOE_REGIONS = (4, 0)  # (norms, attention, router, the experts' matmuls: one graph each, no break)
EP2 = dict(num_experts=4, expert_model_parallel_size=2)
CURVES = {  # layout: (settings, steps, (graphs, graph breaks))
    "tp2+sp, dropout": (dict(tensor_model_parallel_size=2, sequence_parallel=True, **DROPOUT), 4, ONE),
    "pp2 zero-bubble": (
        dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", global_batch_size=8),
        4,
        ONE,
    ),
    "cp2 ring": (dict(context_parallel_size=2), 4, ONE),
    "ep2 all-to-all": (dict(EP2, moe_token_dispatcher_type="alltoall"), 4, MOE_REGIONS),
    # (dropout in the tensor-parallel stream and out of it in one block; the attention core recomputed)
    "tp2, both dropouts, selective": (
        dict(tensor_model_parallel_size=2, recompute_granularity="selective", **DROPOUT),
        4,
        ONE,
    ),
}
PP2 = dict(pipeline_model_parallel_size=2, global_batch_size=8)
ONE_STEP = {  # layout: (graphs, graph breaks) of its blocks after one step, or a list of them by rank
    "cp2 all-gather": (dict(context_parallel_size=2, cp_comm_type="all_gather"), ONE),
    "ep2 all-gather": (dict(EP2), MOE_REGIONS),
    "tp2, attention dropout": (dict(tensor_model_parallel_size=2, attention_dropout=0.1), ONE),
    # (rank 0 holds the first stage, whose blocks keep a whole backward, and the last, whose blocks defer their
    # weight gradients: two kinds of block, two graphs)
    "pp2 zb-v": (dict(PP2, pipeline_schedule="zb-v", num_layers=4), [(2, 0), ONE]),
}


def _train(run_dir: str, steps: int, layout: dict, compiled: bool, strict: bool = True) -> tuple[list[float], tuple]:
    """The losses of a run, and the graphs and breaks compilation made during it. A recompile raises where
    `strict` (not where a rank holds two kinds of block: its second graph compiles the same code again)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    flags = dict(compile=True, compile_backend="aot_eager") if compiled else {}
    with torch._dynamo.config.patch(error_on_recompile=strict), no_loss_plot():
        result = run_training(build_config(dict(SETTINGS, run_dir=run_dir, train_iters=steps, **layout, **flags)))
    made = CompileReport.now()
    return result.losses, (made.graphs, made.graph_breaks)


def compiled_and_eager(base: str) -> dict:
    initialize("gloo")
    curves = {}
    for name, (layout, steps, _) in CURVES.items():
        eager, _ = _train(f"{base}/{name}/eager", steps, layout, compiled=False)
        compiled, made = _train(f"{base}/{name}/compiled", steps, layout, compiled=True)
        curves[name] = (eager, compiled, made)
    one_step = {
        name: _train(f"{base}/{name}", 1, layout, True, strict=not isinstance(expected, list))[1]
        for name, (layout, expected) in ONE_STEP.items()
    }
    return {"curves": curves, "one_step": one_step}


def test_compiled_blocks_equal_eager_on_two_ranks_without_graph_breaks(tmp_path):
    results = run_ranks(compiled_and_eager, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for name, (eager, compiled, made) in result["curves"].items():
            if eager:  # (the last pipeline stage reports the losses)
                assert len(compiled) == len(eager) == CURVES[name][1], (rank, name)
                assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5), (rank, name)
            assert made == CURVES[name][2], (rank, name)  # no break (and no recompile, which would raise)
        for name, made in result["one_step"].items():
            expected = ONE_STEP[name][1]
            assert made == (expected[rank] if isinstance(expected, list) else expected), (rank, name)
