"""Megatron-LM's distributed optimizer state (legacy `distrib_optim.pt`, torch_dist `dp_reshardable`)
-> paratron, with megatron-core 0.16.1 as the oracle.

In this process: megatron-core's GPTModel (local spec, CPU, fp32) wrapped in its own
DistributedDataParallel with the distributed optimizer, cut into several buckets, takes two Adam
steps; its own `save_parameter_state` and `dist_checkpointing.save` of its `dp_reshardable`
sharded state dict write the two formats; paratron's conversion must give, for every parameter,
exactly the master weight, exp_avg and exp_avg_sq megatron-core's optimizer holds for it. The
flat layout at data-parallel sizes above one (where bucket padding depends on DP) and with a tied
embedding across pipeline stages is checked against megatron-core's own gradient buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from paratron.checkpoint import megatron as mc
from paratron.checkpoint.convert import megatron_to_paratron
from paratron.checkpoint.io import read_checkpoint
from paratron.checkpoint.megatron.distrib_optim import Bucketing, bucket_places
from paratron.distributed.local_ranks import run_ranks

VOCAB, SEQ, BUCKET = 128, 16, 3000
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


class _CudaOnCpu(TorchFunctionMode):
    """megatron-core's optimizers allocate on 'cuda' and check `param.type()` for CUDA names:
    here tensors made for 'cuda' are made on the CPU and CPU tensors report CUDA type names."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _args(data_parallel_size: int = 1) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        **MODEL, normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
        swiglu=False, openai_gelu=True, untie_embeddings_and_output_weights=False, group_query_attention=False,
        num_query_groups=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, vocab_size=VOCAB,
        padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, max_position_embeddings=SEQ, seq_length=SEQ,
        norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, kv_channels=8, iteration=2,
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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.transformer.utils import openai_gelu

    from megatron_oracle import cpu_megatron, destroy_oracle, oracle_gpt

    with cpu_megatron(), _CudaOnCpu():
        model, config = oracle_gpt(
            **MODEL, vocab_size=VOCAB, max_sequence_length=SEQ, normalization="LayerNorm", add_bias_linear=True,
            position_embedding_type="learned_absolute", activation_func=openai_gelu,
        )  # fmt: skip
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET
        )
        ddp = DistributedDataParallel(config, ddp_config, model)
        assert len(ddp.buffers[0].buckets) > 2  # (the layout is cut into several buckets)
        settings = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True)
        # (Megatron-LM's groups: no weight decay for biases and 1-D parameters)
        optimizer = get_megatron_optimizer(settings, [ddp], get_standard_config_overrides(settings))
        for group in optimizer.param_groups:  # (as Megatron-LM's learning-rate scheduler sets them)
            group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)
        _train(ddp, optimizer)
        inner = optimizer.chained_optimizers[0]
        held: Pieces = []
        for name, param in model.named_parameters():
            if param not in inner.model_param_gbuf_map:
                continue  # (wholly in other ranks' shards)
            where = inner._get_model_param_range_map(param)["param"]
            tensors = inner._get_main_param_and_optimizer_states(param)
            for ours, theirs in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                held.append((ours, name, where.start, tensors[theirs].detach().clone().reshape(-1)))
        _save_legacy(Path(root) / "legacy", model, optimizer, shards)
        _save_torch_dist(Path(root) / "torch_dist", model, optimizer, shards, dist_checkpointing)
        _train(ddp, optimizer, [NEXT])
        destroy_oracle()
    return held, {name: param.detach().clone() for name, param in model.named_parameters()}


def _data_parallel_rank(root: str) -> tuple[Pieces, dict[str, torch.Tensor]]:
    """One of two data-parallel ranks (each its own batch)."""
    import multiprocessing

    import torch.distributed as dist

    multiprocessing.current_process()._config["daemon"] = False  # (megatron's torch_dist writer forks)
    dist.init_process_group("gloo")
    return _megatron_run(root, dist.get_world_size())


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


