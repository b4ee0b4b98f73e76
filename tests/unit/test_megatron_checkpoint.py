"""Megatron-LM checkpoints <-> paratron, with megatron-core 0.16.1 as the oracle.

One spawn of 4 gloo ranks (forked from one process that imported megatron-core once) builds
megatron-core's GPTModel (local spec, CPU, fp32) at TP x PP = 1x1, 2x1, 1x2 and 2x2 (the rest of
the 4 ranks are data-parallel replicas), saves it with megatron-core's own code (legacy
`state_dict()` files and `dist_checkpointing.save` of its `sharded_state_dict()`, with an fp32
Adam's `sharded_state_dict` for the torch_dist optimizer entries) and runs its forward; the same
ranks load legacy checkpoints that paratron wrote into megatron-core GPTModels
(`load_state_dict(strict=True)`) and run them. The parent process converts with paratron and
compares weights element for element and logits within 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratron.checkpoint import megatron as mc
from paratron.checkpoint.formats import megatron_to_paratron, paratron_to_megatron
from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config.loading import build_config
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import CheckpointError
from paratron.model.gpt import build_model

VOCAB, PADDED_BY, SEQ, BATCH = 120, 64, 16, 2
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
KINDS = {
    "gpt": dict(  # learned positions, LayerNorm, GELU (tanh: megatron's openai_gelu), biases, tied
        megatron=dict(normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute"),
        args=dict(normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
                  swiglu=False, openai_gelu=True, untie_embeddings_and_output_weights=False,
                  group_query_attention=False, num_query_groups=1),
    ),
    "llama": dict(  # rope, RMSNorm, SwiGLU, grouped-query attention, no bias, untied
        megatron=dict(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                      num_query_groups=2, gated_linear_unit=True, share_embeddings_and_output_weights=False),
        args=dict(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope", swiglu=True,
                  untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=2,
                  rotary_base=10000),
    ),
}  # fmt: skip
COMMON = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


def megatron_args(kind: str, tp: int, pp: int) -> argparse.Namespace:
    """The args a Megatron-LM run of this model would store (with one of its enums, as it does)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        **COMMON, **KINDS[kind]["args"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        vocab_size=VOCAB, padded_vocab_size=mc.padded_vocab(VOCAB, PADDED_BY, tp),
        make_vocab_size_divisible_by=PADDED_BY, max_position_embeddings=64, seq_length=SEQ, norm_epsilon=1e-5,
        hidden_dropout=0.0, attention_dropout=0.0, kv_channels=8, iteration=10, consumed_train_samples=80,
        attention_backend=AttnBackend.auto, params_dtype=torch.float32,
    )  # fmt: skip


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------- the ranks


def _build(kind: str, tp: int, pp: int) -> torch.nn.Module:
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import openai_gelu

    from megatron_oracle import oracle_gpt

    settings = dict(KINDS[kind]["megatron"], pipeline_dtype=torch.float32)
    if kind == "llama":
        settings["activation_func"] = F.silu
    else:
        settings["activation_func"] = openai_gelu
    # (a tied embedding under PP: megatron-core moves it to CUDA for its all-reduce over the first and
    # last stages; in this spawned rank only, that move is a no-op)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    first = pp == 1 or dist.get_rank() // (dist.get_world_size() // pp) == 0  # (megatron: PP is the outer axis)
    model, _ = oracle_gpt(
        tp, pp, seed=1234 + 10 * tp + pp, **COMMON, **settings, vocab_size=mc.padded_vocab(VOCAB, PADDED_BY, tp),
        max_sequence_length=64, parallel_output=False, pre_process=first if pp > 1 else True,
        post_process=(not first) if pp > 1 else True,
    )  # fmt: skip
    assert ps.is_pipeline_first_stage() == first
    return model


def _forward(model: torch.nn.Module) -> torch.Tensor | None:
    """Logits on the last stage (None elsewhere), hidden states sent stage to stage."""
    from megatron.core import parallel_state as ps

    from megatron_oracle import oracle_logits

    ids = tokens()
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(SEQ, BATCH, COMMON["hidden_size"])
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = oracle_logits(model, ids)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out[..., :VOCAB].clone()


