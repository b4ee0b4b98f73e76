"""--grad-reduce-in-bf16: bf16 gradient buffers at every ZeRO stage, fp32 gradients for the optimizer's step, the
settings it is refused with, and the memory and communication the planner prices for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.cli import main
from paratron.config import build_config, validate
from paratron.config.layout import resolve_layout
from paratron.config.megatron import from_megatron_dict
from paratron.distributed.fake import fake_world
from paratron.distributed.topology import ParallelDims, Topology
from paratron.errors import ConfigError
from paratron.model.batch import Batch
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.parallel import parallelize
from paratron.parallel.data_parallel.state_memory import training_state_elements
from paratron.planning.activations import CPU
from paratron.planning.cost import predict_step
from paratron.planning.dry_run import dry_run, with_vocabulary
from paratron.planning.hardware import PRESETS
from paratron.planning.memory_prediction import predict_memory

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    max_position_embeddings=16,
    precision="bf16",
    mock_data=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _build(zero_stage: int, bf16_grads: bool):
    config = build_config(dict(TINY, zero_stage=zero_stage, grad_reduce_in_bf16=bf16_grads))
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    return model, build_optimizer(model, config.optimizer)


def _backward(model) -> None:
    """Two micro-batches, so that the gradients accumulate in their buffer before the step."""
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    model.forward_backward([Batch(b[:, :-1], b[:, 1:]) for b in (ids[:2], ids[2:])])


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_gradients_accumulate_in_bf16_and_the_optimizer_steps_fp32_copies(zero_stage):
    model, optimizer = _build(zero_stage, bf16_grads=True)
    (reducer,) = model.gradients.reducers
    assert reducer.grad_buffer is not None and reducer.grad_buffer.dtype == torch.bfloat16
    weight = model.module.layers[0].mlp.out_proj.weight
    assert weight.grad.data_ptr() == reducer.main_grad(weight).data_ptr()  # autograd adds into the bf16 buffer
    _backward(model)
    optimizer.prepare_grads()
    grads = optimizer.grads_for_norm().tensors
    assert grads and all(g.dtype == torch.float32 for g in grads)  # unscaling, norm and clipping run in fp32
    assert all(m.grad.dtype == torch.float32 and m.dtype == torch.float32 for m in optimizer.masters)
    before = [m.detach().clone() for m in optimizer.masters]
    optimizer.step()
    assert all(m.grad is None for m in optimizer.masters)  # the fp32 copies last from the reduction to the update
    assert any(not torch.equal(m, b) for m, b in zip(optimizer.masters, before))
    optimizer.after_step()
    state = training_state_elements(model, optimizer)  # the memory report's ledger
    n = sum(p.numel() for p in model.trained_parameters)
    assert state["gradients"]["bytes"] == 2 * n and state["master"]["bytes"] == 4 * n

    reference, reference_optimizer = _build(zero_stage, bf16_grads=False)
    _backward(reference)
    reference_optimizer.prepare_grads()
    # the same bf16 micro-batch gradients, summed in bf16 instead of fp32: one rounding to 8 significant bits,
    # at most 2^-8 of the largest element of each tensor (measured: 1e-3 to 3.7e-3 of it)
    errors = [(g - m.grad).abs().max() / m.grad.abs().max() for g, m in zip(grads, reference_optimizer.masters)]
    assert max(errors) <= 2**-8 and sum(errors) > 0, errors


def test_data_parallel_buffers_and_fsdp_reduce_in_bf16():
    """On a fake world of 2 ranks: ZeRO-2's persistent gradient shard and ZeRO-1's buffer are bf16, and FSDP2
    (ZeRO-3) reduce-scatters in bf16 while keeping fp32 gradient shards beside its fp32 weight shards."""
    for stage in (1, 2, 3):
        config = with_vocabulary(build_config(dict(TINY, zero_stage=stage, grad_reduce_in_bf16=True)))
        with fake_world(2, 0):
            topology = Topology(ParallelDims(2), 0)
            topology.create_groups()
            with torch.device("meta"):
                meta = GPT(config.model)
            model = parallelize(
                meta, config, topology, torch.device("meta"), resolve_layout(config, topology.dims.world_size)
            )
            if stage == 3:
                policies = {unit._get_fsdp_state()._mp_policy for unit in model.gradients.sharded_units}
                assert {(p.param_dtype, p.reduce_dtype) for p in policies} == {(torch.bfloat16, torch.bfloat16)}
                assert all(p.dtype == torch.float32 for p in model.trained_parameters)
            else:
                (reducer,) = model.gradients.reducers
                held = reducer.grad_buffer if stage == 1 else reducer.grad_shard
                assert reducer.mode == ("reduce-scatter" if stage == 1 else "reduce-scatter-shard")
                assert held.dtype == torch.bfloat16
            del model


def test_expert_gradients_are_bf16_too():
    """Under expert parallelism (EP 2 of DP 2, ZeRO-1) the experts' reducer keeps bf16 gradients as the dense one."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, expert_model_parallel_size=2)
    config = with_vocabulary(build_config(dict(TINY, **moe, zero_stage=1, grad_reduce_in_bf16=True)))
    with fake_world(2, 0):
        topology = Topology(ParallelDims(2, ep=2), 0)
        topology.create_groups()
        with torch.device("meta"):
            meta = GPT(config.model)
        model = parallelize(
            meta, config, topology, torch.device("meta"), resolve_layout(config, topology.dims.world_size)
        )
        dense, experts = model.gradients.reducer, model.gradients.expert_reducer
        assert experts is not None and experts.group.size == 1 and dense.group.size == 2
        assert dense.grad_buffer.dtype == experts.grad_buffer.dtype == torch.bfloat16
        del model


