"""Pipeline parallelism on gloo ranks: every schedule's loss and gradients against the
single-device model, and 6-step loss curves of whole training runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import tiny_config

# 8 layers: PP 4 with two virtual stages per rank holds one layer per chunk
GPT_FLAVOUR = dict(
    num_layers=8,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=97,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA_FLAVOUR = dict(
    GPT_FLAVOUR,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    num_attention_heads=8,
    num_query_groups=2,
    add_bias_linear=False,
    ffn_hidden_size=96,
    untie_embeddings_and_output_weights=True,
)
FLAVOURS = {"gpt": GPT_FLAVOUR, "llama": LLAMA_FLAVOUR}
MICRO_BATCHES = 4
CURVE_STEPS = 6
"""Steps of the loss curves (every schedule's warm-up, steady state and cool-down run in each step)."""


def _layouts(pp: int) -> list[tuple[str, dict]]:
    """(name, settings) of every schedule at this pipeline size (each with activation
    recomputation), plus 1F1B without it: with shapes sent ahead, and cut unevenly; at PP 2, virtual
    stages with the embedding and the loss counted in the split."""
    # each schedule also recomputes activations, in one of the ways
    cases = [
        (
            "gpipe",
            dict(
                pipeline_schedule="gpipe",
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=2,
            ),
        ),
        ("1f1b", dict(pipeline_schedule="1f1b", recompute_granularity="selective")),
        (
            "zb-h1",
            dict(
                pipeline_schedule="zb-h1",
                recompute_granularity="full",
                recompute_method="block",
                recompute_num_layers=1,
            ),
        ),
        (
            "interleaved",
            dict(
                pipeline_schedule="interleaved",
                num_layers_per_virtual_pipeline_stage=8 // (2 * pp),
                recompute_granularity="full",
                recompute_method="uniform",
            ),
        ),
        ("zb-v", dict(pipeline_schedule="zb-v", recompute_granularity="selective")),
    ]
    cases.append(("1f1b-shapes-sent", dict(pipeline_schedule="1f1b", variable_seq_lengths=True)))
    # uneven: 3 + 5 layers at PP 2; 1 + 3 + 3 + 1 at PP 4
    cases.append(
        (
            "1f1b-uneven",
            dict(decoder_first_pipeline_num_layers=3)
            if pp == 2
            else dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1),
        )
    )
    if pp == 2:
        # the embedding and the loss counted as layers (Megatron-LM's split): 8 + 2 over 2 ranks x 5 chunks, so
        # the first chunk holds only the embedding and the last only the output layer and loss
        cases.append(
            (
                "interleaved-ends-counted",
                dict(
                    virtual_pipeline_model_parallel_size=5,
                    account_for_embedding_in_pipeline_split=True,
                    account_for_loss_in_pipeline_split=True,
                ),
            )
        )
    return cases


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _single_device_step(model_config, batches: list) -> tuple[torch.nn.Module, torch.Tensor]:
    """The single-device model (seed 7) after one backward of the mean loss of `batches`, and that loss."""
    from paratron.model.gpt import build_model

    reference = build_model(model_config, seed=7)
    ref_loss = (
        sum(
            torch.nn.functional.cross_entropy(reference(b.input_ids).flatten(0, 1), b.labels.flatten()) for b in batches
        )
        / MICRO_BATCHES
    )
    ref_loss.backward()
    return reference, ref_loss


