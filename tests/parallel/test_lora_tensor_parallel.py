"""LoRA adapters under tensor and sequence parallelism on 2 gloo ranks, against the single-device
model: initial weights, logits, loss and every adapter gradient (after the partial-gradient
sums); frozen weights get no gradient; adapters add no collective to forward and backward."""

from __future__ import annotations

import torch

from paratron.distributed.local_ranks import run_ranks

WORLD = 2
RANK, ALPHA, TARGETS = 4, 8.0, "qkv,proj,fc1,fc2"
GPT_FLAVOUR = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=97,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=4,
)
LLAMA_GQA_FLAVOUR = dict(
    GPT_FLAVOUR,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    num_query_groups=1,  # one key/value head, replicated on both tensor-parallel ranks
    add_bias_linear=False,
    ffn_hidden_size=96,
    untie_embeddings_and_output_weights=True,
)
FLAVOURS = {"gpt": GPT_FLAVOUR, "llama-gqa": LLAMA_GQA_FLAVOUR}
TOLERANCE = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _models(settings: dict, sequence_parallel: bool, topology, adapters: bool):
    """The single-device reference and this rank's tensor-parallel model, from the same seed."""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.model.gpt import GPT
    from paratron.model.lora import add_adapters
    from paratron.parallel.parallelize import materialize, parallelize

    config = build_config(
        dict(
            settings,
            tensor_model_parallel_size=WORLD,
            mock_data=True,
            seq_length=16,
            sequence_parallel=sequence_parallel,
            seed=11,
        )
    )
    with torch.device("meta"):
        reference, meta = GPT(config.model), GPT(config.model)
    if adapters:
        add_adapters(reference, RANK, ALPHA, TARGETS)
        add_adapters(meta, RANK, ALPHA, TARGETS)
    materialize(reference, "cpu", 11)
    return reference, parallelize(
        meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
    )


def _randomize_adapters(reference: torch.nn.Module, parallel: dict[str, torch.nn.Parameter]) -> None:
    """Random adapters (B starts at zero, which hides mistakes): the whole tensors in the
    reference, each rank's slice in its model."""
    from paratron.model.lora import is_adapter
    from paratron.parallel.sharding import take_slice

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
                parallel[name].copy_(take_slice(param, parallel[name]))


def _step(model, inputs: torch.Tensor, labels: torch.Tensor):
    """Forward, loss and backward of a `ParallelModel` (gradient sums left out)."""
    logits = model(inputs)
    loss = model.loss_function(logits, labels)
    loss.backward()
    return logits, loss


def lora_parity() -> dict:
    """Every flavour with and without sequence parallelism; returns the worst relative error of
    each and the collectives counted with and without adapters."""
    from paratron.distributed import comm
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import Axis, ParallelDims, Topology
    from paratron.model.lora import is_adapter
    from paratron.parallel.sharding import gather_full

    ctx = initialize("gloo")
    topology = Topology(ParallelDims(WORLD, tp=WORLD), ctx.rank)
    topology.create_groups()
    group = topology.group(Axis.TP)
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(5))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    report: dict = {}
    for flavour, settings in FLAVOURS.items():
        for sequence_parallel in (False, True):
            key = f"{flavour}{'-sp' if sequence_parallel else ''}"
            reference, model = _models(settings, sequence_parallel, topology, adapters=True)
            names = dict(model.module.named_parameters())
            for name, param in reference.named_parameters():
                assert torch.equal(gather_full(names[name], group), param), f"{key}: init of {name}"
                assert names[name].requires_grad == is_adapter(name), f"{key}: {name} trains or is frozen wrongly"
            _randomize_adapters(reference, names)

            ref_logits = reference(inputs)
            ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
            ref_loss.backward()
            with comm.count_collectives() as counts:
                logits, loss = _step(model, inputs, labels)
            model.finish_grad_sync()

            full_logits = comm.all_gather(logits.detach(), 2, group)[..., :97]
            errors = {"logits": _rel(full_logits, ref_logits), "loss": _rel(loss, ref_loss)}
            for name, param in reference.named_parameters():
                if not is_adapter(name):
                    assert param.grad is None and names[name].grad is None, f"{key}: frozen {name} got a gradient"
                    continue
                grad = gather_full(names[name], group, names[name].grad)
                assert param.grad.abs().max() > 0, f"{key}: {name} has a zero reference gradient"
                errors[f"grad {name}"] = _rel(grad, param.grad)
            for what, error in errors.items():
                assert error < TOLERANCE, f"{key}: {what} differs by {error:.2e} relative"

            _, plain = _models(settings, sequence_parallel, topology, adapters=False)
            with comm.count_collectives() as plain_counts:
                _step(plain, inputs, labels)
            for kind, count in counts.items():
                assert count <= plain_counts[kind], f"{key}: {count} {kind} with adapters, {plain_counts[kind]} without"
            report[key] = {"worst": max(errors.values()), "collectives": dict(counts), "plain": dict(plain_counts)}
    torch.distributed.destroy_process_group()
    return report


def test_adapters_under_tensor_parallelism_equal_the_single_device_model():
    reports = run_ranks(lora_parity, WORLD)
    assert set(reports[0]) == {"gpt", "gpt-sp", "llama-gqa", "llama-gqa-sp"}
    assert all(r["worst"] < TOLERANCE for r in reports[0].values())
