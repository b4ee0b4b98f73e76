"""A checkpoint saved at one layout resumes at another and continues with the losses the original
layout would have produced: tensor and pipeline sizes, data-parallel sizes and ZeRO stages change,
the optimizer state (saved in pieces under single-device names) follows."""

from __future__ import annotations

from paratron.training.run import run_training

from multiprocess import run_ranks
from tiny import tiny_config

# vocabulary 97 pads differently at each TP size; 2 key-value heads are replicated at TP 4
MODEL = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=97,
    make_vocab_size_divisible_by=4,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    model_name=None,
    seq_length=16,
    micro_batch_size=2,
    global_batch_size=16,
    train_iters=10,
    lr_warmup_iters=2,
)
SAVED_AT = 5
TOLERANCE = 1e-6


def curve(run_dir: str, overrides: dict) -> list[float]:
    return run_training(tiny_config(run_dir, **MODEL, **overrides)).losses


def assert_continues(resumed: list[float], straight: list[float], what: str, tolerance: float = TOLERANCE) -> None:
    assert len(resumed) == len(straight) - SAVED_AT
    for step, (a, b) in enumerate(zip(resumed, straight[SAVED_AT:]), start=SAVED_AT + 1):
        assert abs(a - b) <= tolerance * abs(b), f"{what}, step {step}: {a} vs {b} ({abs(a - b) / b:.2e})"


def reshard(
    tmp_path, name: str, before: dict, world_before: int, after: dict, world_after: int, tolerance: float = TOLERANCE
) -> None:
    reshard_to_several(tmp_path, name, before, world_before, [(after, world_after)], tolerance)


def reshard_to_several(
    tmp_path, name: str, before: dict, world_before: int, afters: list[tuple[dict, int]], tolerance: float = TOLERANCE
) -> None:
    """One run saved at `before`, resumed at each layout of `afters` ((settings, world size) pairs)."""
    save = str(tmp_path / f"{name}-ckpt")
    straight = run_ranks(
        curve, world_before, str(tmp_path / f"{name}-a"), dict(before, save=save, save_interval=SAVED_AT)
    )[0]
    checkpoint = f"{save}/iter_{SAVED_AT:07d}"
    for i, (after, world_after) in enumerate(afters):
        resumed = run_ranks(curve, world_after, str(tmp_path / f"{name}-b{i}"), dict(after, load=checkpoint))[0]
        assert_continues(resumed, straight, f"{name} -> {after}", tolerance)


def test_tp2_pp2_resumes_as_pp4(tmp_path):
    reshard(
        tmp_path,
        "tp2pp2-pp4",
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        4,
        dict(pipeline_model_parallel_size=4),
        4,
    )


def test_tp4_resumes_on_one_process(tmp_path):
    reshard(tmp_path, "tp4-tp1", dict(tensor_model_parallel_size=4, sequence_parallel=True), 4, {}, 1)


def test_zero1_dp2_resumes_at_dp4_and_as_zero3(tmp_path):
    zero1 = dict(use_distributed_optimizer=True, ddp_bucket_size=5_000)
    reshard_to_several(
        tmp_path, "zero1-dp2", zero1, 2, [(dict(zero1, ddp_bucket_size=3_000), 4), (dict(zero_stage=3), 2)]
    )


def test_bf16_masters_reshard(tmp_path):
    """16-bit weights: the fp32 master pieces move with the optimizer state. At the same layout the
    resume is exact, as it must be when the fp32 masters are restored; from ZeRO-1 shards to
    whole-parameter masters it stays within bf16's rounding (a norm summed in another order can
    flip a bf16 rounding: 3.9e-5 measured)."""
    zero1 = dict(precision="bf16", zero_stage=1, ddp_bucket_size=5_000)
    reshard(tmp_path, "bf16-same", zero1, 2, zero1, 2, tolerance=0.0)
    reshard(tmp_path, "bf16", zero1, 2, dict(precision="bf16"), 2, tolerance=1e-4)


def test_virtual_pipeline_resumes_as_one_stage_per_rank(tmp_path):
    reshard(
        tmp_path,
        "vpp",
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
        2,
        dict(pipeline_model_parallel_size=2),
        2,
    )
