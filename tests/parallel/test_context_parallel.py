"""Context parallelism equals one process: the split attention core (ring and all-gather) gives
the single-device attention's output and gradients for every pattern, with GQA and packed
documents; and 6-step fp32 training curves at CP2 and CP4, alone and with TP, PP, DP + ZeRO-1
and recomputation, equal the CP1 curve."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.distributed.topology import RankGroup
from paratron.model.attention import BlockSparse, Causal, Document, SlidingWindow, TokenPlaces, attend
from paratron.parallel.context.attention import ContextParallelAttention
from paratron.parallel.context.split import token_index

from tiny import PARITY_RUN, training_records

PATTERNS = {
    "causal": Causal(),
    "sliding-window": SlidingWindow(11),
    "block-sparse": BlockSparse(4, 3),
    "document": Document(),
}


def attention_on_ranks(length: int) -> dict[str, float]:
    """Worst difference, over patterns and both ways of communicating, between this rank's part of
    the split attention (output and gradients) and the single-device attention."""
    import torch.distributed as dist

    initialize("gloo")
    group = RankGroup.world()
    torch.manual_seed(0)  # (the same tensors on every rank)
    B, H, G, D = 2, 4, 2, 8
    q, k, v = torch.randn(B, H, length, D), torch.randn(B, G, length, D), torch.randn(B, G, length, D)
    grad = torch.randn(B, H, length, D)
    segments = torch.cat([torch.zeros(B, length // 3), torch.ones(B, length - length // 3)], dim=1).long()
    segments[1, 5:] += 1  # (rows with different documents)
    index = token_index(length, group.size, group.rank)
    worst: dict[str, float] = {}
    for name, pattern in PATTERNS.items():
        segs = segments if name == "document" else None
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = attend(pattern, *whole, TokenPlaces.row(length, q.device, segments=segs))
        expected.backward(grad)
        for comm_type in ("p2p", "all_gather"):
            core = ContextParallelAttention(pattern, group, comm_type)
            mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
            places = TokenPlaces(index, segs)
            out = core(*mine, places)
            if comm_type == "p2p":  # (how many block pairs ran block by block)
                plan = core.plan(places)
                worst[f"{name}/sparse pairs"] = sum(pair.blocks is not None for step in plan for pair in step)
            out.backward(grad[:, :, index])
            diffs = [(out - expected[:, :, index]).abs().max()]
            diffs += [(m.grad - w.grad[:, :, index]).abs().max() for m, w in zip(mine, whole)]
            worst[f"{name}/{comm_type}"] = max(float(d) for d in diffs)
    dist.barrier()
    return worst


@pytest.mark.spawns
@pytest.mark.parametrize("world", [2, 4])
def test_split_attention_equals_one_device_for_every_pattern(world):
    """(Chunks of 12 tokens: the window's and block-sparse pattern's pairs run block by block.)"""
    for rank, worst in enumerate(run_ranks(attention_on_ranks, world, 24 * world)):
        assert len(worst) == 12
        assert worst.pop("sliding-window/sparse pairs") > 0 and worst.pop("block-sparse/sparse pairs") > 0
        assert worst.pop("causal/sparse pairs") == 0 and worst.pop("document/sparse pairs") == 0
        for case, diff in worst.items():
            assert diff < 1e-5, f"rank {rank} {case}: {diff}"


def settings(run_dir: str, **overrides) -> dict:
    return dict(
        dict(
            num_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=64,
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            vocab_size=128,
            max_position_embeddings=256,
            mock_data=True,
            seq_length=256,
            micro_batch_size=1,
            global_batch_size=4,
            run_dir=run_dir,
            **dict(PARITY_RUN, train_iters=6),  # (6 steps of sequences of 256: the loss falls by 0.14)
        ),
        **overrides,
    )


def curve(run_dir: str, layout: dict) -> list[dict]:
    return training_records(settings(run_dir, **layout))


WINDOW = dict(attention_type="sliding-window", window_size=48)
LAYOUTS = {
    "cp2": (2, {}),
    "cp2-window": (2, WINDOW),
    "cp2-all-gather-recompute": (2, dict(cp_comm_type="all_gather", recompute_granularity="selective")),
    "cp4": (4, {}),
    "cp4-window-all-gather": (4, dict(WINDOW, cp_comm_type="all_gather")),
    "cp2-tp2-sp": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "cp2-pp2-window-recompute": (
        4,
        dict(WINDOW, pipeline_model_parallel_size=2, recompute_granularity="full", recompute_method="uniform"),
    ),
    "cp2-dp2-zero1": (4, dict(use_distributed_optimizer=True)),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("cp")
    return {"causal": curve(str(root / "causal"), {}), "window": curve(str(root / "window"), WINDOW)}


def curves_of_layouts(run_dir: str, layouts: dict[str, dict]) -> dict[str, list[dict]]:
    """Each layout's curve, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    return {
        name: curve(f"{run_dir}/{name}", dict(layout, context_parallel_size=int(name[2])))
        for name, layout in layouts.items()
    }


