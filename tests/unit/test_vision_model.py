"""The vision encoder's settings, refusals and model pieces, in process: named encoders and their derived shape,
one-line refusals (by the command line's exit code 2), features in their placeholders' places, freezing, and the
blank image that keeps the encoder's gradients coming when a micro-batch has no image."""

from __future__ import annotations

import pytest
import torch

from paratron.cli import main
from paratron.config import build_config
from paratron.config.loading import SavedModel, resolve_settings, settings_of
from paratron.config.schema import ModelConfig
from paratron.config.validation import validate
from paratron.errors import ConfigError
from paratron.model.attention import Bidirectional, allowed
from paratron.model.gpt import build_model
from paratron.training.flops import training_flops_per_token, vision_flops_per_image

from tiny import training_records

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=101, hidden_dropout=0.0)


def test_a_named_encoder_gives_its_shape_and_its_tokens():
    clip = ModelConfig(vision_model="clip-vit-l-14-336", vocab_size=100)
    assert (clip.vision_num_layers, clip.vision_hidden_size, clip.vision_ffn_hidden_size) == (24, 1024, 4096)
    assert clip.image_tokens == 576 and clip.vision_run_layers == 23 and clip.vision_feature_select == "default"
    siglip = ModelConfig(vision_model="siglip-so400m-14-384")
    assert siglip.image_tokens == 729 and siglip.vision_norm_epsilon == 1e-6 and siglip.vision_pooling_head
    wider = ModelConfig(vision_model="debug-vit", vision_hidden_size=48)
    assert wider.vision_ffn_hidden_size == 192  # (4 x its own width, not the named encoder's MLP)
    assert ModelConfig(vision_model="debug-vit", vision_feature_select="full").image_tokens == 17
    assert ModelConfig(vision_model="debug-vit", vocab_size=100).placeholder_id == 99
    assert not ModelConfig().has_vision and ModelConfig().architecture()["img_h"] is None


@pytest.mark.parametrize(
    "settings, world, message",
    [
        (dict(vision_model="vit-huge"), 1, "--vision-model 'vit-huge': unknown; choose one of debug-vit"),
        (dict(vision_num_layers=2, vision_hidden_size=32), 1, "an encoder of one's own needs --img-h, --img-w"),
        (dict(vision_model="debug-vit", img_h=30), 1, "--img-h 30 x --img-w 32 is not whole patches"),
        (dict(vision_model="debug-vit", vision_feature_layer=5), 1, "--vision-feature-layer 5: the encoder has 2"),
        (dict(vision_model="debug-vit", seq_length=16), 1, "one image is 16 tokens, which leaves no room"),
        (dict(vision_model="debug-vit", context_parallel_size=2), 2, "--context-parallel-size 2 with a vision model"),
        (
            dict(vision_model="debug-vit", vision_num_attention_heads=2, tensor_model_parallel_size=4),
            4,
            "does not divide the encoder's --vision-num-attention-heads 2; use a tensor-parallel size of 1, 2",
        ),
    ],
)
def test_bad_vision_settings_are_one_line(settings, world, message):
    config = build_config({**TINY, "mock_data": True, "seq_length": 32, **settings}, recipe="debug")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate(config, world)


def test_megatron_spellings_and_a_bad_flag_from_the_command_line(capsys):
    config = build_config({"vision_model": "debug-vit", "freeze_vision_model": True}, recipe="debug")
    assert config.model.freeze_vision_model
    flags = ["--mock-data", "--vision-model", "debug-vit", "--freeze-ViT", "--img-h", "33", "--dry-run"]
    code = main(["train", "--config", "debug", *flags])
    out = capsys.readouterr()
    assert code == 2 and out.err.strip().count("\n") == 0 and "--img-h 33 x --img-w 32 is not whole patches" in out.err


def _model(**settings: object) -> torch.nn.Module:
    return build_model(ModelConfig(**TINY, vision_model="debug-vit", **settings))  # type: ignore[arg-type]


