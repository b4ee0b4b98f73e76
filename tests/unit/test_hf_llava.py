"""LLaVA (LlavaForConditionalGeneration) against transformers itself: tiny random models built locally (no download)
convert to paratron and back; paratron's logits equal transformers' on text with image placeholders and images; the
files written back are transformers' own; a released language model and a released vision encoder combine into one
model whose encoder gives transformers' features; what paratron cannot hold is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import transformers  # the reference; installed with the test extras
from safetensors.torch import load_file, save_file

from paratron.checkpoint import load_pretrained
from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.config import build_config
from paratron.errors import CheckpointError
from paratron.model.gpt import build_model

from tiny import save_random_hf_model

TOLERANCE = 1e-4
VOCAB, IMAGE_TOKEN = 97, 90
CLIP = dict(
    hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, image_size=16, patch_size=8
)
SIGLIP = dict(
    hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4
)
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # (grouped-query attention)
    max_position_embeddings=128,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
)
CASES = {
    # CLIP encoder (24 wide) + Llama (48 wide), LLaVA-1.5's feature layer and selection: 4 image tokens
    "clip-llama": (
        ("CLIPVisionConfig", CLIP),
        ("LlamaConfig", dict(TEXT, tie_word_embeddings=False)),
        dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    ),
    # SigLIP encoder with its pooling head + Qwen2 (tied), every feature of the last layer: 16 image tokens
    "siglip-qwen2": (
        ("SiglipVisionConfig", SIGLIP),
        ("Qwen2Config", dict(TEXT, tie_word_embeddings=True)),
        dict(vision_feature_layer=-1, vision_feature_select_strategy="full", multimodal_projector_bias=False),
    ),
}


def llava_config(case: str) -> transformers.LlavaConfig:
    (vision_class, vision), (text_class, text), top = CASES[case]
    return transformers.LlavaConfig(
        vision_config=getattr(transformers, vision_class)(**vision),
        text_config=getattr(transformers, text_class)(**text),
        image_token_id=IMAGE_TOKEN,
        **top,
    )


def image_tokens(config: transformers.LlavaConfig) -> int:
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    clip = vision.model_type == "clip_vision_model"
    return patches + int(clip) - int(config.vision_feature_select_strategy == "default")


def batch(tokens: int, image_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of Hugging Face's expanded form: two images, one image, none; and the three images' pixels."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, IMAGE_TOKEN, (n,), generator=g)  # noqa: E731
    image = torch.full((tokens,), IMAGE_TOKEN)
    rows = [
        torch.cat([text(3), image, text(2), image, text(4)]),
        torch.cat([text(5), image, text(tokens + 4)]),
        text(2 * tokens + 9),
    ]
    return torch.stack(rows), torch.randn(3, 3, image_size, image_size, generator=g)


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(case, folder, transformers' model) of a random LLaVA saved by transformers' save_pretrained."""
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    model = save_random_hf_model(transformers.LlavaForConditionalGeneration, llava_config(request.param), folder)
    return request.param, folder, model


def test_logits_equal_transformers(saved, tmp_path):
    case, folder, reference = saved
    ids, pixels = batch(image_tokens(reference.config), reference.config.vision_config.image_size)
    hf_to_paratron(folder, tmp_path / "paratron")
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels).logits
        direct = load_pretrained(folder)  # a Hugging Face directory loads as it is
        converted = load_pretrained(tmp_path / "paratron")
        assert (direct(ids, images=pixels) - expected).abs().max() < TOLERANCE
        assert (converted(ids, images=pixels) - expected).abs().max() < TOLERANCE
        other = reference(input_ids=ids, pixel_values=pixels.flip(0)).logits
    assert (other[:2] - expected[:2]).abs().max() > 100 * TOLERANCE  # (the images count)
    assert converted.config.image_token_id == IMAGE_TOKEN
    assert converted.config.untie_embeddings_and_output_weights == (case == "clip-llama")


def comparable(config: transformers.LlavaConfig) -> dict:
    """A LLaVA config's fields that describe the model (image_seq_length is the processor's: paratron writes the
    placeholders an image takes, transformers' default is LLaVA-1.5's 576)."""
    fields = config.to_dict()
    for name in ("image_seq_length", "transformers_version", "_name_or_path"):
        fields.pop(name, None)
    text = fields["text_config"]  # (spelled as paratron's text families write them, meaning the same)
    if text.get("head_dim") is None:  # (left out: hidden_size / num_attention_heads)
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    if not text.get("use_sliding_window", text.get("sliding_window") is not None):  # (no window: these unused)
        for name in ("sliding_window", "max_window_layers"):
            text.pop(name, None)
    return fields


