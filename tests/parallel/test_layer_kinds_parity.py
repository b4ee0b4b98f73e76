"""A model given by --hybrid-layer-pattern, with the gated attention and mixture-of-experts sublayers, trains at
every layout as it trains on one process: tensor parallelism with sequence parallelism, the pattern's own pipeline
stages ('|'), context parallelism with TP, expert parallelism with ZeRO-1 and selective recomputation; and a model
of multi-latent attention (query latent, latent norms, YaRN) at TP, and at TP with sequence parallelism and pipeline
stages (one spawn of four ranks for all of them)."""

from __future__ import annotations

import pytest

from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks

from tiny import PARITY_RUN, no_loss_plot, training_records

PATTERN = "*-*E*-*E"


def settings(run_dir: str, **overrides) -> dict:
    return dict(
        dict(
            hybrid_layer_pattern=PATTERN,
            attention_output_gate=True,
            num_experts=4,
            moe_router_topk=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            group_query_attention=True,
            ffn_hidden_size=64,
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            vocab_size=128,
            max_position_embeddings=64,
            mock_data=True,
            seq_length=32,
            micro_batch_size=1,
            global_batch_size=4,
            run_dir=run_dir,
            **dict(PARITY_RUN, train_iters=6),
        ),
        **overrides,
    )


LAYOUTS = {
    "tp2-sp-dp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2-pattern-stages-dp2": dict(pipeline_model_parallel_size=2, hybrid_layer_pattern="*-*E*|-*E"),
    "cp2-tp2": dict(context_parallel_size=2, tensor_model_parallel_size=2),
    "ep2-dp2-zero1-selective": dict(
        expert_model_parallel_size=2, use_distributed_optimizer=True, recompute_granularity="selective"
    ),
}


MLA = dict(
    hybrid_layer_pattern=None,
    num_layers=2,
    attention_output_gate=False,
    num_experts=None,
    moe_router_topk=2,
    group_query_attention=False,
    num_query_groups=None,
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    qk_layernorm=True,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=8,
    mscale_all_dim=0.7,
)
"""A model of multi-latent attention (with the MLP), every part of it on."""

MLA_LAYOUTS = {
    "mla-tp2-dp2": dict(tensor_model_parallel_size=2),
    "mla-tp2-sp-pp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2),
}


def curves_of_layouts(run_dir: str) -> dict[str, list[dict]]:
    initialize("gloo")
    cases = [(name, layout) for name, layout in LAYOUTS.items()]
    cases += [(name, dict(MLA, **layout)) for name, layout in MLA_LAYOUTS.items()]
    with no_loss_plot():
        return {name: training_records(settings(f"{run_dir}/{name}", **layout)) for name, layout in cases}


@pytest.mark.spawns
def test_a_layer_pattern_trains_at_every_layout_as_on_one_process(tmp_path):
    with no_loss_plot():
        reference = training_records(settings(str(tmp_path / "one")))
        mla_reference = training_records(settings(str(tmp_path / "mla-one"), **MLA))
    assert len(reference) == 6 and reference[-1]["loss"] < reference[0]["loss"]
    assert len(mla_reference) == 6 and mla_reference[-1]["loss"] < mla_reference[0]["loss"]
    for name, ours in run_ranks(curves_of_layouts, 4, str(tmp_path))[0].items():
        expected = mla_reference if name in MLA_LAYOUTS else reference
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in ours] == pytest.approx([r[key] for r in expected], rel=1e-5), f"{name}: {key}"
