"""Megatron-LM's distributed optimizer state (legacy `distrib_optim.pt`, torch_dist `dp_reshardable`)
-> paratron, with megatron-core 0.16.1 as the oracle.

One spawn of two gloo ranks: megatron-core's GPTModel (local spec, CPU, fp32, tied embedding)
wrapped in its own DistributedDataParallel with the distributed optimizer takes two Adam steps, at
two data-parallel ranks (buckets cut at `BUCKET` elements, each rank holding half of
every bucket) and at two pipeline stages (the tied embedding and its last-stage copy in buckets of
their own); megatron-core's own `save_parameter_state` and `dist_checkpointing.save` of its
`dp_reshardable` sharded state dict write the two formats. paratron's conversion must give, for
every parameter, exactly the master weight, exp_avg and exp_avg_sq megatron-core's optimizer held
of it (read per rank through megatron-core's own maps), and the converted checkpoint's first step in
paratron must move the weights as megatron-core's next step did. In this process: the bucket layout
at several data-parallel sizes against megatron-core's own gradient buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from paratron.checkpoint import megatron as mc
from paratron.checkpoint.formats import megatron_to_paratron
from paratron.checkpoint.megatron.distrib_optim import Bucketing, bucket_places
from paratron.checkpoint.verify import read_checkpoint
from paratron.distributed.local_ranks import run_ranks

VOCAB, SEQ, BUCKET = 128, 16, 3000
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


def _args(data_parallel_size: int = 1, pipeline_parallel: int = 1) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        **MODEL, normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
        swiglu=False, openai_gelu=True, untie_embeddings_and_output_weights=False, group_query_attention=False,
        num_query_groups=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=pipeline_parallel,
        vocab_size=VOCAB, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, max_position_embeddings=SEQ,
        seq_length=SEQ, norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, kv_channels=8, iteration=2,
        consumed_train_samples=4, attention_backend=AttnBackend.auto, params_dtype=torch.float32,
        use_distributed_optimizer=True, transformer_impl="local", data_parallel_size=data_parallel_size,
        overlap_grad_reduce=True, ddp_bucket_size=BUCKET,
    )  # fmt: skip


Pieces = list[tuple[str, str, int, torch.Tensor]]
"""(state, Megatron name, flat offset into the parameter, values): what one rank's optimizer holds."""


def _megatron_run(root: str, shards: int = 1) -> tuple[Pieces, dict[str, torch.Tensor]]:
    """Train megatron-core's distributed optimizer two steps at `shards` data-parallel ranks (this
    process's world), save both formats with megatron-core's own code; what this rank's optimizer holds,
    and the weights after one more step on `NEXT` (what a resumed run's first step must give)."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.utils import openai_gelu

    from megatron_oracle import cpu_megatron, cpu_optimizer, destroy_oracle, oracle_gpt

    with cpu_megatron(), cpu_optimizer():
        model, config = oracle_gpt(
            **MODEL, vocab_size=VOCAB, max_sequence_length=SEQ, normalization="LayerNorm", add_bias_linear=True,
            position_embedding_type="learned_absolute", activation_func=openai_gelu,
        )  # fmt: skip
        ddp, optimizer = _distributed_optimizer(model, config)
        _train(ddp, optimizer)
        held = _held(optimizer, {p: n for n, p in model.named_parameters()})
        _save_legacy(Path(root) / "legacy", model, optimizer, _args(shards))
        _save_torch_dist(Path(root) / "torch_dist", model, optimizer, _args(shards), dist_checkpointing)
        _train(ddp, optimizer, [NEXT])
        destroy_oracle()
    return held, {name: param.detach().clone() for name, param in model.named_parameters()}


def _distributed_optimizer(model: torch.nn.Module, config: Any) -> tuple[Any, Any]:
    """megatron-core's DDP (buckets cut at `BUCKET` elements) and distributed Adam over `model`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    settings = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True)
    # (Megatron-LM's groups: no weight decay for biases and 1-D parameters)
    optimizer = get_megatron_optimizer(settings, [ddp], get_standard_config_overrides(settings))
    for group in optimizer.param_groups:  # (as Megatron-LM's learning-rate scheduler sets them)
        group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)
    return ddp, optimizer