def gradient_parity(world: int, pp: int, tp: int) -> dict[str, float]:
    """One step of every schedule and flavour: the loss and every gradient against the
    single-device model built on this rank. Returns the worst relative error of each case.
    (Leaves the process group up, for the curves that follow on it.)"""
    import torch.distributed as dist

    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import Axis, ParallelDims, Topology
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize
    from paratron.parallel.pipeline.schedules import peak_live_activations
    from paratron.parallel.sharding import gather_full

    ctx = initialize("gloo")
    topology = Topology(ParallelDims(world, tp=tp, pp=pp), ctx.rank)
    topology.create_groups()
    ids = torch.randint(0, 97, (2 * MICRO_BATCHES, 17), generator=torch.Generator().manual_seed(3))
    # micro-batches of 16 and 12 tokens: shapes are worked out per micro-batch
    batches = [
        Batch(ids[i : i + 2, :length], ids[i : i + 2, 1 : length + 1])
        for i, length in zip(range(0, 2 * MICRO_BATCHES, 2), (16, 12) * MICRO_BATCHES)
    ]
    references: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
    worst: dict[str, float] = {}
    for flavour, model_settings in FLAVOURS.items():
        for case, settings in _layouts(pp):
            key = f"{flavour}-{case}"
            config = build_config(
                dict(
                    model_settings,
                    **settings,
                    pipeline_model_parallel_size=pp,
                    tensor_model_parallel_size=tp,
                    sequence_parallel=tp > 1,
                    mock_data=True,
                    seq_length=16,
                    micro_batch_size=2,
                    global_batch_size=2 * MICRO_BATCHES,
                    seed=7,
                )
            )
            # the single-device model and its step, once per model: the schedules' settings leave it alone
            model_key = repr(config.model)
            if model_key not in references:
                references[model_key] = _single_device_step(config.model, batches)
            reference, ref_loss = references[model_key]

            with torch.device("meta"):
                meta = GPT(dataclasses.replace(config.model))
            model = parallelize(
                meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
            )
            model.zero_grad()
            loss = model.forward_backward(batches, backward=lambda loss: loss.backward())
            expected_live = peak_live_activations(model.pipeline.schedule)[topology.local_rank(Axis.PP)]
            assert model.pipeline.peak_live == expected_live, f"{key}: activations held"
            if case in ("gpipe", "1f1b"):
                rank = topology.local_rank(Axis.PP)
                assert expected_live == (MICRO_BATCHES if case == "gpipe" else min(pp - rank, MICRO_BATCHES))
            summed = loss.clone()
            dist.all_reduce(summed, group=topology.group(Axis.PP).process_group)  # only the last stage holds the loss
            errors = {"loss": _rel(summed, ref_loss)}
            held = dict(model.module.named_parameters())
            ref_params = dict(reference.named_parameters())
            for name, param in held.items():
                grad = gather_full(param, topology.group(Axis.TP), param.grad)
                expected = ref_params[name].grad
                if name.endswith("in_proj.k.bias"):
                    continue  # zero in exact arithmetic (see the tensor-parallel test)
                errors[f"grad {name}"] = _rel(grad, expected)
            for what, error in errors.items():
                assert error < 1e-5, f"{key} PP={pp} TP={tp}: {what} differs by {error:.2e} relative"
            # every parameter of the single-device model lives on some stage
            names = [None] * dist.get_world_size()
            dist.all_gather_object(names, sorted(held))
            assert set().union(*names) == set(ref_params), f"{key}: parameters missing from every stage"
            worst[key] = max(errors.values())
    return worst


def train_curves(run_dir: str, runs: dict[str, dict]) -> dict[str, list[float]]:
    """Training runs, one after another in one process group: loss of every step."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    return {
        name: run_training(tiny_config(f"{run_dir}/{name}", **overrides)).losses for name, overrides in runs.items()
    }


def gradients_and_curves(
    world: int, pp: int, tp: int, run_dir: str, runs: dict[str, dict]
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """`gradient_parity`, then the loss curves of `runs`, on one process group: one spawn for both
    (each rank start costs seconds)."""
    return gradient_parity(world, pp, tp), train_curves(run_dir, runs)


def _curve_settings(flavour: str) -> dict:
    return dict(
        FLAVOURS[flavour],
        model_name=None,
        train_iters=CURVE_STEPS,
        micro_batch_size=2,
        global_batch_size=2 * MICRO_BATCHES,
        seq_length=16,
    )


@pytest.fixture(scope="module")
def single_device_curves(tmp_path_factory) -> dict[str, list[float]]:
    """Each flavour's single-device curve, trained once for every test here."""
    root = str(tmp_path_factory.mktemp("single"))
    return train_curves(root, {flavour: _curve_settings(flavour) for flavour in FLAVOURS})