def test_refused_without_bf16_weights_and_read_from_megatron_names(capsys):
    for precision in ("fp32", "fp16"):
        config = build_config(dict(TINY, precision=precision, grad_reduce_in_bf16=True))
        with pytest.raises(ConfigError, match=rf"^--grad-reduce-in-bf16 .* this run is {precision} .* add --bf16"):
            validate(config, 1)
    validate(build_config(dict(TINY, grad_reduce_in_bf16=True)), 1)
    # the command line: exit 2 and one line, before anything is built (a dry run starts no workers)
    assert main(["train", "--model", "debug", "--mock-data", "--fp16", "--grad-reduce-in-bf16", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--grad-reduce-in-bf16 keeps gradients in bf16" in err and "Traceback" not in err
    assert main(["train", "--model", "debug", "--mock-data", "--bf16", "--grad-reduce-in-bf16", "--dry-run"]) == 0
    assert from_megatron_dict({"bf16": True, "grad_reduce_in_bf16": True}) == {
        "precision": "bf16",
        "grad_reduce_in_bf16": True,
    }


def test_the_planner_counts_two_bytes_per_gradient_as_the_dry_run_builds():
    """Predicted gradient bytes halve at ZeRO 0 and 2 (the persistent buffer and shard, ZeRO-2's buckets in flight),
    and equal what the dry run builds on the meta device; the rest of the state is untouched."""
    predicted = {}
    for stage in (0, 2):
        for bf16_grads in (False, True):
            config = with_vocabulary(build_config(dict(TINY, zero_stage=stage, grad_reduce_in_bf16=bf16_grads)))
            (fast,) = predict_memory(config, 2, CPU)
            predicted[stage, bf16_grads] = fast
            if bf16_grads:
                (built,) = dry_run(config, validate(config, 2), CPU)
                assert built.gradients == pytest.approx(fast.gradients, rel=2e-3)
                assert built.buffers == fast.buffers
    for stage in (0, 2):
        fp32, bf16 = predicted[stage, False], predicted[stage, True]
        assert bf16.gradients * 2 == fp32.gradients > 0
        assert dataclasses.replace(bf16, gradients=0, buffers=0) == dataclasses.replace(fp32, gradients=0, buffers=0)
    assert predicted[2, True].buffers < predicted[2, False].buffers  # the buckets in flight are bf16 too


def test_the_cost_model_prices_bf16_reductions_at_half_the_bytes():
    """Llama-3 8B on 64 H100s, DP 8: the gradient all-reduce after backward (ZeRO 0, no overlap; bandwidth-bound)
    takes about half the time with bf16 gradients; ZeRO-2's reduce-scatters behind each micro-batch's backward,
    halved, leave less of themselves exposed still; compute and the optimizer do not move."""
    for stage in (0, 2):
        steps = {}
        for bf16_grads in (False, True):
            values = dict(model_name="llama3-8b", seq_length=4096, global_batch_size=64, micro_batch_size=1)
            config = build_config(
                dict(values, precision="bf16", tensor_model_parallel_size=8, zero_stage=stage, mock_data=True)
                | dict(grad_reduce_in_bf16=bf16_grads)
            )
            steps[bf16_grads] = predict_step(config, resolve_layout(config, 64), PRESETS["h100-80g"])
        fp32, bf16 = steps[False], steps[True]
        assert (0.45 if stage == 0 else 0) < bf16.data_parallel / fp32.data_parallel < 0.55, stage
        assert bf16.compute == fp32.compute and bf16.optimizer == fp32.optimizer