def _boxes(model: torch.nn.Module) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """megatron's own sharded description of this rank's weights: (key, global shape, offset, data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for value in model.sharded_state_dict().values():
        built = value.build() if isinstance(value, ShardedTensorFactory) else value
        for sh in built if isinstance(built, list) else [built]:
            if isinstance(sh, ShardedTensor):
                out.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.data.detach().clone()))
    return out


def _adam(model: torch.nn.Module) -> tuple[dict, dict]:
    """An fp32 Adam over megatron-core's own parameter groups, one step taken (the weights put back,
    so that every file holds the same weights): its state_dict (what Megatron-LM's legacy file holds
    for a non-distributed fp32 optimizer) and megatron-core's sharded description of it (torch_dist)."""
    import copy

    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([model], OptimizerConfig(lr=1e-3, weight_decay=0.1), None)
    adam = torch.optim.Adam(groups, lr=1e-3)
    params = [p for group in adam.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 0.01) * (1 + torch.arange(p.numel()).reshape(p.shape) % 3)
    adam.step()
    with torch.no_grad():
        for p, old in zip(params, before):
            p.copy_(old)
    raw = copy.deepcopy(adam.state_dict())
    sharded = adam.state_dict()
    id_map = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
    optim_state_to_sharding_state(sharded, id_map, exclude_keys=("step",))
    sharded["state"]["common_step"] = raw["state"][0]["step"]  # (as megatron-core's sharded_state_dict keeps it)
    return raw, sharded


def _oracle_ranks(root: str, written: dict[str, str]) -> dict[str, Any]:
    """Every layout on 4 ranks: save both formats, forward; load paratron-written legacy files."""
    import multiprocessing

    import megatron.core.fusions.fused_softmax  # noqa: F401  (its imports before the patches)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_oracle import cpu_megatron, destroy_oracle

    # megatron's torch_dist writer forks writer processes, which a daemonic test rank may not have
    multiprocessing.current_process()._config["daemon"] = False
    dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {}
    with cpu_megatron():
        for kind in KINDS:
            for tp, pp in LAYOUTS:
                model = _build(kind, tp, pp)
                name = f"{kind}-tp{tp}pp{pp}"
                logits = _forward(model)
                first_replica = ps.get_data_parallel_rank() == 0
                if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and first_replica:
                    results[f"logits/{name}"] = logits
                results[f"boxes/{name}/{rank}"] = _boxes(model) if first_replica else []
                raw_adam, sharded_adam = _adam(model)
                results[f"boxes/{name}-adam/{rank}"] = _adam_boxes(sharded_adam) if first_replica else []
                args = megatron_args(kind, tp, pp)
                legacy = Path(root) / f"{name}-torch"
                if first_replica:  # Megatron-LM's legacy save: one file per TP x PP rank
                    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
                    folder = legacy / "iter_0000010" / (f"mp_rank_{t:02d}_{p:03d}" if pp > 1 else f"mp_rank_{t:02d}")
                    folder.mkdir(parents=True)
                    content = {"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": model.state_dict(),
                               "optimizer": raw_adam}  # fmt: skip
                    torch.save(content, folder / "model_optim_rng.pt")
                if rank == 0:
                    (legacy / "latest_checkpointed_iteration.txt").write_text("10")
                distributed = Path(root) / f"{name}-torch_dist" / "iter_0000010"
                if rank == 0:
                    distributed.mkdir(parents=True)
                    (distributed.parent / "latest_checkpointed_iteration.txt").write_text("10")
                dist.barrier()
                model_sd = model.sharded_state_dict()
                state = {"model": model_sd, "args": args, "iteration": 10, "checkpoint_version": 3.0}
                state["optimizer"] = sharded_adam
                dist_checkpointing.save(state, str(distributed))
                if kind in written and (tp, pp) in ((1, 1), (2, 2)):  # paratron's legacy file, into megatron-core
                    fresh = _build(kind, tp, pp)
                    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
                    sub = f"mp_rank_{t:02d}_{p:03d}" if pp > 1 else f"mp_rank_{t:02d}"
                    path = Path(written[kind]) / f"tp{tp}pp{pp}" / "iter_0000005" / sub / "model_optim_rng.pt"
                    saved = mc.safe_load(path)
                    assert saved["checkpoint_version"] == 3.0 and saved["args"].tensor_model_parallel_size == tp
                    fresh.load_state_dict(saved["model"], strict=True)
                    back = _forward(fresh)
                    if back is not None and t == 0 and first_replica:
                        results[f"written/{name}"] = back
                destroy_oracle()
    dist.barrier()
    return results


