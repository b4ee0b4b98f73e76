"""Data parallelism and the distributed optimizer (ZeRO 1-3) on 2, 4 and 8 gloo ranks equal the
single-process run with the same global batch: loss curves, gradient norms, resumes."""

from __future__ import annotations

import json

import pytest
import torch

from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import tiny_config

STEPS = 6


def train_losses(run_dir: str, overrides: dict) -> list[float]:
    """Runs on every rank; each rank returns the DP-averaged loss curve."""
    return run_training(tiny_config(run_dir, **overrides)).losses


def final_weights(run_dir: str, overrides: dict) -> dict[str, torch.Tensor]:
    from paratron.checkpoint import load_pretrained

    run_training(tiny_config(run_dir, **overrides))
    return dict(load_pretrained(overrides["save"]).state_dict())


# Every way of sharing over data-parallel ranks; small buckets, so that a step has several.
LAYOUTS = {
    "ddp": dict(),
    "ddp-overlap": dict(overlap_grad_reduce=True, ddp_bucket_size=20_000),
    "ddp-sync-every-micro-batch": dict(
        overlap_grad_reduce=True, ddp_bucket_size=20_000, ddp_sync_every_micro_batch=True
    ),
    "zero1": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=20_000
    ),
    "zero2": dict(zero_stage=2, overlap_grad_reduce=True, ddp_bucket_size=20_000),
    "zero3": dict(zero_stage=3),
}


def train_curves(run_dir: str, runs: dict[str, dict]) -> dict[str, list[float]]:
    """Runs on every rank: each named run's DP-averaged loss curve (one process group for all)."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    return {
        name: run_training(tiny_config(f"{run_dir}/{name}", **overrides)).losses for name, overrides in runs.items()
    }


def grad_norms(run_dir) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(ours: list[float], reference: list[float], what: str, rel: float = 1e-5) -> None:
    assert len(ours) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(ours, reference), start=1):
        assert abs(a - b) <= rel * abs(b), f"{what}: step {step}: {a} vs single process {b}"


def assert_same_norms(ours: list[float], reference: list[float], what: str) -> None:
    """The first step's norm (same weights) agrees to 1e-6; later ones follow weights that differ by
    rounding, which a spiking norm amplifies: 1e-4."""
    assert abs(ours[0] - reference[0]) <= 1e-6 * reference[0], f"{what}: {ours[0]} vs {reference[0]}"
    assert_same_curve(ours, reference, what, rel=1e-4)


ZERO_STAGE_RUN = dict(train_iters=STEPS, global_batch_size=16)
"""The runs every data-parallel size and ZeRO stage is compared on: 16 sequences a step."""


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> tuple[list[float], list[float]]:
    """The single-process curve and gradient norms of `ZERO_STAGE_RUN`, trained once for every DP size."""
    run_dir = tmp_path_factory.mktemp("single")
    return train_losses(str(run_dir), dict(ZERO_STAGE_RUN, micro_batch_size=4)), grad_norms(run_dir)


@pytest.mark.parametrize("dp, micro", [(2, 4), (4, 2)])
def test_every_zero_stage_gives_the_single_process_curve_and_grad_norms(tmp_path, single_process_run, dp, micro):
    """Two micro-batches per rank and step: gradients accumulate before they are synchronised."""
    reference, reference_norms = single_process_run
    runs = {name: dict(ZERO_STAGE_RUN, micro_batch_size=micro, **settings) for name, settings in LAYOUTS.items()}
    per_rank = run_ranks(train_curves, dp, str(tmp_path / "dp"), runs)
    assert all(curves == per_rank[0] for curves in per_rank), "ranks disagree on the averaged loss"
    for name, curve in per_rank[0].items():
        assert_same_curve(curve, reference, f"DP={dp} {name}")
        # the norm is summed over every shard once: equal to the single process's
        assert_same_norms(grad_norms(tmp_path / "dp" / name), reference_norms, f"DP={dp} {name} gradient norm")


def reduced_shards(mode: str, scatter_by_all_reduce: bool) -> list[torch.Tensor]:
    """On each rank: the reduced gradient shard of a small model after two micro-batches of rank-
    dependent data, overlapped in small buckets."""
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import RankGroup
    from paratron.parallel.data_parallel.buckets import GradientReducer

    initialize("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    reducer = GradientReducer(
        list(model.parameters()),
        RankGroup.world(),
        bucket_size=10,
        mode=mode,
        overlap=True,
        scatter_by_all_reduce=scatter_by_all_reduce,
    )
    for micro in range(2):
        reducer.sync_enabled = micro == 1 or mode == "reduce-scatter-shard"
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * dist.get_rank() + micro))
        model(x).pow(2).sum().backward()
    reducer.finish()
    pieces = reducer.local_pieces()
    if reducer.grad_buffer is not None:
        return [reducer.grad_buffer[pos : pos + z - a].clone() for _, a, z, pos in pieces]
    return [
        reducer.grad_shard[reducer.shard_position(pos) : reducer.shard_position(pos) + z - a].clone()
        for _, a, z, pos in pieces
    ]


def reduced_shards_both_ways(mode: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`reduced_shards` by the reduce-scatter and by its all-reduce form, on one process group."""
    return reduced_shards(mode, False), reduced_shards(mode, True)