def assert_curves_equal(curves: dict[str, list[float]], runs: dict[str, dict], reference: dict, layout: str) -> None:
    """Every run's curve equals its flavour's (the name's first word) single-device curve, step by step."""
    assert list(curves) == list(runs)
    for name, curve in curves.items():
        expected = reference[name.split("-")[0]]
        assert len(curve) == CURVE_STEPS
        for step, (ours, ref) in enumerate(zip(curve, expected), start=1):
            assert abs(ours - ref) <= 1e-5 * abs(ref), f"{name} {layout}: step {step}: {ours} vs {ref}"


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_gives_the_single_device_gradients_and_six_step_curves(tmp_path, single_device_curves, pp):
    runs = {
        f"{flavour}-{case}": dict(_curve_settings(flavour), **settings, pipeline_model_parallel_size=pp)
        for flavour in FLAVOURS
        for case, settings in _layouts(pp)
        if case != "1f1b-shapes-sent"
    }
    worst, curves = run_ranks(gradients_and_curves, pp, pp, pp, 1, str(tmp_path / f"pp{pp}"), runs)[0]
    assert len(worst) == 2 * len(_layouts(pp))
    assert_curves_equal(curves, runs, single_device_curves, f"PP={pp}")


def test_pipeline_with_tensor_parallelism_gives_the_single_device_gradients_and_six_step_curves(
    tmp_path, single_device_curves
):
    runs = {
        f"llama-{name}": dict(
            _curve_settings("llama"),
            pipeline_model_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            **settings,
        )
        for name, settings in _layouts(2)
        if name in ("zb-h1", "interleaved")
    }
    worst, curves = run_ranks(gradients_and_curves, 4, 4, 2, 2, str(tmp_path / "pp2-tp2"), runs)[0]
    assert len(worst) == 2 * len(_layouts(2))
    assert_curves_equal(curves, runs, single_device_curves, "PP2 x TP2")


def resume_runs(run_dir: str) -> dict:
    """At PP 2 with dropout: 12 steps straight (saving at 6 and 12), and a resume from step 6; the
    checkpoint's weights as the single-device model loads them."""
    import torch.distributed as dist

    from paratron.checkpoint.pretrained import load_pretrained
    from paratron.distributed.init import initialize

    initialize("gloo")
    common = dict(
        _curve_settings("gpt"),
        hidden_dropout=0.1,
        attention_dropout=0.1,
        pipeline_model_parallel_size=2,
        pipeline_schedule="zb-h1",
        train_iters=12,
    )
    straight = run_training(
        tiny_config(f"{run_dir}/straight", **common, save=f"{run_dir}/ckpt", save_interval=6)
    ).losses
    resumed = run_training(tiny_config(f"{run_dir}/second", **common, load=f"{run_dir}/ckpt/iter_0000006")).losses
    dist.barrier()
    names = sorted(dict(load_pretrained(f"{run_dir}/ckpt").named_parameters())) if dist.get_rank() == 0 else None
    return {"straight": straight, "resumed": resumed, "names": names}


def test_pipeline_resume_is_exact_and_checkpoints_load_whole(tmp_path):
    from paratron.model.gpt import build_model

    result = run_ranks(resume_runs, 2, str(tmp_path))[0]
    assert result["resumed"] == result["straight"][6:]  # bit-exact, dropout included
    config = tiny_config(tmp_path, **_curve_settings("gpt")).model
    assert result["names"] == sorted(dict(build_model(config).named_parameters()))
    index = json.loads((tmp_path / "ckpt" / "iter_0000006" / "model.safetensors.index.json").read_text())
    files = index["weight_map"]
    # each stage's first rank wrote its own layers, whole; the tied output weight once, by the first stage
    assert set(files.values()) == {"model_tp000_pp000_dp000.safetensors", "model_tp000_pp001_dp000.safetensors"}
    assert files["embedding.weight"] == "model_tp000_pp000_dp000.safetensors"
    assert files["final_norm.weight"] == "model_tp000_pp001_dp000.safetensors"