MEGATRON_MODULES = (
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.mapping",
    "megatron.core.dist_checkpointing.optimizer",
    "megatron.core.fusions.fused_layer_norm",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer",
    "megatron.core.transformer.enums",
    "megatron.core.transformer.utils",
)
"""What the oracle's ranks use of megatron-core: imported once, before they are forked."""


def _oracle_ranks_forked_here(root: str, written: dict[str, str]) -> list[dict[str, Any]]:
    """`_oracle_ranks` on 4 ranks forked from this one after it imported megatron-core (seconds of CPU
    that each rank would otherwise spend again; the server's ranks start without it)."""
    import importlib
    import multiprocessing

    import torch.multiprocessing as mp

    from paratron.distributed import local_ranks

    for module in MEGATRON_MODULES:
        importlib.import_module(module)
    multiprocessing.current_process()._config["daemon"] = False  # (a daemonic process may not start processes)
    local_ranks.rank_context = lambda: mp.get_context("fork")  # (in this process only, which ends after the call)
    return local_ranks.run_ranks(_oracle_ranks, 4, root, written, timeout=240)


def _adam_boxes(state: dict) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for per_param in state["state"].values():
        if not isinstance(per_param, dict):
            continue  # (common_step)
        for value in per_param.values():
            built = value.build() if isinstance(value, ShardedTensorFactory) else value
            for sh in built if isinstance(built, list) else [built]:
                if isinstance(sh, ShardedTensor):
                    out.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.data.detach().clone()))
    return out