@pytest.mark.parametrize("mode", ["reduce-scatter", "reduce-scatter-shard"])
def test_reduce_scatter_and_its_all_reduce_form_give_the_same_shards(mode):
    """The suite runs on gloo, where shards come from an all-reduce; NCCL runs the reduce-scatter."""
    scattered, all_reduced = zip(*run_ranks(reduced_shards_both_ways, 2, mode))
    for rank in range(2):
        assert len(scattered[rank]) == len(all_reduced[rank]) > 0
        for a, b in zip(scattered[rank], all_reduced[rank]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def three_d_runs(run_dir: str) -> dict:
    from paratron.distributed.init import initialize

    initialize("gloo")
    common = dict(
        LLAMA,
        train_iters=STEPS,
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=16,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        pipeline_model_parallel_size=2,
    )
    return {
        name: run_training(tiny_config(f"{run_dir}/{name}", **common, **settings)).losses
        for name, settings in [
            ("zero1", LAYOUTS["zero1"]),
            (
                "zero2-interleaved",
                dict(LAYOUTS["zero2"], pipeline_schedule="interleaved", num_layers_per_virtual_pipeline_stage=1),
            ),
        ]
    }


LLAMA = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=97,
    make_vocab_size_divisible_by=4,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    model_name=None,
)


def test_tp2_pp2_dp2_with_the_distributed_optimizer_gives_the_single_process_curve(tmp_path):
    reference = train_losses(
        str(tmp_path / "single"), dict(LLAMA, train_iters=STEPS, micro_batch_size=2, global_batch_size=8, seq_length=16)
    )
    curves = run_ranks(three_d_runs, 8, str(tmp_path / "3d"))[0]
    for name, curve in curves.items():
        assert_same_curve(curve, reference, f"TP2 x PP2 x DP2 {name}")
    for name in curves:
        assert_same_norms(
            grad_norms(tmp_path / "3d" / name), grad_norms(tmp_path / "single"), f"TP2 x PP2 x DP2 {name} gradient norm"
        )