def _save_legacy(root: Path, model: torch.nn.Module, optimizer: Any, shards: int) -> None:
    """What Megatron-LM's legacy save writes with --use-distributed-optimizer (data-parallel rank 0's files)."""
    import torch.distributed as dist

    folder = root / "iter_0000002" / "mp_rank_00"
    first = dist.get_rank() == 0
    if first:
        folder.mkdir(parents=True)
        content = {"args": _args(data_parallel_size=shards), "checkpoint_version": 3.0, "iteration": 2,
                   "model": model.state_dict(), "optimizer": optimizer.state_dict()}  # fmt: skip
        torch.save(content, folder / "model_optim_rng.pt")
    optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))  # (gathered onto rank 0)
    if first:
        (root / "latest_checkpointed_iteration.txt").write_text("2")


def _save_torch_dist(root: Path, model: torch.nn.Module, optimizer: Any, shards: int, dist_checkpointing: Any) -> None:
    """What Megatron-LM's torch_dist save writes by default with --use-distributed-optimizer."""
    import torch.distributed as dist

    folder = root / "iter_0000002"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("2")
    dist.barrier()
    model_sd = model.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    state = {"model": model_sd, "optimizer": optim_sd, "args": _args(data_parallel_size=shards), "iteration": 2,
             "checkpoint_version": 3.0}  # fmt: skip
    dist_checkpointing.save(state, str(folder))


@pytest.fixture(scope="module")
def dp1(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """megatron-core's saves at one data-parallel rank, in this process."""
    from megatron_oracle import destroy_oracle

    root = tmp_path_factory.mktemp("distrib_optim_dp1")
    pieces, after = _megatron_run(str(root))
    yield {"root": root, "expected": _assemble(pieces, after), "after": after}
    destroy_oracle(destroy_process_group=True)  # (later tests build their own worlds)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict[str, Any]:
    """megatron-core's saves at two data-parallel ranks (each holding half of every bucket)."""
    root = tmp_path_factory.mktemp("distrib_optim_dp2")
    ranks = run_ranks(_data_parallel_rank, 2, str(root), timeout=240)
    assert all(len(pieces) < len(ranks[0][1]) * 3 for pieces, _ in ranks)  # (no rank holds everything)
    return {"root": root, "expected": _assemble([p for pieces, _ in ranks for p in pieces], ranks[0][1])}


@pytest.mark.spawns  # (megatron-core's torch_dist writer starts a process)
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("shards", ["dp1", "dp2"])
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
def test_a_layout_the_saved_pieces_contradict_is_left_out(dp1, tmp_path):
    """Read as Transformer Engine's spec (Megatron-LM's default), the attention norm would sit after
    `linear_proj`: same bucket sizes, but the saved pieces' edges say otherwise, so no state at all."""
    copy = tmp_path / "torch_dist"
    shutil.copytree(dp1["root"] / "torch_dist", copy)
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
def test_resumed_run_steps_as_megatron_would(dp1, tmp_path):
    """The converted checkpoint's first step in paratron (its weights, Adam's moments and step count
    loaded) moves the weights as megatron-core's next step did, within fp32 tolerance."""
    import dataclasses

    from paratron.checkpoint.io import read_weight
    from paratron.checkpoint.native import load_converted_optimizer
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model import GPT
    from paratron.model.batch import Batch
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel import parallelize
    from paratron.training.step import train_step

    info = read_checkpoint(megatron_to_paratron(dp1["root"] / "torch_dist", tmp_path / "converted"))
    settings = dataclasses.replace(info.config.optimizer, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    config = dataclasses.replace(info.config, optimizer=settings)
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.copy_(read_weight(info, name))
    optimizer = build_optimizer(model, config.optimizer)
    assert load_converted_optimizer(info.path, optimizer, model.module)
    for group in optimizer.optimizer.param_groups:
        group["lr"] = 1e-2
    tokens = _batch(NEXT)
    train_step(model, optimizer, [Batch(tokens, tokens)], Precision("fp32"), 1.0)
    expected = mc.to_paratron(dp1["after"], config.model, "megatron")
    moved = 0.0
    for name, param in model.module.named_parameters():
        before = read_weight(info, name)
        if name.endswith("in_proj.k.bias"):  # (its true gradient is zero: Adam scales up rounding noise)
            assert (param.detach() - before).abs().max() < 1e-4 > (expected[name] - before).abs().max()
            continue
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=2e-6)
        moved = max(moved, (expected[name] - before).abs().max().item())
    assert moved > 1e-3  # (the step moved the weights by far more than the tolerance)
