"""Per-layer statistics (--log-layer-stats) are the single process's at other layouts: activation RMS and largest
magnitude, gradient norms, update ratios and router entropies of every layer of a mixture-of-experts model with tied
embeddings, within fp32 tolerance, at tensor x sequence x interleaved pipeline parallelism (the tied output weight a
pipeline duplicate, the logits split by vocabulary), at expert x data parallelism with ZeRO-2 and tensor parallelism
without sequence parallelism (the residual stream held twice), and at ZeRO-3 (FSDP2's shards) x tensor parallelism."""

from __future__ import annotations

import pytest

from paratron.debugging.layer_stats import PREFIX
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks

from tiny import training_records

LAYOUTS = {
    "tp2-sp-pp2-interleaved": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1,
    ),
    "ep2-dp2-zero2-tp2": dict(expert_model_parallel_size=2, zero_stage=2, tensor_model_parallel_size=2),
    "dp2-zero3-tp2": dict(zero_stage=3, tensor_model_parallel_size=2),
}


def settings(run_dir: str, **layout) -> dict:
    return dict(
        model_name="debug-moe",
        num_layers=4,
        moe_layer_freq="[0,1,0,1]",
        num_experts=4,
        moe_router_topk=2,
        untie_embeddings_and_output_weights=False,
        vocab_size=100,
        mock_data=True,
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=3,
        lr=3e-3,
        lr_warmup_iters=0,
        clip_grad=1.0,
        eval_iters=0,
        seed=3,
        run_dir=run_dir,
        progress_bar=False,
        tensorboard=False,
        log_interval=3,
        log_layer_stats=1,
        **layout,
    )


def layer_records(run_dir: str, layout: dict) -> list[dict]:
    return [
        {key: value for key, value in r.items() if key.startswith(PREFIX) or key in ("step", "grad_norm")}
        for r in training_records(settings(run_dir, **layout))
    ]


SPIKED = dict(
    LAYOUTS["tp2-sp-pp2-interleaved"],
    loss_spike_zscore=6.0,
    loss_spike_window=2,
    on_spike="skip",
    fault_inject=["2:3:spike"],  # (rank 2: tensor-parallel rank 0 of the last stage, which holds the whole vocabulary)
)
"""A loss spike on one rank of four: every rank must judge the global loss and withhold the step together."""


def records_of_layouts(run_dir: str) -> tuple[dict[str, list[dict]], list[dict]]:
    """Each layout's records, and the spiked run's, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    layouts = {name: layer_records(f"{run_dir}/{name}", layout) for name, layout in LAYOUTS.items()}
    return layouts, training_records(settings(f"{run_dir}/spiked", **SPIKED))


@pytest.mark.spawns
def test_layer_statistics_at_other_layouts_equal_one_process(tmp_path):
    single = layer_records(str(tmp_path / "single"), {})
    assert [r["step"] for r in single] == [1, 2, 3]  # (every step records statistics, so every step is logged)
    names = ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "final_norm", "output"]
    expected = {f"{PREFIX}{n}/{s}" for n in names for s in ("act_rms", "act_max")}
    expected |= {f"{PREFIX}{n}/{s}" for n in names[:-1] for s in ("grad_norm", "update_ratio")}  # (output: tied)
    expected |= {f"{PREFIX}layers.{i}/router_entropy" for i in (1, 3)}
    assert set(single[0]) - {"step", "grad_norm"} == expected
    for r in single:
        squares = sum(value**2 for key, value in r.items() if key.endswith("/grad_norm") and key != "grad_norm")
        assert squares**0.5 == pytest.approx(r["grad_norm"], rel=1e-5)
    assert all(0 < r[f"{PREFIX}layers.1/router_entropy"] < 1.3863 for r in single)  # (below log 4: not uniform)
    layouts, spiked = run_ranks(records_of_layouts, 4, str(tmp_path))[0]
    for name, ours in layouts.items():
        assert [r["step"] for r in ours] == [1, 2, 3], name
        for mine, theirs in zip(ours, single):
            assert set(mine) == set(theirs), name
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, rel=2e-5, abs=1e-7), f"{name} step {mine['step']}: {key}"
    assert [r.get("loss_spike") is not None for r in spiked] == [False, False, True]
    assert [r["skipped_iterations"] for r in spiked] == [0, 0, 1] and spiked[2]["loss"] > 2 * spiked[1]["loss"]
    assert {v for k, v in spiked[2].items() if k.endswith("/update_ratio")} == {0.0}  # (withheld on every rank)
    assert spiked[1][f"{PREFIX}layers.0/act_rms"] == pytest.approx(single[1][f"{PREFIX}layers.0/act_rms"], rel=2e-5)