@pytest.mark.spawns
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_training_equals_one_process(tmp_path, references, world):
    for reference in references.values():
        assert len(reference) == 6 and reference[-1]["loss"] < reference[0]["loss"] - 0.1
    assert references["window"][-1]["loss"] != pytest.approx(references["causal"][-1]["loss"], rel=1e-3)
    layouts = {name: layout for name, (size, layout) in LAYOUTS.items() if size == world}
    for name, ours in run_ranks(curves_of_layouts, world, str(tmp_path), layouts)[0].items():
        reference = references["window" if "window" in name else "causal"]
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], rel=1e-5), f"{name}: {key}"


def resumed(run_dir: str) -> dict[str, list[float]]:
    """Six steps at CP2 with ZeRO-1 saving at step 3; resumed from it at CP2, and at CP1 x DP2."""
    initialize("gloo")
    zero1 = dict(use_distributed_optimizer=True, train_iters=6, global_batch_size=2)
    save = dict(zero1, context_parallel_size=2, save=f"{run_dir}/ckpt", save_interval=3)
    losses = {"straight": [r["loss"] for r in curve(f"{run_dir}/straight", save)]}
    for name, cp in (("cp2", 2), ("cp1-dp2", 1)):
        layout = dict(zero1, context_parallel_size=cp, load=f"{run_dir}/ckpt/iter_0000003")
        losses[name] = [r["loss"] for r in curve(f"{run_dir}/{name}", layout)]
    return losses


@pytest.mark.spawns
def test_context_parallel_checkpoint_resumes_exactly_at_cp2_and_cp1(tmp_path):
    losses = run_ranks(resumed, 2, str(tmp_path))[0]
    assert len(losses["straight"]) == 6
    assert losses["cp2"] == pytest.approx(losses["straight"][3:], rel=1e-6)
    assert losses["cp1-dp2"] == pytest.approx(losses["straight"][3:], rel=1e-5)


def activation_peaks(run_dir: str, cps: tuple[int, ...]) -> dict[int, list[int]]:
    """Every rank's peak of activations saved for backward (--log-memory's meter) in one step of a
    1024-token sequence per micro-batch, at each context-parallel size."""
    if "RANK" in os.environ:  # (spawned ranks; one process needs no group)
        initialize("gloo")
    peaks = {}
    for cp in cps:
        layout = dict(
            hidden_size=64,
            ffn_hidden_size=128,
            num_layers=2,
            seq_length=1024,
            max_position_embeddings=1024,
            train_iters=1,
            global_batch_size=4 // cp if cp > 1 else 1,
            context_parallel_size=cp,
            log_memory=True,
        )
        curve(f"{run_dir}/cp{cp}", layout)
        report = json.loads((Path(run_dir) / f"cp{cp}" / "memory.json").read_text())
        peaks[cp] = [rank["activations_peak"] for rank in report["ranks"]]
    return peaks


@pytest.mark.spawns
def test_activation_memory_per_rank_falls_as_one_over_cp(tmp_path):
    whole = activation_peaks(str(tmp_path / "one"), (1,))[1][0]
    split = run_ranks(activation_peaks, 4, str(tmp_path), (2, 4))[0]
    print("activation peaks per rank (bytes):", {1: whole, **split})
    for cp in (2, 4):
        for peak in split[cp]:  # the formula: every activation is per token, so each rank keeps 1/CP
            assert peak == pytest.approx(whole / cp, rel=0.10), (cp, peak, whole)