def test_features_take_the_places_of_their_placeholders_in_order():
    model = _model()
    ids = torch.randint(0, 100, (2, 40))
    ids[0, 2:18], ids[1, 20:36] = 100, 100  # (two images: row 0's first, then row 1's)
    images = torch.randn(2, 3, 32, 32)
    embeddings = model.embedding(ids)
    merged = model.vision(embeddings, ids, images)
    features = model.vision.features(images)
    assert torch.equal(merged[0, 2:18], features[0]) and torch.equal(merged[1, 20:36], features[1])
    assert torch.equal(merged[0, :2], embeddings[0, :2]) and torch.equal(merged[1, 36:], embeddings[1, 36:])
    with pytest.raises(ValueError, match="32 image placeholders for 1 images of 16 tokens"):
        model.vision(embeddings, ids, images[:1])


def test_a_batch_without_images_still_gives_the_encoder_a_gradient():
    model = _model()
    model(torch.randint(0, 100, (2, 24))).sum().backward()
    encoder = model.vision.encoder
    assert encoder.patch_embedding.weight.grad is not None and encoder.layers[0].mlp.out_proj.weight.grad is not None
    assert torch.count_nonzero(encoder.patch_embedding.weight.grad) == 0  # (counted zero times)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():  # (and without gradients nothing runs for it)
        assert torch.equal(model.vision(model.embedding(ids), ids, None), model.embedding(ids))


def test_freezing_and_the_layers_past_the_feature_layer():
    trained = {name for name, p in _model().named_parameters() if p.requires_grad}
    assert "vision.encoder.layers.0.mlp.out_proj.weight" in trained
    assert not any(name.startswith(("vision.encoder.layers.1.", "vision.encoder.post_norm")) for name in trained)
    frozen = _model(freeze_vision_model=True, freeze_language_model=True)
    projector_only = {name for name, p in frozen.named_parameters() if p.requires_grad}
    assert projector_only == {f"vision.projector.linear_{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")}
    lora = {name for name, p in _model(lora_rank=4).named_parameters() if p.requires_grad}
    assert {"vision.projector.linear_1.weight"} < lora and not any(n.startswith("vision.encoder") for n in lora)
    assert all("lora_" in n or n.startswith("vision.projector") for n in lora)


def test_encoder_attention_sees_the_whole_image_and_clip_uses_quick_gelu():
    assert allowed(Bidirectional(), torch.arange(5), torch.arange(5), None).all()
    mlp = _model().vision.encoder.layers[0].mlp
    x = torch.randn(3, 32)
    up = mlp.in_proj.up(x)
    assert torch.allclose(mlp(x), mlp.out_proj(up * torch.sigmoid(1.702 * up)))


def test_throughput_counts_the_encoders_flops(tmp_path):
    settings = dict(TINY, vision_model="debug-vit", mock_data=True, seq_length=40, train_iters=2, micro_batch_size=4)
    quiet = dict(progress_bar=False, tensorboard=False, log_interval=1, eval_iters=0, run_dir=str(tmp_path))
    records = training_records({**settings, **quiet})
    config = build_config(settings).model
    per_token, per_image = training_flops_per_token(config, 40), vision_flops_per_image(config)
    assert len(records) == 2 and per_image > 0
    for record in records:
        expected = per_token * record["tokens_per_s"] + per_image * record["images_per_s"]
        assert record["images_per_s"] > 0 and record["tflops_per_device"] * 1e12 == pytest.approx(expected, rel=1e-9)


def test_a_run_that_loads_a_checkpoint_freezes_what_its_own_flags_say():
    stage_one = ModelConfig(**TINY, vision_model="debug-vit", freeze_vision_model=True, freeze_language_model=True)
    saved = SavedModel("the checkpoint S1", settings_of(stage_one))
    stage_two = resolve_settings(
        {"freeze_vision_model": True, "load": "S1"}, read_checkpoint=lambda _: saved
    ).config.model
    assert stage_two.freeze_vision_model and not stage_two.freeze_language_model
    assert (
        stage_two.vision_model == "debug-vit" and stage_two.hidden_size == 32
    )  # (the model itself is the checkpoint's)
