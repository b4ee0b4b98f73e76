"""`paratron train --dry-run` and the planner's fast memory prediction.

The dry run builds every rank role through the real `parallelize` on the meta device in a fake
world; `predict_memory` prices the same layouts from one meta build per tensor x expert size.
They must agree, for every layout the planner may choose."""

from __future__ import annotations

import subprocess

import pytest

from paratron.cli import main
from paratron.config import build_config, validate
from paratron.model.registry import count_parameters, model_config
from paratron.planning.activations import CPU, CUDA
from paratron.planning.dry_run import dry_run, with_vocabulary
from paratron.planning.memory_prediction import predict_memory

from tiny import LLAMA_STYLE

SMALL = dict(
    mock_data=True,
    attention_dropout=0.0,  # (context parallelism has no attention dropout yet)
    num_layers=8,
    hidden_size=128,
    num_attention_heads=8,
    seq_length=128,
    max_position_embeddings=128,
    micro_batch_size=2,
    global_batch_size=32,
)
LLAMA = dict(LLAMA_STYLE, num_query_groups=4)
LAYOUTS = {
    "one rank": (1, {}),
    "tp4 sp zero1 bf16": (
        16,
        dict(
            LLAMA,
            tensor_model_parallel_size=4,
            sequence_parallel=True,
            use_distributed_optimizer=True,
            precision="bf16",
        ),
    ),
    "pp4 interleaved tied": (
        8,
        dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, precision="bf16"),
    ),
    "pp2 uneven zero2 full recompute": (
        8,
        dict(
            LLAMA,
            pipeline_model_parallel_size=2,
            decoder_first_pipeline_num_layers=5,
            zero_stage=2,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
    ),
    "zero3 dp8": (8, dict(LLAMA, zero_stage=3, precision="bf16")),
    "cp2 tp2 zb-v": (
        16,
        dict(
            LLAMA,
            context_parallel_size=2,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            pipeline_schedule="zb-v",
        ),
    ),
    "ep4 moe": (
        8,
        dict(
            LLAMA,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            expert_model_parallel_size=4,
            use_distributed_optimizer=True,
        ),
    ),
    "lora tp2": (4, dict(LLAMA, lora_rank=8, tensor_model_parallel_size=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("kernels", [CPU, CUDA], ids=["cpu", "cuda"])
def test_the_fast_prediction_equals_the_dry_run(name, kernels):
    world, settings = LAYOUTS[name]
    config = with_vocabulary(build_config(dict(SMALL, **settings)))
    layout = validate(config, world)
    built = dry_run(config, layout, kernels)
    predicted = predict_memory(config, world, kernels, layout)
    assert [r.stage for r in built] == list(range(layout.pp))
    assert sum(r.ranks for r in built) == world
    for role, fast in zip(built, predicted):
        assert fast.activations == role.activations and fast.buffers == role.buffers
        for category in ("parameters", "gradients", "master", "optimizer_state"):
            assert getattr(fast, category) == pytest.approx(getattr(role, category), rel=2e-3), (name, category)


def test_zero_stages_shard_what_the_zero_paper_says():
    """fp32 Adam on 8 data-parallel ranks: 16 bytes per parameter at stage 0, 4 + 4 + 8/8 at stage 2
    (weights, the gradient shard, the optimizer shard; fp32 masters are the weights), 16/8 at stage 3."""
    psi = count_parameters(model_config("debug", vocab_size=4096))
    state = {}
    for stage in (0, 2, 3):
        config = with_vocabulary(build_config(dict(model_name="debug", mock_data=True, zero_stage=stage)))
        (role,) = dry_run(config, validate(config, 8), CPU)
        state[stage] = role.state / psi
    assert state[0] == pytest.approx(16, rel=1e-3)
    assert state[2] == pytest.approx(4 + 12 / 8, rel=5e-3)
    assert state[3] == pytest.approx(16 / 8, rel=5e-3)


def _train(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`paratron train ARGS` in this process (a dry run starts no workers)."""
    code = main(["train", *args])
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def test_dry_run_prints_each_stage_against_the_device_memory(capsys):
    run = _train(
        capsys,
        "--model", "llama3-8b", "--mock-data", "--seq-length", "4096", "--bf16", "--micro-batch-size", "1",
        "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
        "--use-distributed-optimizer", "--global-batch-size", "256", "--dry-run", "--world-size", "1024",
        "--hardware", "h100-80g",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("dry run: world 1024 = TP 8 x CP 1 x DP 32 x PP 4")
    stages = [line.split() for line in lines if line.strip().split(" ")[0] in "0123"]
    assert [row[0] for row in stages] == ["0", "1", "2", "3"] and all(row[1] == "256" for row in stages)
    assert "fits: the fullest rank" in lines[-1] and "of 80 GB" in lines[-1]


def test_a_layout_that_does_not_fit_exits_2_naming_the_stage_and_the_way_out(capsys):
    run = _train(
        capsys,
        "--model", "llama3-70b", "--mock-data", "--seq-length", "4096", "--bf16", "--micro-batch-size", "1",
        "--global-batch-size", "64", "--dry-run", "--world-size", "64", "--device-memory-gb", "80",
    )  # fmt: skip
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "pipeline stage 0 needs" in last and "--device-memory-gb" in last and "paratron plan" in last
    assert "Traceback" not in run.stderr


def test_an_unknown_hardware_preset_exits_2_listing_the_presets(capsys):
    run = _train(capsys, "--model", "debug", "--mock-data", "--dry-run", "--world-size", "2", "--hardware", "tpu-v9")
    assert run.returncode == 2
    assert "--hardware tpu-v9: unknown preset; choose one of h100-80g" in run.stderr


def test_a_dry_run_asks_for_no_data_source(capsys):
    """It reads no data: without a source it counts the model a data path would train (the vocabulary a
    trained BPE aims for, said), and the same with --mock-data's; only contradictory sources are refused."""
    shape = ["--model", "debug", "--global-batch-size", "8", "--seq-length", "32", "--dry-run", "--world-size", "2"]
    run = _train(capsys, *shape)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("dry run: world 2 = ") and run.stderr == ""
    assert run.stdout.splitlines()[-1] == (
        "(no data was given: counted with a vocabulary of 8,192, what a trained ByteLevelBPE tokenizer aims for; "
        "give --vocab-size or your tokenizer's flags for yours)"
    )
    run = _train(capsys, *shape, "--vocab-size", "512")
    assert run.returncode == 0 and "no data was given" not in run.stdout
    run = _train(capsys, *shape, "--mock-data", "--corpus", "stdlib")
    assert run.returncode == 2
    assert "give exactly one of --data-path" in run.stderr and "(got --mock-data and --corpus)" in run.stderr