def test_written_back_are_transformers_own_files(saved, tmp_path):
    case, folder, reference = saved
    hf_to_paratron(folder, tmp_path / "paratron")
    paratron_to_hf(tmp_path / "paratron", tmp_path / "back")
    ours, theirs = load_file(tmp_path / "back" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    back = transformers.LlavaConfig.from_pretrained(tmp_path / "back")
    assert comparable(back) == comparable(transformers.LlavaConfig.from_pretrained(folder))
    assert back.image_seq_length == image_tokens(reference.config)


def test_earlier_weight_layouts_read_the_same(saved, tmp_path):
    case, folder, reference = saved
    tensors = load_file(folder / "model.safetensors")
    released = {  # the released checkpoints' layout (llava-hf/llava-1.5-7b-hf)
        name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in tensors.items()
    }
    in_memory = {  # transformers' module names
        ("lm_head.weight" if n == "language_model.lm_head.weight" else "model." + n.replace(".model.", ".", 1)): t
        for n, t in tensors.items()
    }
    ids, pixels = batch(image_tokens(reference.config), reference.config.vision_config.image_size)
    with torch.no_grad():
        expected = load_pretrained(folder)(ids, images=pixels)
    for name, layout in (("released", released), ("in-memory", in_memory)):
        (tmp_path / name).mkdir()
        shutil.copy(folder / "config.json", tmp_path / name)
        save_file(layout, tmp_path / name / "model.safetensors", {"format": "pt"})
        with torch.no_grad():
            assert torch.equal(load_pretrained(tmp_path / name)(ids, images=pixels), expected)
    twice = {
        **tensors,
        "model.multi_modal_projector.linear_1.weight": tensors["multi_modal_projector.linear_1.weight"].clone(),
    }
    save_file(twice, tmp_path / "released" / "model.safetensors", {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds multi_modal_projector.linear_1.weight twice .*; keep one"):
        load_pretrained(tmp_path / "released")


def test_a_paratron_model_exports_as_transformers_computes_it(tmp_path):
    """The other way round: a paratron vision-language model (its own shape and init) to Hugging Face and back."""
    settings = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,  # (as Hugging Face's Llama)
        vision_model="debug-vit",
        image_token_id=IMAGE_TOKEN,
    )
    config = build_config(settings)
    model = build_model(config.model, "cpu", seed=3).eval()
    with torch.no_grad():
        for param in model.parameters():  # (norms and biases off 1 and 0, so that they count)
            param.add_(torch.randn_like(param) * 0.05)
    save_checkpoint(tmp_path / "ckpt", CheckpointContent(0, 0, config, model))
    paratron_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ids, pixels = batch(config.model.image_tokens, config.model.img_h)
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels).logits
        assert (model(ids, images=pixels) - expected).abs().max() < TOLERANCE
    hf_to_paratron(tmp_path / "hf", tmp_path / "again")
    again = read_checkpoint(tmp_path / "again")
    assert again.config.model == dataclasses.replace(config.model, vision_model=None)  # (the shape, not its name)
    round_trip = load_pretrained(tmp_path / "again")
    for (name, param), (_, back) in zip(model.named_parameters(), round_trip.named_parameters(), strict=True):
        assert torch.equal(param, back), name


@pytest.mark.parametrize(
    ("vision_class", "vision_model", "text", "layer", "select"),
    [
        ("CLIPVisionModel", "CLIPVisionConfig", "LlamaConfig", -2, None),  # (CLIP: the class token dropped)
        ("SiglipModel", "SiglipConfig", "Qwen2Config", 1, "full"),  # (a whole image-text model: its vision half)
    ],
)
def test_a_language_model_and_a_vision_encoder_combine(tmp_path, vision_class, vision_model, text, layer, select):
    text_config = getattr(transformers, text)(**TEXT)
    language = save_random_hf_model(transformers.AutoModelForCausalLM.from_config, text_config, tmp_path / "lm")
    vision_settings = CLIP if vision_class == "CLIPVisionModel" else dict(vision_config=SIGLIP, text_config=SMALL_TEXT)
    vision_config = getattr(transformers, vision_model)(**vision_settings)
    encoder = save_random_hf_model(getattr(transformers, vision_class), vision_config, tmp_path / "vit")
    flags = ["--vision-model-path", str(tmp_path / "vit"), "--vision-feature-layer", str(layer)]
    flags += ["--vision-feature-select", select] if select else []
    assert (
        main(["convert", "--from", "hf", str(tmp_path / "lm"), "--to", "paratron", str(tmp_path / "vl"), *flags]) == 0
    )
    combined = load_pretrained(tmp_path / "vl")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    tower = encoder if vision_class == "CLIPVisionModel" else encoder.vision_model
    with torch.no_grad():
        features = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[layer]
        features = features[:, 1:] if vision_class == "CLIPVisionModel" else features
        assert (combined.vision.encoder(pixels) - features).abs().max() < TOLERANCE
        ids = torch.randint(0, IMAGE_TOKEN, (2, 12), generator=torch.Generator().manual_seed(3))
        assert (combined(ids) - language(ids).logits).abs().max() < TOLERANCE  # (the language model's, unchanged)
    fresh = build_model(combined.config, "cpu", seed=read_checkpoint(tmp_path / "vl").config.training.seed)
    for name, param in combined.vision.projector.named_parameters():  # (paratron's own initialization)
        assert torch.equal(param, fresh.get_parameter(f"vision.projector.{name}")), name
    paratron_to_hf(tmp_path / "vl", tmp_path / "llava")  # and on to Hugging Face: transformers computes it
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava").eval()
    ids, images = batch(combined.config.image_tokens, 16)
    ids = ids.masked_fill(ids == IMAGE_TOKEN, combined.config.placeholder_id)
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=images).logits
        assert (combined(ids, images=images) - expected).abs().max() < TOLERANCE


