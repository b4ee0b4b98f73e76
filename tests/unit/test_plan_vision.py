"""The planner and the dry run count a vision-language model's encoder and projector: their FLOPs per image against
the matmuls a tiny model runs, their activations against `--log-memory`'s meter, their training state on the first
pipeline stage against the model built on the meta device and the dry run, and their time in the step's cost."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from paratron.cli import main
from paratron.config import build_config, validate
from paratron.config.layout import resolve_layout
from paratron.model.gpt import GPT
from paratron.parallel.pipeline.stage import StageLayout, keep_stage
from paratron.parallel.recompute import apply_recompute
from paratron.planning.activations import CPU, CUDA, activation_peak, vision_bytes
from paratron.planning.candidates import balanced_ends, output_ratio, vision_ratio
from paratron.planning.cost import predict_step
from paratron.planning.dry_run import dry_run, with_vocabulary
from paratron.planning.hardware import PRESETS
from paratron.planning.memory_prediction import predict_memory
from paratron.training.flops import vision_flops_per_image
from paratron.training.memory_report import SavedActivations

TINY = dict(
    model_name=None,
    num_layers=4,
    hidden_size=48,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=96,
    make_vocab_size_divisible_by=4,
    max_position_embeddings=64,
    vision_model="debug-vit",
    mock_data=True,
    seq_length=40,
    micro_batch_size=2,
    global_batch_size=8,
)
"""A tiny language model behind debug-vit (32 x 32 images of 8 x 8 patches: 16 image tokens, 17 with CLIP's class
token; two encoder layers, one of which runs)."""

ENCODERS = {
    "clip": {},
    "frozen": dict(freeze_vision_model=True),
    "siglip affine": dict(vision_type="siglip", vision_projection="affine"),
    "every layer": dict(vision_feature_layer=-1),
    "lora": dict(lora_rank=4),
}


def tiny(**settings) -> object:
    return build_config({**TINY, **settings})


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name", list(ENCODERS))
def test_vision_flops_per_image_count_the_matmuls_a_training_step_runs(name):
    """Forward and backward of `features` on three images under FlopCounterMode (attention by its matmuls: the
    math kernel, which the counter sees)."""
    config = tiny(**ENCODERS[name]).model
    torch.manual_seed(0)
    model = GPT(config)
    images = torch.randn(3, 3, config.img_h, config.img_w)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model.vision.features(images).square().sum().backward()
    assert vision_flops_per_image(config) == pytest.approx(counter.get_total_flops() / 3, rel=1e-3)


def test_a_frozen_encoder_costs_its_forward_only_and_no_encoder_nothing():
    trained, frozen = (vision_flops_per_image(tiny(freeze_vision_model=f).model) for f in (False, True))
    assert frozen < trained / 2
    assert vision_flops_per_image(tiny(vision_model=None).model) == 0.0


# ---------------------------------------------------------------- activations


ACTIVATIONS = {
    "fp32": {},
    "bf16": dict(precision="bf16"),
    "frozen": dict(freeze_vision_model=True),
    "siglip affine": dict(vision_type="siglip", vision_projection="affine"),
    "two images per sample": dict(
        vision_feature_layer=-1, precision="bf16", micro_batch_size=4, plan_images_per_sample=2
    ),
    "full recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective recompute": dict(recompute_granularity="selective"),
    "block recompute": dict(
        vision_feature_layer=-1, recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_the_encoders_activations_are_what_the_meter_counts(name):
    """The image side of one micro-batch (its images in their placeholders' places) under `--log-memory`'s meter."""
    config = tiny(**ACTIVATIONS[name])
    m, t = config.model, config.training
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = GPT(m).to(dtype)
    if t.recompute_granularity:
        apply_recompute(model, t.recompute_granularity, t.recompute_method, t.recompute_num_layers, None)
    images = t.micro_batch_size * config.planning.plan_images_per_sample
    ids = torch.zeros(t.micro_batch_size, config.data.seq_length, dtype=torch.long)
    ids.view(-1)[: images * m.image_tokens] = m.placeholder_id
    embeddings = torch.randn(*ids.shape, m.hidden_size, dtype=dtype, requires_grad=True)
    with SavedActivations(model) as meter:
        model.vision(embeddings, ids, torch.randn(images, 3, m.img_h, m.img_w))
    assert vision_bytes(config, resolve_layout(config, 1), CPU) == meter.peak


def test_the_first_stage_keeps_the_encoders_activations_for_each_micro_batch_it_holds():
    config = with_vocabulary(tiny(pipeline_model_parallel_size=2))
    layout = validate(config, 2)
    text = with_vocabulary(tiny(pipeline_model_parallel_size=2, vision_model=None))
    held = 2  # (1F1B: the first of two stages holds two micro-batches at its peak)
    for kernels in (CPU, CUDA):
        extra = activation_peak(config, layout, 0, kernels) - activation_peak(text, layout, 0, kernels)
        assert extra == held * vision_bytes(config, layout, kernels) > 0
        assert activation_peak(config, layout, 1, kernels) == activation_peak(text, layout, 1, kernels)
    two = with_vocabulary(tiny(pipeline_model_parallel_size=2, plan_images_per_sample=2))
    assert activation_peak(two, layout, 0, CPU) > activation_peak(config, layout, 0, CPU)


# ---------------------------------------------------------------- training state


def _stage_elements(config, layout, rank: int) -> tuple[int, int, bool]:
    """(trained, frozen) elements pipeline rank `rank` holds of the model built on the meta device, and whether
    it holds the vision encoder."""
    plan = layout.pipeline
    with torch.device("meta"):
        model = GPT(config.model)
    stages = StageLayout(layout.pp, plan.chunks, rank, plan.ranges, v_shape=plan.schedule == "zb-v")
    kept = keep_stage(model, stages, embedding_group=None)
    params = {id(p): p for p in kept.parameters()}.values()
    trained = sum(p.numel() for p in params if p.requires_grad)
    return trained, sum(p.numel() for p in params) - trained, kept.vision is not None


STAGES = {
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2 uneven frozen": dict(
        pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1, freeze_vision_model=True
    ),
    "pp2 interleaved untied": dict(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        untie_embeddings_and_output_weights=True,
    ),
    "pp4 frozen language model": dict(pipeline_model_parallel_size=4, freeze_language_model=True),
}


@pytest.mark.parametrize("name", list(STAGES))
def test_the_predicted_state_per_stage_is_the_meta_models_parameters(name):
    """fp32 Adam without ZeRO: 4 bytes per parameter, 4 of gradient and 8 of moments per trained one, exactly."""
    config = with_vocabulary(tiny(**STAGES[name]))
    world = config.parallel.pipeline_model_parallel_size
    layout = validate(config, world)
    for role in predict_memory(config, world, CPU, layout):
        trained, frozen, encoder = _stage_elements(config, layout, role.stage)
        assert (role.parameters, role.gradients, role.master) == (4 * (trained + frozen), 4 * trained, 0), role
        assert role.optimizer_state == 8 * trained
        assert encoder == (role.stage == 0)


def _state_difference(settings: dict, world: int) -> list[int]:
    """Per stage, the dry run's training state with the encoder minus without it."""
    with_encoder = with_vocabulary(tiny(**settings))
    layout = validate(with_encoder, world)
    without = with_vocabulary(tiny(**settings, vision_model=None))
    a, b = dry_run(with_encoder, layout, CPU), dry_run(without, validate(without, world), CPU)
    return [x.state - y.state for x, y in zip(a, b)]


def test_the_dry_run_at_pp2_holds_the_encoder_on_the_first_stage_only():
    """fp32 Adam: 16 bytes per trained parameter of the encoder and projector, 4 per frozen one (the encoder's
    layers past the feature layer, its final norm)."""
    vision = GPT(tiny().model).vision
    trained = sum(p.numel() for p in vision.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in vision.parameters() if not p.requires_grad)
    assert frozen > 0
    assert _state_difference(dict(pipeline_model_parallel_size=2), 2) == [16 * trained + 4 * frozen, 0]


VISION_LAYOUTS = {
    "tp2 sp pp2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2)),
    "dp2 zero1 bf16 frozen": (2, dict(use_distributed_optimizer=True, precision="bf16", freeze_vision_model=True)),
    "zero3 dp2 full recompute": (
        2,
        dict(zero_stage=3, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ),
    "lora pp2 interleaved": (
        2,
        dict(lora_rank=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ),
}


@pytest.mark.parametrize("name", list(VISION_LAYOUTS))
def test_the_fast_prediction_equals_the_dry_run_for_vision_models(name):
    world, settings = VISION_LAYOUTS[name]
    config = with_vocabulary(tiny(**settings))
    layout = validate(config, world)
    for built, fast in zip(dry_run(config, layout, CUDA), predict_memory(config, world, CUDA, layout), strict=True):
        assert (fast.activations, fast.buffers) == (built.activations, built.buffers)
        for category in ("parameters", "gradients", "master", "optimizer_state"):
            assert getattr(fast, category) == pytest.approx(getattr(built, category), rel=2e-3), (name, category)


# ---------------------------------------------------------------- time


def _llava(**settings):
    """LLaVA-1.5's shapes (CLIP-L/14 at 336 px in front of Llama 3 8B) at TP8 x PP4 on 64 H100s."""
    return build_config(
        {
            "model_name": "llama3-8b",
            "vision_model": "clip-vit-l-14-336",
            "mock_data": True,
            "precision": "bf16",
            "seq_length": 4096,
            "micro_batch_size": 1,
            "global_batch_size": 64,
            "tensor_model_parallel_size": 8,
            "sequence_parallel": True,
            "pipeline_model_parallel_size": 4,
            **settings,
        }
    )


def _step(config) -> object:
    config = with_vocabulary(config)
    layout = validate(config, 64)
    return predict_step(config, layout, dataclasses.replace(PRESETS["h100-80g"], nodes=8))


def test_the_step_time_grows_with_the_encoder_on_the_first_stage():
    text, one, four = _step(_llava(vision_model=None)), _step(_llava()), _step(_llava(plan_images_per_sample=4))
    frozen = _step(_llava(freeze_vision_model=True))
    assert text.total < frozen.total < one.total < four.total
    for prediction in (one, four, frozen):  # (only the first stage runs the encoder)
        assert prediction.stages[0] > text.stages[0] and prediction.stages[1:] == text.stages[1:]
    backward = [prediction.stages[0][1] - text.stages[0][1] for prediction in (frozen, one)]
    assert 0 < backward[0] < 0.05 * backward[1]  # (a frozen encoder runs no backward; the projector still trains)
    # a CLIP-L image's forward: 23 of its 24 layers over 577 tokens, and the projector over 576
    extra_forward = one.stages[0][0] - text.stages[0][0]
    assert extra_forward > 23 * 2 * 577 * 12 * 1024**2 / 8 / PRESETS["h100-80g"].flops


def test_the_pipeline_split_moves_layers_off_a_first_stage_that_runs_the_encoder():
    one, eight = (with_vocabulary(_llava(plan_images_per_sample=n)) for n in (1, 8))
    assert vision_ratio(eight, 8, 1) == pytest.approx(8 * vision_ratio(one, 8, 1), rel=1e-6)
    frozen = with_vocabulary(_llava(freeze_vision_model=True))
    assert vision_ratio(frozen, 8, 1) == pytest.approx(vision_ratio(one, 8, 1) / 3)
    assert vision_ratio(with_vocabulary(_llava(vision_model=None)), 8, 1) == 0.0
    firsts = [
        balanced_ends(32, 4, round(output_ratio(c, 8, 1), 1), round(vision_ratio(c, 8, 1), 1))[0] for c in (one, eight)
    ]
    assert firsts[1] < firsts[0]
    # 32 layers on 4 stages, the encoder worth 3 layers: no stage does more than 9 layers' worth (even: 8 + 3)
    first, last = balanced_ends(32, 4, 0.0, 3.0)
    assert max(first + 3, (32 - first - last) / 2, last) == 9


def test_paratron_plan_takes_the_vision_model_and_images_per_sample(capsys):
    args = [
        "plan", "--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
        "--vocab-size", "96", "--max-position-embeddings", "64", "--vision-model", "debug-vit", "--seq-length", "40",
        "--global-batch-size", "8", "--hardware", "h100-80g", "--gpus-per-node", "2", "--nodes", "1",
        "--plan-images-per-sample", "2", "--freeze-vision-model", "--top", "2",
    ]  # fmt: skip
    run = subprocess.CompletedProcess(args, main(args), *capsys.readouterr())
    assert run.returncode == 0, run.stderr
    best = next(line for line in run.stdout.splitlines() if line.startswith("best: "))
    assert "--vision-model debug-vit --freeze-vision-model" in best
