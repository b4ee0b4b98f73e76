"""--cross-entropy-loss-fusion under pipeline parallelism and ZeRO-3 (with tensor and sequence parallelism inside
both), on 4 gloo ranks: 6-step fp32 loss curves (and two validation losses) equal the unfused single process's
within 1e-5 relative at every step, with the fused loss cut into several chunks per micro-batch."""

from __future__ import annotations

import pytest

from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import PARITY_RUN, no_loss_plot, tiny_config

STEPS = 6
CHUNK = 5
"""Tokens per chunk of the fused loss in these runs: several chunks per micro-batch of 32, the last one short."""
SHAPE = dict(
    PARITY_RUN,
    train_iters=STEPS,
    model_name=None,
    num_layers=4,  # (PP 2 with two chunks per rank: one layer each)
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=250,
    make_vocab_size_divisible_by=4,
    max_position_embeddings=64,
    seq_length=16,
    micro_batch_size=2,
    global_batch_size=8,
    eval_interval=STEPS // 2,  # (evaluation runs the fused loss too: forward only, through the pipeline's evaluate)
    eval_iters=1,
)
GPT = SHAPE  # (tied embeddings: under PP 2 the output layer is the first stage's embedding's copy)
LLAMA = dict(
    SHAPE,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
TP_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
LAYOUTS = {
    "gpt-pp2-1f1b": dict(GPT, pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
    "gpt-pp2-zb-v": dict(GPT, pipeline_model_parallel_size=2, pipeline_schedule="zb-v"),
    "llama-pp2-zb-h1": dict(LLAMA, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1"),
    "llama-pp2-tp2-sp-interleaved": dict(
        LLAMA, **TP_SP, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1
    ),
    "gpt-zero3-dp4": dict(GPT, zero_stage=3),
    "llama-zero3-dp2-tp2-sp": dict(LLAMA, **TP_SP, zero_stage=3),
    "gpt-zero3-pp2-tp2-sp": dict(GPT, **TP_SP, zero_stage=3, pipeline_model_parallel_size=2),
}
"""Fused runs on 4 ranks (data parallelism fills what the layout leaves): the 1F1B and both zero-bubble schedules
and the interleaved one, a tie across pipeline ranks (1F1B) and on one rank (ZB-V's V puts both ends on rank 0),
ZeRO-3 alone, inside TP + SP and beside PP."""


def curve(config) -> list[float]:
    """The training loss of every step, then the validation losses (after steps 3 and 6)."""
    with no_loss_plot():
        state = run_training(config)
    return [*state.losses, *state.val_losses]


def fused_curves(run_dir: str) -> dict[str, list[float]]:
    """Every layout of `LAYOUTS`, fused, one after another in one process group: `curve` of each."""
    from paratron.distributed.init import initialize
    from paratron.model import fused_loss

    initialize("gloo")
    fused_loss.chunk_tokens = lambda vocab, limit=0: CHUNK  # (read at each call; the real size is one chunk here)
    return {
        name: curve(tiny_config(f"{run_dir}/{name}", **settings, cross_entropy_loss_fusion=True))
        for name, settings in LAYOUTS.items()
    }


@pytest.mark.spawns
def test_fused_loss_curves_equal_the_unfused_single_process_under_pp_and_zero3(tmp_path):
    reference = {
        flavour: curve(tiny_config(tmp_path / flavour, **settings))
        for flavour, settings in (("gpt", GPT), ("llama", LLAMA))
    }
    curves = run_ranks(fused_curves, 4, str(tmp_path / "fused"))[0]
    assert curves.keys() == LAYOUTS.keys()
    worst = {}
    for name, losses in curves.items():
        expected = reference[name.split("-")[0]]
        assert len(losses) == len(expected) == STEPS + 2
        worst[name] = max(abs(ours - ref) / abs(ref) for ours, ref in zip(losses, expected))
    print({name: f"{error:.1e}" for name, error in worst.items()})  # (the margins, with -s)
    assert max(worst.values()) <= 1e-5, f"relative distance from the unfused single process's curve: {worst}"
    # (it learns: the curves compared carry information; 6 steps at this rate take 0.018 off the first loss)
    assert reference["gpt"][STEPS - 1] < reference["gpt"][0] - 0.01
