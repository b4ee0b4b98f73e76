"""A mixture-of-experts model trains the same at every supported layout: 6-step fp32 curves of
the loss, the load-balancing and z losses and the experts' load (with the aux-loss-free expert
bias moving after every step), against one process; expert-parallel checkpoints resume exactly
and load at other expert-parallel sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from paratron.config import build_config
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import no_loss_plot, training_records


def settings(run_dir: str, **overrides) -> dict:
    return dict(
        dict(
            model_name="debug-moe",
            num_layers=4,
            moe_layer_freq="[1,0,1,1]",
            num_experts=4,
            moe_router_topk=2,
            moe_aux_loss_coeff=1e-2,
            moe_z_loss_coeff=1e-3,
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-2,
            moe_shared_expert_intermediate_size=48,
            moe_shared_expert_gate=True,
            qk_layernorm=True,
            vocab_size=128,
            mock_data=True,
            seq_length=16,
            micro_batch_size=2,
            global_batch_size=8,
            train_iters=6,
            lr=3e-3,
            lr_warmup_iters=2,
            eval_iters=0,
            seed=3,
            run_dir=run_dir,
            progress_bar=False,
            tensorboard=False,
            log_interval=1,
        ),
        **overrides,
    )


@pytest.fixture(autouse=True, scope="module")
def _no_loss_plot() -> Iterator[None]:
    with no_loss_plot():
        yield


def curves(run_dir: str, layout: dict) -> list[dict]:
    return training_records(settings(run_dir, **layout))


GROUPED = dict(
    moe_router_score_function="sigmoid",
    moe_router_topk_scaling_factor=2.0,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
)
"""DeepSeek-V3's routing on the same model: sigmoid scores with the expert bias and routed scaling, limited to one of
two groups of two experts per token (where EP 2 holds a group per rank: every token's experts on one rank)."""

LAYOUTS = {
    "pp2-1f1b": (2, dict(pipeline_model_parallel_size=2)),
    "pp2-zb-h1-recompute": (
        2,
        dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", recompute_granularity="full"),
    ),
    "dp2-zero1": (2, dict(use_distributed_optimizer=True)),
    "dp2-zero3-grouped": (2, dict(zero_stage=3, moe_grouped_gemm=True)),
    "tp2-etp1": (2, dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep2-zero2-allgather": (2, dict(expert_model_parallel_size=2, zero_stage=2, moe_token_dispatcher_type="allgather")),
    "ep4-grouped": (4, dict(expert_model_parallel_size=4, moe_grouped_gemm=True)),
    "ep2-tp2-sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2-tp2-sp-etp1-allgather": (
        4,
        dict(
            expert_model_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_tensor_parallel_size=1,
            moe_token_dispatcher_type="allgather",
        ),
    ),
    "ep2-pp2-zb-h1-recompute": (
        4,
        dict(
            expert_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            pipeline_schedule="zb-h1",
            recompute_granularity="full",
            recompute_method="uniform",
        ),
    ),
    "ep2-dp2-zero1": (4, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
    # MoE parallel folding: the experts' grid over the TP (and CP) ranks, EP above DP
    "tp2-ep2-etp1": (
        2,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
    ),
    "tp2-ep4-etp1-zero2": (
        4,
        dict(
            tensor_model_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            zero_stage=2,
        ),
    ),
    "tp2-ep2-etp1-grouped": (
        2,
        dict(
            GROUPED,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
    ),
    "etp2-dp2": (2, dict(expert_tensor_parallel_size=2)),
    "cp2-ep2": (2, dict(context_parallel_size=2, expert_model_parallel_size=2)),
    "ep2-zero3": (2, dict(expert_model_parallel_size=2, zero_stage=3)),  # (experts alone on their rank: EDP 1)
    "ep2-dp4-zero3": (4, dict(expert_model_parallel_size=2, zero_stage=3)),  # (experts sharded over EDP 2)
    "tp2-pp2-ep2-interleaved": (
        8,
        dict(
            expert_model_parallel_size=2,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            sequence_parallel=True,
            num_layers_per_virtual_pipeline_stage=1,
        ),
    ),
    "pp2-tp2-ep4-etp1": (
        8,
        dict(
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            sequence_parallel=True,
        ),
    ),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    return curves(str(tmp_path_factory.mktemp("moe") / "single"), {})


def curves_of_layouts(run_dir: str, layouts: dict[str, dict]) -> dict[str, list[dict]]:
    """Each layout's curve, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    with no_loss_plot():
        return {name: curves(f"{run_dir}/{name}", layout) for name, layout in layouts.items()}


@pytest.fixture(scope="module")
def grouped_single(tmp_path_factory, single) -> list[dict]:
    grouped = curves(str(tmp_path_factory.mktemp("moe") / "grouped"), GROUPED)
    assert len(grouped) == 6 and grouped[-1]["loss"] < grouped[0]["loss"] - 0.2
    assert [r["loss"] for r in grouped] != [r["loss"] for r in single]
    for record in grouped:  # (every token takes both experts of one group: the two experts of a group tie)
        assert all(layer[0] == layer[1] and layer[2] == layer[3] for layer in record["moe_tokens_per_expert"])
    return grouped


@pytest.mark.spawns
@pytest.mark.parametrize("world", sorted({world for world, _ in LAYOUTS.values()}))
def test_moe_training_at_every_layout_equals_one_process(tmp_path, single, world, request):
    assert len(single) == 6 and single[-1]["loss"] < single[0]["loss"] - 0.2  # (0.28 in 6 steps)
    assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in single)
    layouts = {name: layout for name, (size, layout) in LAYOUTS.items() if size == world}
    for name, ours in run_ranks(curves_of_layouts, world, str(tmp_path), layouts)[0].items():
        reference = request.getfixturevalue("grouped_single") if GROUPED.items() <= layouts[name].items() else single
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_balance"):
            assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], rel=1e-5), f"{name}: {key}"
        assert [r["moe_tokens_per_expert"] for r in ours] == [r["moe_tokens_per_expert"] for r in reference], name


RESUMED_AT = 3
"""Saved at step 3 of 6 (past the warm-up), resumed from there."""


def resumed_losses(run_dir: str, layout: dict) -> list[float]:
    return run_training(build_config(settings(run_dir, train_iters=2 * RESUMED_AT, **layout))).losses


def resumed_at_four_ranks(run_dir: str, save: str) -> dict[str, list[float]]:
    """Saved at EP 2 x TP 2 and at the folded TP 2 x EP 4 x expert-TP 1, resumed at the same
    layout, at EP 4 and folded from the unfolded save, one after the other on one process group
    (one spawn for the runs)."""
    initialize("gloo")
    with no_loss_plot():
        at = dict(save_interval=RESUMED_AT)
        runs = {"straight": resumed_losses(f"{run_dir}/a", dict(EP2_TP2, save=f"{save}/unfolded", **at))}
        checkpoint = f"{save}/unfolded/iter_{RESUMED_AT:07d}"
        runs["same"] = resumed_losses(f"{run_dir}/b", dict(EP2_TP2, load=checkpoint))
        runs["ep4"] = resumed_losses(
            f"{run_dir}/c", dict(expert_model_parallel_size=4, use_distributed_optimizer=True, load=checkpoint)
        )
        runs["folded_from_unfolded"] = resumed_losses(f"{run_dir}/d", dict(FOLDED, load=checkpoint))
        runs["folded"] = resumed_losses(f"{run_dir}/e", dict(FOLDED, save=f"{save}/folded", **at))
    return runs


EP2_TP2 = dict(
    expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True
)
FOLDED = dict(EP2_TP2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
"""EP over both tensor-parallel ranks and both data-parallel ones (MoE parallel folding)."""


@pytest.mark.spawns
def test_expert_parallel_checkpoint_resumes_exactly_and_loads_at_ep1_and_ep4(tmp_path):
    """Saved at EP 2 x TP 2 (experts split both ways, ZeRO-1 pieces of both kinds), step 3 of 6;
    a folded layout's save loads on one process, and it loads the unfolded one."""
    save = str(tmp_path / "ckpt")
    runs = run_ranks(resumed_at_four_ranks, 4, str(tmp_path), save)[0]
    straight = runs["straight"]
    assert runs["same"] == straight[RESUMED_AT:]  # bit for bit
    for name in ("ep4", "folded_from_unfolded"):
        assert runs[name] == pytest.approx(straight[RESUMED_AT:], rel=1e-6), name
    assert runs["folded"] == pytest.approx(straight, rel=1e-6)
    for folded in (False, True):
        checkpoint = f"{save}/{'folded' if folded else 'unfolded'}/iter_{RESUMED_AT:07d}"
        ep1 = resumed_losses(str(tmp_path / f"single-{folded}"), dict(load=checkpoint))
        assert ep1 == pytest.approx(straight[RESUMED_AT:], rel=1e-6), f"folded={folded}"


def converted_losses(checkpoint: str, run_dir: str, layout: dict) -> list[float]:
    settings = dict(
        load=checkpoint,
        mock_data=True,
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=3,
        lr=1e-3,
        eval_iters=0,
        run_dir=run_dir,
        progress_bar=False,
        tensorboard=False,
        log_interval=1,
    )
    settings.update(layout)
    return run_training(build_config(settings, recipe=f"{checkpoint}/model.yaml")).losses


def converted_losses_at_layouts(checkpoint: str, run_dir: str, layouts: dict[str, dict]) -> dict[str, list[float]]:
    """Each layout's losses, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    with no_loss_plot():
        return {name: converted_losses(checkpoint, f"{run_dir}/{name}", layout) for name, layout in layouts.items()}


@pytest.mark.spawns
def test_training_starts_from_a_converted_mixtral_at_any_layout(tmp_path):
    import torch
    import transformers

    from paratron.checkpoint.formats import hf_to_paratron

    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        initializer_range=0.3,  # (far from a fresh model's near-uniform predictions)
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    checkpoint = str(tmp_path / "converted")
    single = converted_losses(checkpoint, str(tmp_path / "single"), {})
    layouts = {
        "pp2": dict(pipeline_model_parallel_size=2),
        "tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "ep2": dict(expert_model_parallel_size=2),
    }
    results = run_ranks(converted_losses_at_layouts, 2, checkpoint, str(tmp_path), layouts)[0]
    assert list(results) == list(layouts)
    for name, losses in results.items():
        assert losses == pytest.approx(single, rel=1e-5), name
    fresh = converted_losses(checkpoint, str(tmp_path / "fresh"), dict(load=None))
    assert fresh[0] != pytest.approx(single[0], rel=0.05)  # the converted weights were used
