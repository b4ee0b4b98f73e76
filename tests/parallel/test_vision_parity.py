"""A vision-language model (debug-vit in front of a tiny GPT) trains the same at every layout: 6-step fp32 loss curves
at TP2, TP2 with sequence parallelism, PP2 (1f1b and interleaved), ZeRO-1 (with recomputation of every layer, the
encoder's too) and ZeRO-3, TP2 x PP2, with the encoder frozen, and in front of a mixture of experts at EP2 x TP2
equal the single process within 1e-5 relative. --mock-data gives every micro-batch rows with no, one or two images
(and some micro-batches none at all: in steps 1 and 4), so no layout may wait for the encoder's gradients. A resumed
TP2 x PP2 run continues bit for bit, and its checkpoint loads on one process as the single process's model."""

from __future__ import annotations

import pytest
import torch

from paratron.checkpoint.pretrained import load_pretrained
from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import PARITY_RUN, no_loss_plot, tiny_config

VISION = dict(
    model_name=None,
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=97,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=4,
    vision_model="debug-vit",
    mock_data=True,
    seq_length=40,
    micro_batch_size=2,
    global_batch_size=8,
    **{**PARITY_RUN, "train_iters": 6},
)
"""Four language-model layers (interleaved PP2 runs two chunks of one layer per rank); an image is 16 tokens."""

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2-1f1b": dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
    "pp2-interleaved": dict(
        pipeline_model_parallel_size=2, pipeline_schedule="interleaved", num_layers_per_virtual_pipeline_stage=1
    ),
    "zero1-recompute": dict(
        zero_stage=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "zero3": dict(zero_stage=3),
    "tp2-pp2": dict(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True, save_interval=3
    ),
    "tp2-pp2-frozen": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, freeze_vision_model=True),
}
"""On four processes (the data-parallel size makes up the rest)."""

EXPERTS = dict(num_experts=4, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)
"""A mixture-of-experts language model behind the encoder (its own reference run)."""


def curves(run_dir: str, runs: dict[str, dict]) -> dict[str, list[float]]:
    """6-step runs one after another in one process group: each run's losses."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    with no_loss_plot():
        return {
            name: run_training(tiny_config(f"{run_dir}/{name}", **settings)).losses for name, settings in runs.items()
        }


@pytest.mark.spawns
def test_vision_language_loss_curves_equal_single_process_at_every_layout(tmp_path):
    cases = {"dense": {"save": str(tmp_path / "single-ckpt")}, "frozen": {"freeze_vision_model": True}, "moe": EXPERTS}
    with no_loss_plot():
        reference = {
            case: run_training(tiny_config(tmp_path / f"single-{case}", **VISION, **settings)).losses
            for case, settings in cases.items()
        }
    assert reference["dense"] != reference["frozen"]  # (freezing the encoder changes what trains)
    runs = {name: dict(VISION, **layout) for name, layout in LAYOUTS.items()}
    runs["moe-ep2-tp2"] = dict(VISION, **EXPERTS, expert_model_parallel_size=2, tensor_model_parallel_size=2)
    saved = tmp_path / "tp2-pp2-ckpt"
    runs["tp2-pp2"]["save"] = str(saved)
    runs["tp2-pp2-resumed"] = dict(runs["tp2-pp2"], load=str(saved / "iter_0000003"), save=None)
    results = run_ranks(curves, 4, str(tmp_path / "four"), runs)[0]
    resumed = results.pop("tp2-pp2-resumed")
    assert resumed == results["tp2-pp2"][3:]  # (bit for bit)
    for name, curve in results.items():
        expected = reference[next((case for case in ("frozen", "moe") if case in name), "dense")]
        assert len(curve) == 6
        for step, (ours, ref) in enumerate(zip(curve, expected), start=1):
            assert abs(ours - ref) <= 1e-5 * abs(ref), f"{name}: step {step}: {ours} vs {ref}"
    # the TP2 x PP2 checkpoint loads on one process as the model the single process trained
    whole, alone = (dict(load_pretrained(path).named_parameters()) for path in (saved, tmp_path / "single-ckpt"))
    assert whole.keys() == alone.keys() and any(name.startswith("vision.encoder.layers") for name in whole)
    for name, param in whole.items():
        assert torch.allclose(param, alone[name], rtol=1e-3, atol=1e-4), name
