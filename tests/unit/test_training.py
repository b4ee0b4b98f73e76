"""Single-process training: the loss falls, runs are deterministic, resume continues exactly, outputs exist."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from paratron.checkpoint import load_pretrained, read_checkpoint
from paratron.config.layout import resolve_layout
from paratron.distributed.topology import ParallelDims, Topology
from paratron.errors import CheckpointError
from paratron.model import GPT
from paratron.model.batch import Batch
from paratron.optim.build import build_optimizer, clip_grad_norm
from paratron.optim.mixed_precision import Precision
from paratron.parallel import parallelize
from paratron.training.run import run_training
from paratron.training.step import train_step

from tiny import tiny_config


def one_process_model(config):
    """`parallelize` on a single process: the model, its gradient buffer and its step."""
    with torch.device("meta"):
        meta = GPT(config.model)
    return parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))


def test_loss_falls_by_a_margin(tmp_path):
    state = run_training(tiny_config(tmp_path, train_iters=100))
    first, last = state.losses[0], state.losses[-1]
    assert first == pytest.approx(math.log(512), abs=0.15)  # untrained: uniform over the vocabulary
    assert last < first - 2.0, f"loss fell only from {first:.3f} to {last:.3f}"


def test_same_seed_same_losses_different_seed_different(tmp_path):
    a = run_training(tiny_config(tmp_path / "a", train_iters=8, hidden_dropout=0.1)).losses
    b = run_training(tiny_config(tmp_path / "b", train_iters=8, hidden_dropout=0.1)).losses
    c = run_training(tiny_config(tmp_path / "c", train_iters=8, hidden_dropout=0.1, seed=99)).losses
    assert a == b
    assert a != c


def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path):
    big = run_training(tiny_config(tmp_path / "big", train_iters=6, micro_batch_size=8, global_batch_size=8)).losses
    acc = run_training(tiny_config(tmp_path / "acc", train_iters=6, micro_batch_size=2, global_batch_size=8)).losses
    assert acc == pytest.approx(big, rel=1e-5)


def text_corpus(path):
    path.mkdir()
    for i in range(30):
        (path / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" * 20)
    return dict(mock_data=False, data_path=[str(path)], vocab_size=300, eval_iters=0)


@pytest.mark.parametrize("precision, data", [("fp32", "mock"), ("fp16", "mock"), ("fp32", "text"), ("fp32", "moe")])
def test_resume_continues_exactly(tmp_path, precision, data):
    common = dict(hidden_dropout=0.1, precision=precision)
    if data == "text":  # Megatron-ordered samples from a preprocessed corpus
        common.update(text_corpus(tmp_path / "corpus"))
    if data == "moe":  # experts whose routing biases move every step and are checkpointed
        common.update(num_experts=4, moe_aux_loss_coeff=1e-2, moe_router_enable_expert_bias=True)
        common.update(moe_router_bias_update_rate=0.05)
    straight = run_training(tiny_config(tmp_path / "straight", train_iters=12, **common)).losses
    save, run = tmp_path / "ckpt", tmp_path / "run"
    first = run_training(
        tiny_config(run, train_iters=8, lr_decay_iters=12, save=str(save), save_interval=6, **common)
    ).losses
    # as if the job died after step 8 but before saving it: resume from the step-6 checkpoint
    shutil.rmtree(save / "iter_0000008")
    (save / "latest_checkpointed_iteration.txt").write_text("6\n")
    second = run_training(tiny_config(run, train_iters=12, load=str(save), save=str(save), **common)).losses
    assert first[:6] + second == straight
    assert read_checkpoint(save).iteration == 12
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 13))  # steps 7 and 8 of the dead run were dropped, not repeated


def test_run_outputs_metrics_plot_tensorboard_and_checkpoint(tmp_path):
    config = tiny_config(
        tmp_path / "run",
        train_iters=10,
        log_interval=5,
        eval_iters=2,
        eval_interval=5,
        tensorboard=True,
        save=str(tmp_path / "ckpt"),
    )
    run_training(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mem_gb"):
        assert all(isinstance(r[key], float) and r[key] >= 0 for r in records), key
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [5, 10]
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    model = load_pretrained(tmp_path / "ckpt")
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)


def test_moe_run_logs_each_layer_and_expert_to_tensorboard(tmp_path):
    config = tiny_config(tmp_path, model_name="debug-moe", train_iters=2, tensorboard=True, moe_aux_loss_coeff=1e-2)
    run_training(config)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    events = EventAccumulator(str(next((tmp_path / "tensorboard").glob("events.out.tfevents.*"))))
    tags = set(events.Reload().Tags()["scalars"])
    assert {
        "train/loss",
        "train/moe_aux_loss",
        "train/moe_layer_load_balance/1",
        "train/moe_tokens_per_expert/1/3",
    } <= tags
    logged = events.Scalars("train/moe_tokens_per_expert/1/3")[-1].value
    assert logged == record["moe_tokens_per_expert"][1][3]


def test_corrupted_checkpoint_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    run_training(tiny_config(tmp_path / "run", train_iters=2, save=str(save)))
    weights = save / "iter_0000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: checksum mismatch; the file is corrupted"):
        read_checkpoint(save)


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    run_training(tiny_config(tmp_path / "run", train_iters=1, save=str(save)))
    with pytest.raises(CheckpointError, match=r"embedding.weight has shape \[512, 64\] there but \[512, 96\]"):
        run_training(tiny_config(tmp_path / "run2", train_iters=2, load=str(save), hidden_size=96))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_close_to_fp32(tmp_path, precision):
    fp32 = run_training(tiny_config(tmp_path / "fp32", train_iters=4)).losses
    low = run_training(tiny_config(tmp_path / precision, train_iters=4, precision=precision)).losses
    assert all(math.isfinite(x) for x in low)
    assert low == pytest.approx(fp32, rel=0.02)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_optimizers_fit_one_batch(tmp_path, name):
    config = tiny_config(
        tmp_path, vocab_size=512, optimizer=name, lr=0.5 if name == "sgd" else 0.01, clip_grad=0.0, seed=0
    )
    model = one_process_model(config)
    optimizer = build_optimizer(model, config.optimizer)
    assert type(optimizer.optimizer).__name__ == {"adam": "AdamW", "sgd": "SGD"}[name]
    batch = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(0))
    batches = [Batch(batch[:, :-1], batch[:, 1:])]
    losses = [train_step(model, optimizer, batches, Precision("fp32"), 0.0).loss.item() for _ in range(25)]
    assert losses[-1] < losses[0] - 1.0, losses


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    expected = torch.sqrt(sum((p.grad**2).sum() for p in params))
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm([p.grad for p in params], max_norm=1.0)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    clipped = torch.sqrt(sum((p.grad**2).sum() for p in params))
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(params[0].grad, before[0] / expected, rtol=1e-5, atol=1e-6)


def test_gradient_views_survive_model_zero_grad_and_detaching_them_is_caught():
    model = one_process_model(tiny_config(".", vocab_size=512, seed=0))
    model(torch.randint(0, 512, (2, 8))).sum().backward()
    model.zero_grad()
    assert model.gradients.reducer.grad_buffer.abs().sum() == 0 and model.module.embedding.weight.grad is not None
    model.finish_grad_sync()
    optimizer = build_optimizer(model, tiny_config(".").optimizer)
    optimizer.zero_grad()  # sets .grad to None: the views are gone
    with pytest.raises(RuntimeError, match="gradients were detached from the gradient buffer"):
        model.finish_grad_sync()