def _assemble(boxes: list[tuple[str, tuple, tuple, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors from megatron's boxes (its layer-stacked keys unstacked), independent of paratron's merging."""
    whole: dict[str, torch.Tensor] = {}
    for key, shape, offset, data in boxes:
        target = whole.setdefault(key, torch.full(shape, float("nan")))
        lead = len(shape) - data.dim()
        index = tuple(offset[:lead]) + tuple(slice(o, o + n) for o, n in zip(offset[lead:], data.shape))
        target[index] = data
    out = {}
    for key, tensor in whole.items():
        assert not tensor.isnan().any(), key
        out.update(mc.unstack({key: tensor}))
    return out


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("megatron")
    written = {}
    for kind in KINDS:  # paratron checkpoints, written to Megatron-LM's legacy format at TP1PP1 and TP2PP2
        source = _paratron_checkpoint(root / f"paratron-{kind}", kind)
        for tp, pp in ((1, 1), (2, 2)):
            paratron_to_megatron(source, root / f"written-{kind}" / f"tp{tp}pp{pp}", tp, pp)
        written[kind] = str(root / f"written-{kind}")
    start = time.perf_counter()
    results: dict[str, Any] = {}
    for part in run_ranks(_oracle_ranks_forked_here, 1, str(root), written, timeout=300)[0]:
        results.update(part)
    results["root"], results["seconds"] = root, time.perf_counter() - start
    return results


def _paratron_config(kind: str):
    args = vars(megatron_args(kind, 1, 1))
    return mc.config_of(args, kind)


def _paratron_checkpoint(folder: Path, kind: str) -> Path:
    config = _paratron_config(kind)
    model = build_model(config.model, "cpu", seed=3)
    with torch.no_grad():  # (non-trivial norms and biases)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1 + p)
    save_checkpoint(folder, CheckpointContent(5, 40, config, model))
    return folder


def _paratron_logits(folder: Path) -> torch.Tensor:
    model = model_from_checkpoint(read_checkpoint(folder))
    with torch.no_grad():
        return model(tokens())


@pytest.mark.spawns
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_checkpoint_converts_exactly(oracle, tmp_path, kind, layout, fmt):
    tp, pp = layout
    name = f"{kind}-tp{tp}pp{pp}"
    source = oracle["root"] / f"{name}-{fmt}"
    assert mc.detect_format(source) == fmt
    destination = tmp_path / "converted"
    folder = megatron_to_paratron(source, destination)
    info = read_checkpoint(destination)
    assert (info.iteration, info.consumed_samples, folder.name) == (10, 80, "iter_0000010")
    reference = mc.to_paratron(
        _assemble([b for r in range(4) for b in oracle[f"boxes/{name}/{r}"]]), info.config.model, "oracle"
    )
    model = model_from_checkpoint(info)
    converted = dict(model.named_parameters())
    assert set(converted) == set(reference)
    worst = max((converted[n].detach() - reference[n]).abs().max().item() for n in reference)
    assert worst == 0.0
    logits = _paratron_logits(destination)
    difference = (logits - oracle[f"logits/{name}"]).abs().max().item()
    assert difference < 1e-5, difference
    print(f"{name} {fmt}: weights max |diff| {worst:.1e}, logits max |diff| {difference:.2e}")


@pytest.mark.spawns
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=["tp1pp1", "tp2pp2"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_optimizer_state_converts(oracle, tmp_path, kind, layout, fmt):
    from safetensors.torch import load_file

    name = f"{kind}-tp{layout[0]}pp{layout[1]}"
    source = oracle["root"] / f"{name}-{fmt}"
    megatron_to_paratron(source, tmp_path / "converted")
    info = read_checkpoint(tmp_path / "converted")
    stored = load_file(str(info.path / "optimizer_tp000_pp000_dp000.safetensors"))
    boxes = [b for r in range(4) for b in oracle[f"boxes/{name}-adam/{r}"]]
    for state in ("exp_avg", "exp_avg_sq"):
        prefix = f"optimizer.state.{state}."
        expected = mc.to_paratron(
            _assemble([(k[len(prefix) :], *rest) for k, *rest in boxes if k.startswith(prefix)]), info.config.model, ""
        )
        assert set(expected) == {k.split("/", 1)[1] for k in stored if k.startswith(state + "/")}
        for param, tensor in expected.items():
            assert torch.equal(stored[f"{state}/{param}"], tensor), (state, param)
    assert json.loads((info.path / "optimizer.index.json").read_text())["step"] == 1.0
    finetuned = megatron_to_paratron(source, tmp_path / "weights-only", finetune=True)
    assert not list(finetuned.glob("optimizer*")) and read_checkpoint(finetuned).iteration == 0


@pytest.mark.spawns
@pytest.mark.parametrize("kind", list(KINDS))
def test_written_legacy_checkpoint_loads_into_megatron_core(oracle, kind):
    source = oracle["root"] / f"paratron-{kind}"
    expected = _paratron_logits(source)
    for tp, pp in ((1, 1), (2, 2)):
        difference = (oracle[f"written/{kind}-tp{tp}pp{pp}"] - expected).abs().max().item()
        assert difference < 1e-5, (tp, pp, difference)


@pytest.mark.spawns
@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_through_megatron_is_exact(oracle, tmp_path, kind):
    source = oracle["root"] / f"paratron-{kind}"
    back = tmp_path / "back"
    megatron_to_paratron(oracle["root"] / f"written-{kind}" / "tp2pp2", back)
    original, returned = read_checkpoint(source), read_checkpoint(back)
    a = dict(model_from_checkpoint(original).named_parameters())
    b = dict(model_from_checkpoint(returned).named_parameters())
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert (returned.iteration, returned.consumed_samples) == (5, 40)
    assert returned.config.model == original.config.model


@pytest.mark.spawns
def test_train_loads_a_megatron_checkpoint(oracle, tmp_path):
    from paratron.checkpoint.load import read_weight
    from paratron.training.preflight import check_inputs
    from paratron.training.run import run_training

    from tiny import tiny_config

    source = oracle["root"] / "llama-tp2pp1-torch_dist"
    model = dict(mc.model_settings(vars(megatron_args("llama", 2, 1))))
    config = tiny_config(
        tmp_path / "run", **model, train_iters=11, micro_batch_size=2, global_batch_size=2, seq_length=SEQ,
        load=str(source), save=str(tmp_path / "save"), mock_data=True, data_cache_path=str(tmp_path / "cache"),
        lr=0.0, min_lr=0.0,
    )  # fmt: skip
    check_inputs(config)
    state = run_training(config)
    assert state.iteration == 11 and state.consumed_samples == 82  # (Megatron's step 10 and 80 samples go on)
    saved = read_checkpoint(tmp_path / "save")
    converted = read_checkpoint(next((tmp_path / "cache" / "checkpoints").iterdir()))
    assert (tmp_path / "cache" / "checkpoints").is_dir() and saved.iteration == 11
    for name in ("embedding.weight", "layers.3.attention.in_proj.k.weight"):  # (lr 0: the weights it started from)
        assert torch.equal(read_weight(saved, name), read_weight(converted, name))


def test_bad_inputs_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        mc.open_megatron(empty)
    folder = tmp_path / "ckpt" / "iter_0000003"
    (folder / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")

    class Sneaky:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"args": argparse.Namespace(num_layers=2), "model": {}, "evil": Sneaky()}, folder / "mp_rank_00" / "x")
    (folder / "mp_rank_00" / "x").rename(folder / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match=r"holds the class posix\.getcwd, which paratron does not unpickle") as e:
        mc.open_megatron(tmp_path / "ckpt")
    assert "\n" not in str(e.value)
    args = vars(megatron_args("gpt", 2, 1))
    torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": 3, "model": {}},
               folder / "mp_rank_00" / "model_optim_rng.pt")  # fmt: skip
    with pytest.raises(CheckpointError, match=r"mp_rank_01/model_optim_rng.pt: missing"):
        megatron_to_paratron(tmp_path / "ckpt", tmp_path / "out")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="iter_0000007: missing"):
        mc.detect_format(tmp_path / "ckpt")
    assert pickle.dumps(0)  # (pickle itself untouched)


@pytest.mark.spawns
def test_cli_converts_both_ways(oracle, tmp_path, capsys):
    import transformers

    from paratron.cli import main

    source = oracle["root"] / "llama-tp2pp2-torch"
    assert main(["convert", "--from", "megatron", str(source), "--to", "hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        difference = (hf(tokens()).logits - oracle["logits/llama-tp2pp2"]).abs().max().item()
    assert difference < 1e-5, difference
    out = str(tmp_path / "megatron")
    assert main(["convert", "--from", "paratron", str(oracle["root"] / "paratron-gpt"), "--to", "megatron", out,
                 "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]) == 0  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "megatron" / "iter_0000005").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
    ]  # fmt: skip
    assert mc.detect_format(tmp_path / "megatron") == "torch"
    bad = ["convert", "--from", "paratron", str(oracle["root"] / "paratron-gpt"), "--to", "megatron"]
    assert main([*bad, str(tmp_path / "m3"), "--target-tensor-parallel-size", "3"]) == 2
    assert "--target-tensor-parallel-size 3 must divide" in capsys.readouterr().err


def _rewrite(source: Path, destination: Path, change) -> None:
    """A copy of legacy checkpoint `source` whose rank files `change(rank folder name, content)` rewrites."""
    for file in source.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        content = torch.load(file, weights_only=False)  # (the test's own file, args with megatron's real enums)
        target = destination / file.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(change(file.parent.name, content), target)
    (destination / "latest_checkpointed_iteration.txt").write_text("10")


@pytest.mark.spawns
def test_transformer_engine_names_and_virtual_stages_read_the_same(oracle, tmp_path):
    import io

    plain = dict(model_from_checkpoint(read_checkpoint(megatron_to_paratron(
        oracle["root"] / "llama-tp2pp2-torch", tmp_path / "plain"))).named_parameters())  # fmt: skip

    def engine(_: str, content: dict) -> dict:  # Transformer Engine's fused norms and BytesIO extra state
        renamed = {}
        for name, value in content["model"].items():
            name = name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            name = name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            renamed[name] = io.BytesIO(b"te") if name.endswith("_extra_state") else value
        return {**content, "model": renamed}

    _rewrite(oracle["root"] / "llama-tp2pp2-torch", tmp_path / "engine", engine)
    fused = dict(model_from_checkpoint(read_checkpoint(megatron_to_paratron(
        tmp_path / "engine", tmp_path / "fused"))).named_parameters())  # fmt: skip
    assert all(torch.equal(plain[n], fused[n]) for n in plain)

    def virtual(_: str, content: dict) -> dict:  # PP 2 x virtual 2: stage s, chunk v holds layer 2v + s
        model, chunks = content["model"], [{}, {}]
        for name, value in model.items():
            found = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            if found:
                local = int(found.group(1))  # (this stage's layers 2s and 2s + 1 become layers s and 2 + s)
                chunks[local][f"decoder.layers.0.{found.group(2)}"] = value
            elif name.startswith("embedding."):
                chunks[0][name] = value
            else:
                chunks[1][name] = value
        args = argparse.Namespace(**{**vars(content["args"]), "virtual_pipeline_model_parallel_size": 2})
        kept = {k: v for k, v in content.items() if k not in ("model", "optimizer")}
        return {**kept, "args": args, "model0": chunks[0],
                "model1": chunks[1]}  # fmt: skip

    _rewrite(oracle["root"] / "llama-tp2pp2-torch", tmp_path / "virtual", virtual)
    interleaved = dict(model_from_checkpoint(read_checkpoint(megatron_to_paratron(
        tmp_path / "virtual", tmp_path / "from-virtual"))).named_parameters())  # fmt: skip
    order = {0: 0, 1: 2, 2: 1, 3: 3}  # (global layer of the plain file -> its place under virtual stages)
    for name, tensor in plain.items():
        found = re.match(r"layers\.(\d+)\.(.*)", name)
        other = f"layers.{order[int(found.group(1))]}.{found.group(2)}" if found else name
        assert torch.equal(interleaved[other], tensor), name


def test_what_megatron_pickles_beside_tensors_is_allowed(tmp_path):
    import random
    import signal

    import numpy as np

    folder = tmp_path / "iter_0000002" / "mp_rank_00"
    folder.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    args = argparse.Namespace(**vars(megatron_args("gpt", 1, 1)), exit_signal=signal.SIGTERM, save=Path("/ckpt"))
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]  # fmt: skip
    content = {"args": args, "iteration": 2, "checkpoint_version": 3.0, "model": {}, "rng_state": rng}
    torch.save(content, folder / "model_optim_rng.pt")
    opened = mc.open_megatron(tmp_path)
    assert (opened.iteration, opened.consumed_samples, opened.args["save"]) == (2, 80, Path("/ckpt"))
    assert isinstance(opened.common["rng_state"][0]["np_rng_state"][1], np.ndarray)


def test_cli_convert_errors_are_one_line(tmp_path, capsys):
    from paratron.cli import main

    missing = tmp_path / "nothing"
    assert main(["convert", "--from", "megatron", str(missing), "--to", "paratron", str(tmp_path / "o")]) == 2
    (tmp_path / "empty").mkdir()
    assert (
        main(["convert", "--from", "megatron", str(tmp_path / "empty"), "--to", "paratron", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "latest_checkpointed_iteration.txt" in err[1]


def test_paratron_config_from_megatron_args():
    m = _paratron_config("llama").model
    assert (m.num_query_groups, m.activation, m.untie_embeddings_and_output_weights, m.vocab_size) == (
        2, "swiglu", True, VOCAB,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="mixture of experts"):
        mc.model_settings({**vars(megatron_args("gpt", 1, 1)), "num_experts": 8})
    assert build_config(dict(mc.model_settings(vars(megatron_args("gpt", 1, 1))), mock_data=True))