def _held(optimizer: Any, names: dict[torch.nn.Parameter, str]) -> Pieces:
    """What this rank's distributed optimizer holds of each parameter, read through megatron-core's own maps."""
    inner = optimizer.chained_optimizers[0]
    held: Pieces = []
    for param, name in names.items():
        if param not in inner.model_param_gbuf_map:
            continue  # (wholly in other ranks' shards)
        where = inner._get_model_param_range_map(param)["param"]
        tensors = inner._get_main_param_and_optimizer_states(param)
        for ours, theirs in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            held.append((ours, name, where.start, tensors[theirs].detach().clone().reshape(-1)))
    return held


Saved = tuple[Pieces, dict[str, torch.Tensor]]
"""One rank's share of a layout's saves: what its optimizer held, and its weights."""


def _both_layouts_rank(data_parallel_root: str, pipeline_root: str) -> tuple[Saved, Saved]:
    """One of two ranks: first a data-parallel rank, then a pipeline stage (one spawn for both layouts:
    each rank start imports megatron-core, seconds of CPU)."""
    import multiprocessing

    import torch.distributed as dist

    multiprocessing.current_process()._config["daemon"] = False  # (megatron's torch_dist writer forks)
    dist.init_process_group("gloo")
    return _megatron_run(data_parallel_root, dist.get_world_size()), _pipeline_run(pipeline_root)


def _pipeline_run(root: str) -> Saved:
    """One of two pipeline stages of a tied-embedding model (the embedding and its last-stage copy each in
    a bucket of their own, buckets cut on the first stage only); gradients made up per parameter name,
    the same for both copies of the embedding, two steps."""
    import zlib

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.utils import openai_gelu

    from megatron_oracle import cpu_megatron, cpu_optimizer, destroy_oracle, oracle_gpt

    stage = dist.get_rank()
    with cpu_megatron(), cpu_optimizer():
        model, config = oracle_gpt(
            1, 2, **MODEL, vocab_size=VOCAB, max_sequence_length=SEQ, normalization="LayerNorm", add_bias_linear=True,
            position_embedding_type="learned_absolute", activation_func=openai_gelu, pipeline_dtype=torch.float32,
            pre_process=stage == 0, post_process=stage == 1,
        )  # fmt: skip
        ddp, optimizer = _distributed_optimizer(model, config)
        offset = stage * MODEL["num_layers"] // 2
        names = {p: re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", n)
                 for n, p in model.named_parameters()}  # fmt: skip
        for step in (1, 2):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            for param, name in names.items():
                key = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
                made_up = torch.Generator().manual_seed(zlib.crc32(key.encode()) + step)
                param.main_grad.copy_(torch.randn(param.shape, generator=made_up) * 0.01)
            assert optimizer.step()[0]
        held = _held(optimizer, names)
        _save_legacy(Path(root) / "legacy", model, optimizer, _args(pipeline_parallel=2))
        _save_torch_dist(Path(root) / "torch_dist", model, optimizer, _args(pipeline_parallel=2), dist_checkpointing)
        destroy_oracle()
    return held, {name: param.detach().clone() for param, name in names.items()}