def zero_resume_runs(run_dir: str) -> dict:
    """At DP 2: for ZeRO stages 1 and 3, 12 steps straight (saving at 6), and a resume from step 6."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    out = {}
    for name in ("zero1", "zero3"):
        common = dict(train_iters=12, micro_batch_size=4, global_batch_size=16, hidden_dropout=0.1, **LAYOUTS[name])
        straight = run_training(
            tiny_config(f"{run_dir}/{name}", **common, save=f"{run_dir}/{name}-ckpt", save_interval=6)
        ).losses
        resumed = run_training(
            tiny_config(f"{run_dir}/{name}-second", **common, load=f"{run_dir}/{name}-ckpt/iter_0000006")
        ).losses
        out[name] = (straight, resumed)
    return out


def test_zero_resume_is_exact_with_each_ranks_optimizer_shard(tmp_path):
    from paratron.checkpoint import load_pretrained

    result = run_ranks(zero_resume_runs, 2, str(tmp_path))[0]
    for name, (straight, resumed) in result.items():
        assert resumed == straight[6:], f"{name}: resumed {resumed} vs straight {straight[6:]}"
        files = sorted(p.name for p in (tmp_path / f"{name}-ckpt" / "iter_0000006").glob("optimizer_*"))
        assert files == ["optimizer_tp000_pp000_dp000.safetensors", "optimizer_tp000_pp000_dp001.safetensors"], files
    # the weights are whole, under single-device names, whatever the stage
    single = load_pretrained(str(tmp_path / "zero3-ckpt"))
    assert set(dict(single.named_parameters())) >= {"embedding.weight", "layers.0.attention.out_proj.weight"}


def test_data_parallel_final_weights_equal_single_process(tmp_path):
    common = dict(train_iters=10, global_batch_size=8, micro_batch_size=4)
    reference = final_weights(str(tmp_path / "single"), dict(common, save=str(tmp_path / "c1")))
    dp = run_ranks(final_weights, 2, str(tmp_path / "dp"), dict(common, save=str(tmp_path / "c2")))[0]
    for name, tensor in reference.items():
        if name.endswith("in_proj.k.bias"):
            # Its gradient is exactly zero in theory (softmax ignores a per-row constant), so Adam
            # amplifies rounding noise there and no two summation orders agree.
            continue
        torch.testing.assert_close(dp[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def fail_on_rank_one(message: str) -> int:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError(message)
    return 7


def test_helper_reports_each_ranks_failure():
    with pytest.raises(AssertionError, match=r"(?s)1 of 2 ranks failed:\nrank 1 raised:.*ValueError: boom"):
        run_ranks(fail_on_rank_one, 2, "boom")
    assert run_ranks(fail_on_rank_one, 1, "unused") == [7]


def mixed_precision_runs(run_dir: str) -> dict[str, list[float]]:
    """On every rank of DP 2: bf16 at each ZeRO stage, fp16 with the distributed optimizer, and a
    bf16 ZeRO-1 run resumed from its step-4 checkpoint (fp32 master shards restored)."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    common = dict(train_iters=8, micro_batch_size=2, global_batch_size=8, seq_length=16, ddp_bucket_size=20_000)
    runs = {f"bf16-zero{stage}": dict(common, precision="bf16", zero_stage=stage) for stage in range(4)}
    runs["fp16-zero2"] = dict(common, precision="fp16", zero_stage=2, initial_loss_scale=2.0**16)
    out = {name: run_training(tiny_config(f"{run_dir}/{name}", **o)).losses for name, o in runs.items()}
    save = f"{run_dir}/ckpt"
    first = dict(common, precision="bf16", zero_stage=1, save=save, save_interval=4, train_iters=4)
    run_training(tiny_config(f"{run_dir}/first", **dict(first, lr_decay_iters=8)))
    out["bf16-zero1-resumed"] = run_training(
        tiny_config(f"{run_dir}/resumed", **dict(first, train_iters=8, load=save, save=None))
    ).losses
    return out


def test_mixed_precision_with_data_parallelism_and_zero(tmp_path):
    """16-bit weights with fp32 masters and gradients at every ZeRO stage: each DP-2 curve stays
    within 2% of the single-process curve in the same precision (bf16 rounding depends on how the
    sums are split), and a ZeRO-1 bf16 run resumes exactly from its master-weight shards."""
    result = run_ranks(mixed_precision_runs, 2, str(tmp_path))[0]
    common = dict(train_iters=8, micro_batch_size=4, global_batch_size=8, seq_length=16)
    single = {
        p: run_training(tiny_config(tmp_path / f"single-{p}", precision=p, initial_loss_scale=2.0**16, **common)).losses
        for p in ("bf16", "fp16")
    }
    for name, losses in result.items():
        if name.endswith("resumed"):
            continue
        reference = single[name.split("-")[0]]
        assert losses == pytest.approx(reference, rel=2e-2), f"{name}: {losses} vs {reference}"
    assert result["bf16-zero1-resumed"] == result["bf16-zero1"][4:]
