"""Activation recomputation changes nothing but memory: with dropout on, every mode gives the
same loss and gradients as keeping the activations, on one process and under tensor and
sequence parallelism (where the tensor-parallel dropout streams must replay too)."""

from __future__ import annotations

import dataclasses

import torch

from paratron.distributed.local_ranks import run_ranks

MODEL = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=97,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=4,
    hidden_dropout=0.2,
    attention_dropout=0.2,
)
MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform"),
    "full-uniform-3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


def one_step_per_mode(world: int) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Loss and gradients of one training step in every mode, from the same weights and seed."""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize

    ctx = initialize("gloo")
    topology = Topology(ParallelDims(world, tp=world), ctx.rank)
    topology.create_groups()
    ids = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode, settings in MODES.items():
        config = build_config(
            dict(
                MODEL,
                **settings,
                tensor_model_parallel_size=world,
                sequence_parallel=world > 1,
                mock_data=True,
                seq_length=16,
                seed=5,
            )
        )
        with torch.device("meta"):
            meta = GPT(dataclasses.replace(config.model))
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        torch.manual_seed(99)  # the default generator's dropout draws start alike in every mode
        loss = model.loss_function(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        model.finish_grad_sync()
        out[mode] = (float(loss), {n: p.grad.clone() for n, p in model.module.named_parameters()})
    return out


def _assert_modes_agree(results: dict) -> None:
    loss, grads = results["none"]
    for mode, (other_loss, other_grads) in results.items():
        assert other_loss == loss, f"{mode}: loss {other_loss} vs {loss}"
        for name, grad in grads.items():
            assert torch.equal(other_grads[name], grad), f"{mode}: gradient of {name} differs"


def test_recomputation_gives_identical_gradients_on_one_process():
    _assert_modes_agree(one_step_per_mode(1))  # (in this process: one rank needs no process group)


def test_recomputation_replays_tensor_parallel_dropout():
    for results in run_ranks(one_step_per_mode, 2, 2):
        _assert_modes_agree(results)