def _assemble(pieces: Pieces, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors by state and Megatron name from the ranks' pieces, every element covered once."""
    shapes = {name: w.shape for name, w in weights.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for ours, name, start, values in pieces:
        flat = out.setdefault(ours, {}).setdefault(name, torch.full((math.prod(shapes[name]),), float("nan")))
        assert flat[start : start + values.numel()].isnan().all()
        flat[start : start + values.numel()] = values
    for by_name in out.values():
        for name, flat in by_name.items():
            assert not flat.isnan().any(), name
            by_name[name] = flat.reshape(shapes[name])
    return out


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


NEXT = 99
"""The seed of the batch of the step after the save."""


def _train(ddp: Any, optimizer: Any, seeds: tuple[int, ...] | list[int] = (5, 6)) -> None:
    """Megatron's steps, each on its batch (this data-parallel rank's)."""
    import torch.distributed as dist

    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    ddp.train()
    for seed in seeds:
        tokens = _batch(seed + 1000 * dist.get_rank())
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(tokens, positions, mask, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]


def _save_legacy(root: Path, model: torch.nn.Module, optimizer: Any, args: argparse.Namespace) -> None:
    """What Megatron-LM's legacy save writes with --use-distributed-optimizer (each stage's data-parallel
    rank 0 writes its files)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    folder = (
        root / "iter_0000002" / (f"mp_rank_00_{stage:03d}" if args.pipeline_model_parallel_size > 1 else "mp_rank_00")
    )
    first = ps.get_data_parallel_rank() == 0
    if first:
        folder.mkdir(parents=True)
        content = {"args": args, "checkpoint_version": 3.0, "iteration": 2, "model": model.state_dict(),
                   "optimizer": optimizer.state_dict()}  # fmt: skip
        torch.save(content, folder / "model_optim_rng.pt")
    optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))  # (gathered onto data-parallel rank 0)
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("2")


def _save_torch_dist(
    root: Path, model: torch.nn.Module, optimizer: Any, args: argparse.Namespace, dist_checkpointing: Any
) -> None:
    """What Megatron-LM's torch_dist save writes by default with --use-distributed-optimizer."""
    import torch.distributed as dist

    folder = root / "iter_0000002"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("2")
    dist.barrier()
    model_sd = model.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    state = {"model": model_sd, "optimizer": optim_sd, "args": args, "iteration": 2, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(folder))


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory) -> tuple[Path, Path, list[tuple[Saved, Saved]]]:
    """megatron-core's saves at two data-parallel ranks and at two pipeline stages, from one spawn: (the
    data-parallel folder, the pipeline folder, each rank's (data-parallel, pipeline) shares)."""
    data_parallel_root = tmp_path_factory.mktemp("distrib_optim_dp2")
    pipeline_root = tmp_path_factory.mktemp("distrib_optim_pp2")
    ranks = run_ranks(_both_layouts_rank, 2, str(data_parallel_root), str(pipeline_root), timeout=300)
    return data_parallel_root, pipeline_root, ranks


@pytest.fixture(scope="module")
def dp2(both_layouts) -> dict[str, Any]:
    """megatron-core's saves at two data-parallel ranks (each holding half of every bucket)."""
    root, _, both = both_layouts
    ranks = [data_parallel for data_parallel, _ in both]
    assert all(len(pieces) < len(ranks[0][1]) * 3 for pieces, _ in ranks)  # (no rank holds everything)
    after = ranks[0][1]
    assert all(torch.equal(after[name], w) for name, w in ranks[1][1].items())
    return {"root": root, "expected": _assemble([p for pieces, _ in ranks for p in pieces], after), "after": after}


@pytest.fixture(scope="module")
def pp2(both_layouts) -> dict[str, Any]:
    """megatron-core's saves at two pipeline stages, the embedding tied."""
    _, root, both = both_layouts
    ranks = [pipeline for _, pipeline in both]
    weights = {**ranks[0][1], **ranks[1][1]}
    expected = _assemble([p for pieces, _ in ranks for p in pieces], weights)
    for by_name in expected.values():  # (the last stage's copy of the tied embedding holds the same state)
        assert torch.equal(by_name.pop("output_layer.weight"), by_name["embedding.word_embeddings.weight"])
    return {"root": root, "expected": expected}


@pytest.mark.spawns  # (megatron-core's torch_dist writer starts a process)
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("shards", ["dp2", "pp2"])
def test_distributed_optimizer_state_converts_exactly(request, tmp_path, fmt, shards):
    from safetensors.torch import load_file

    saves = request.getfixturevalue(shards)
    source = saves["root"] / fmt
    ckpt = mc.open_megatron(source)
    model = mc.config_of(ckpt.args, "megatron").model
    state = mc.megatron_optimizer(ckpt, model)
    assert state is not None
    for ours, by_name in saves["expected"].items():
        expected = mc.to_paratron(by_name, model, "megatron")
        assert set(state[ours]) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(state[ours][name], tensor), (ours, name)
        assert expected["embedding.weight"].abs().sum() > 0
    converted = megatron_to_paratron(source, tmp_path / "converted")  # (what --load resumes from)
    stored = load_file(str(read_checkpoint(converted).path / "optimizer_tp000_pp000_dp000.safetensors"))
    expected = mc.to_paratron(saves["expected"]["exp_avg_sq"], model, "megatron")
    assert all(torch.equal(stored[f"exp_avg_sq/{n}"], t) for n, t in expected.items())
    assert json.loads((converted / "optimizer.index.json").read_text())["step"] == 2.0


@pytest.mark.spawns  # (megatron-core's torch_dist writer starts a process)
def test_a_layout_the_saved_pieces_contradict_is_left_out(dp2, tmp_path):
    """Read as Transformer Engine's spec (Megatron-LM's default), the attention norm would sit after
    `linear_proj`: same bucket sizes, but the saved pieces' edges say otherwise, so no state at all."""
    copy = tmp_path / "torch_dist"
    shutil.copytree(dp2["root"] / "torch_dist", copy)
    common = copy / "iter_0000002" / "common.pt"
    saved = torch.load(common, weights_only=False)
    del saved["args"].transformer_impl
    torch.save(saved, common)
    ckpt = mc.open_megatron(copy)
    assert mc.megatron_optimizer(ckpt, mc.config_of(ckpt.args, "megatron").model) is None


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_bucket_layout_is_megatron_cores(shards):
    """Where megatron-core's own gradient buffer puts each parameter, at data-parallel sizes, bucket
    cuts, bus-bandwidth padding and a tied embedding's own bucket."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    from megatron_oracle import cpu_megatron, destroy_oracle, init_oracle_parallel

    sizes = [4096, 64, 1000, 33, 3072, 5, 777, 4096, 129]
    with cpu_megatron():
        init_oracle_parallel()
        for bucket_size in (None, 700):
            for shared in (None, 0, len(sizes) - 1):
                for busbw in (False, True):
                    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
                    if shared is not None:
                        params[shared].shared_embedding = True
                    config = DistributedDataParallelConfig(
                        use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=busbw
                    )
                    buffer = _ParamAndGradBuffer(
                        config, torch.float32, torch.float32, params, _Group(shards), bucket_size,
                        {p: str(i) for i, p in enumerate(params)}, 1.0, list(range(len(params))), False,
                        SimpleNamespace(tp=_Group(1), dp_cp=_Group(shards)),
                    )  # fmt: skip
                    listed = [(str(i), n, i == shared) for i, n in enumerate(sizes)]
                    places, unpadded = bucket_places(listed, Bucketing(shards, bucket_size, busbw))
                    starts = [b.offset for b in buffer.buckets]
                    theirs = {}
                    for i, p in enumerate(params):
                        start, _, bucket = buffer.param_index_map[p]
                        theirs[str(i)] = (bucket, start - starts[bucket])
                    assert places == theirs, (bucket_size, shared, busbw)
                    assert unpadded == [b.numel_unpadded for b in buffer.buckets]
        destroy_oracle(destroy_process_group=True)


@pytest.mark.spawns  # (megatron-core's torch_dist writer starts a process)
def test_resumed_run_steps_as_megatron_would(dp2, tmp_path):
    """The converted checkpoint's first step in paratron (its weights, Adam's moments and step count
    loaded) moves the weights as megatron-core's next step did, within fp32 tolerance."""
    import dataclasses

    from paratron.checkpoint.load import read_weight
    from paratron.checkpoint.native import load_converted_optimizer
    from paratron.config.layout import resolve_layout
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model import GPT
    from paratron.model.batch import Batch
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel import parallelize
    from paratron.training.step import train_step

    info = read_checkpoint(megatron_to_paratron(dp2["root"] / "torch_dist", tmp_path / "converted"))
    settings = dataclasses.replace(info.config.optimizer, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    config = dataclasses.replace(info.config, optimizer=settings)
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.copy_(read_weight(info, name))
    optimizer = build_optimizer(model, config.optimizer)
    assert load_converted_optimizer(info.path, optimizer, model.module)
    for group in optimizer.optimizer.param_groups:
        group["lr"] = 1e-2
    tokens = torch.cat([_batch(NEXT), _batch(NEXT + 1000)])  # (both data-parallel ranks' batches)
    train_step(model, optimizer, [Batch(tokens, tokens)], Precision("fp32"), 1.0)
    expected = mc.to_paratron(dp2["after"], config.model, "megatron")
    moved = 0.0
    for name, param in model.module.named_parameters():
        before = read_weight(info, name)
        if name.endswith("in_proj.k.bias"):  # (its true gradient is zero: Adam scales up rounding noise)
            assert (param.detach() - before).abs().max() < 1e-4 > (expected[name] - before).abs().max()
            continue
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=2e-6)
        moved = max(moved, (expected[name] - before).abs().max().item())
    assert moved > 1e-3  # (the step moved the weights by far more than the tolerance)