SMALL_TEXT = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
"""The text half of a whole SigLIP model (left out of the combination)."""


# ---------------------------------------------------------------- refusals


def write_config(folder, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [
        ("llava_next", "LlavaNextForConditionalGeneration"),
        ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
        ("idefics2", "Idefics2ForConditionalGeneration"),
        ("mllama", "MllamaForConditionalGeneration"),
    ],
)
def test_other_vision_language_designs_are_refused_by_name(tmp_path, capsys, model_type, architecture):
    write_config(tmp_path / "hf", {"model_type": model_type, "architectures": [architecture], "vision_config": {}})
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), "--to", "paratron", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"model_type {model_type!r} ({architecture}) is a vision-language design" in err
    assert "LlavaForConditionalGeneration" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu' is not supported"),
        ({"vision_feature_layer": [-2, -5]}, r"vision_feature_layer \[-2, -5\] \(the features of several layers"),
        ({"vision_feature_layer": 9}, "vision_feature_layer 9 is not a layer of the 3-layer vision encoder"),
        ({"text_config": {"model_type": "gpt2"}}, "text_config's model_type 'gpt2' is not supported"),
        ({"vision_config": {"model_type": "siglip2_vision_model"}}, "'siglip2_vision_model' is not supported as a"),
        ({"vision_config": {"model_type": "clip_vision_model", "hidden_act": "gelu"}}, "hidden_act 'gelu' is not"),
        ({"image_token_index": VOCAB}, f"image_token_index {VOCAB} is not an id of the {VOCAB}-token vocabulary"),
    ],
)
def test_settings_paratron_cannot_hold_are_refused_by_name(tmp_path, change, expected):
    config = llava_config("clip-llama").to_dict()
    for name, value in change.items():
        config[name] = {**config[name], **value} if isinstance(value, dict) and name == "vision_config" else value
    write_config(tmp_path, config)
    with pytest.raises(CheckpointError, match=expected) as error:
        load_pretrained(tmp_path)
    assert "\n" not in str(error.value) and str(error.value).startswith(str(tmp_path / "config.json"))


def test_an_affine_projector_is_refused_on_export(tmp_path):
    config = build_config(
        dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
        | dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
        | dict(vision_model="debug-vit", vision_projection="affine")
    )
    save_checkpoint(tmp_path / "ckpt", CheckpointContent(0, 0, config, build_model(config.model, "cpu")))
    with pytest.raises(CheckpointError, match="--vision-projection affine has no equivalent in Hugging Face's Llava"):
        paratron_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_combining_refusals_are_one_line(tmp_path, capsys):
    language = transformers.LlamaConfig(**TEXT)
    save_random_hf_model(transformers.LlamaForCausalLM, language, tmp_path / "lm")
    save_random_hf_model(transformers.CLIPVisionModel, transformers.CLIPVisionConfig(**CLIP), tmp_path / "vit")
    convert = ["convert", "--from", "hf", str(tmp_path / "lm"), "--to", "paratron", str(tmp_path / "out")]
    cases = [
        (["--vision-model-path", str(tmp_path / "lm")], "model_type 'llama' is not a vision encoder paratron reads"),
        (["--vision-model-path", str(tmp_path / "vit"), "--vision-feature-layer", "7"], "--vision-feature-layer 7"),
        (["--vision-feature-layer", "-1"], "apply with --vision-model-path only"),
        (["--vision-model-path", str(tmp_path / "nowhere")], "nowhere: no such directory"),
    ]
    capsys.readouterr()  # (transformers' progress bars)
    for flags, expected in cases:
        assert main([*convert, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and expected in err, err
    to_hf = ["convert", "--from", "hf", str(tmp_path / "lm"), "--to", "hf", str(tmp_path / "out")]
    assert main([*to_hf, "--vision-model-path", str(tmp_path / "vit")]) == 2
    assert "--vision-model-path applies to --from hf SRC --to paratron DST only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("part", "field", "default"),
    [("text_config", "hidden_size", "hidden_size=4096"), ("vision_config", "image_size", "image_size=224")],
)
def test_a_nested_field_left_out_is_named_with_its_default(saved, tmp_path, part, field, default):
    case, folder, reference = saved
    config = json.loads((folder / "config.json").read_text())
    config[part] = {name: value for name, value in config[part].items() if name != field}
    write_config(tmp_path, config)
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_pretrained(tmp_path)
    message = str(error.value)
    assert "\n" not in message and f"has no {part}.{field}, and with transformers' default for a" in message
    assert f"({part}.{default})" in message, message
