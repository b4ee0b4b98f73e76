"""LLaVA (transformers' LlavaForConditionalGeneration) both ways: a CLIP or SigLIP vision tower, a Linear-GELU-Linear
projector and a Llama, Mistral or Qwen2 language model, as paratron's vision encoder, projector and GPT.

config.json nests the language model's settings in `text_config` (read and written by that family's row) and the
vision tower's in `vision_config` (`clip_vision_model` or `siglip_vision_model`, read here with transformers'
defaults for its model type); the top level holds the projector's and the image features' settings. The weights
are written as transformers 5 saves them (`language_model.model.*`, `language_model.lm_head.weight`,
`vision_tower.*`, `multi_modal_projector.*`) and read in that layout or the earlier ones (`vision_tower.vision_model.*`
of the released checkpoints; `model.language_model.*`, `model.vision_tower.*`, `lm_head.weight` of transformers'
in-memory names). A released vision encoder folder (CLIPVisionModel, SiglipVisionModel, or the vision half of a
CLIPModel or SiglipModel) is read by the same tables (`vision_tower_settings`, `VISION_NAMES`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from paratron.checkpoint.hf.family import Family, HFConfig, Settings
from paratron.checkpoint.hf_defaults import LLAVA_VISION_CONFIG, first_wrong_type, with_defaults
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError

VISION_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""The vision towers' model types, and paratron's encoder family (--vision-type) of each."""
_TOWER_GELU = {"clip": ("quick_gelu",), "siglip": ("gelu_pytorch_tanh", "gelu_new")}
"""The activations of each encoder family (paratron's CLIP layers use quick GELU, SigLIP's the tanh GELU)."""
TOWER = "vision_tower."
"""The prefix of the vision tower's weights in a LLaVA file."""

VISION_NAMES = {
    "vision.encoder.patch_embedding.{w}": "embeddings.patch_embedding.{w}",
    "vision.encoder.class_embedding": "embeddings.class_embedding",
    "vision.encoder.position_embedding.weight": "embeddings.position_embedding.weight",
    "vision.encoder.pre_norm.{w}": "pre_layrnorm.{w}",
    "vision.encoder.layers.{i}.attention_norm.{w}": "encoder.layers.{i}.layer_norm1.{w}",
    "vision.encoder.layers.{i}.attention.in_proj.{p}.{w}": "encoder.layers.{i}.self_attn.{p}_proj.{w}",
    "vision.encoder.layers.{i}.attention.out_proj.{w}": "encoder.layers.{i}.self_attn.out_proj.{w}",
    "vision.encoder.layers.{i}.mlp_norm.{w}": "encoder.layers.{i}.layer_norm2.{w}",
    "vision.encoder.layers.{i}.mlp.in_proj.up.{w}": "encoder.layers.{i}.mlp.fc1.{w}",
    "vision.encoder.layers.{i}.mlp.out_proj.{w}": "encoder.layers.{i}.mlp.fc2.{w}",
    "vision.encoder.post_norm.{w}": "post_layernorm.{w}",
    "vision.encoder.head.probe": "head.probe",
    "vision.encoder.head.attention.in_proj_{w}": "head.attention.in_proj_{w}",
    "vision.encoder.head.attention.out_proj.{w}": "head.attention.out_proj.{w}",
    "vision.encoder.head.norm.{w}": "head.layernorm.{w}",
    "vision.encoder.head.fc1.{w}": "head.mlp.fc1.{w}",
    "vision.encoder.head.fc2.{w}": "head.mlp.fc2.{w}",
}
"""paratron's vision encoder -> its names in a CLIP or SigLIP vision model (transformers 5's: no `vision_model.`)."""
PROJECTOR_NAMES = {"vision.projector.linear_{p}.{w}": "multi_modal_projector.linear_{p}.{w}"}


def llava_names(text_names: dict[str, str]) -> dict[str, str]:
    """The weight names of a LLaVA file: the language model's (a text family's table, under `language_model.`),
    the vision tower's and the projector's."""
    text = {name: f"language_model.{hub}" for name, hub in text_names.items()}
    return {**text, **{name: TOWER + hub for name, hub in VISION_NAMES.items()}, **PROJECTOR_NAMES}


LLAVA_LAYOUTS = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^(?:model\.)?vision_tower\.vision_model\.", TOWER),
    (r"^model\.vision_tower\.", TOWER),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
)
"""The earlier layouts of LLaVA files, renamed into the one written (`Family.hub_layouts`)."""


# ---------------------------------------------------------------- reading config.json


def vision_tower_settings(vision: Any, source: str) -> Settings:
    """paratron's encoder settings of a CLIP or SigLIP vision config (transformers' defaults filled in)."""
    if not isinstance(vision, dict):
        raise CheckpointError(f"{source}: is not a JSON object of vision settings; correct it")
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in VISION_TOWERS:
        raise CheckpointError(
            f"{source}: model_type {kind!r} is not supported as a vision tower; give one of {', '.join(VISION_TOWERS)}"
        )
    wrong = first_wrong_type(vision, kind)
    if wrong:
        raise CheckpointError(f"{source}: {wrong[0]} is {json.dumps(vision[wrong[0]])}, not {wrong[1]}; correct it")
    v, _ = with_defaults(vision, kind)
    family = VISION_TOWERS[kind]
    if v["hidden_act"] not in _TOWER_GELU[family]:
        raise CheckpointError(
            f"{source}: hidden_act {v['hidden_act']!r} is not supported for {kind} (paratron's {family} encoder "
            f"uses {_TOWER_GELU[family][0]})"
        )
    if v["num_channels"] != 3:
        raise CheckpointError(f"{source}: num_channels {v['num_channels']} is not supported (RGB images, 3)")
    return dict(
        vision_type=family,
        img_h=v["image_size"],
        img_w=v["image_size"],
        patch_dim=v["patch_size"],
        vision_num_layers=v["num_hidden_layers"],
        vision_hidden_size=v["hidden_size"],
        vision_num_attention_heads=v["num_attention_heads"],
        vision_ffn_hidden_size=v["intermediate_size"],
        vision_norm_epsilon=v["layer_norm_eps"],
        vision_pooling_head=family == "siglip" and v["vision_use_head"],
    )


def llava_settings(hf: HFConfig, family: Family, source: str) -> Settings:
    """The vision tower's, projector's and image features' settings of a LLaVA config.json (the language model's
    come from its `text_config`, by its family's row)."""
    layer = hf.get("vision_feature_layer", -2)
    if isinstance(layer, list):
        raise CheckpointError(
            f"{source}: vision_feature_layer {layer} (the features of several layers joined) is not supported; "
            "give one layer"
        )
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise CheckpointError(f"{source}: vision_feature_layer is {json.dumps(layer)}, not a whole number; correct it")
    if hf["projector_hidden_act"] != "gelu":
        raise CheckpointError(
            f"{source}: projector_hidden_act {hf['projector_hidden_act']!r} is not supported (paratron's projector "
            "is Linear-GELU-Linear with the exact GELU, gelu)"
        )
    strategy = hf["vision_feature_select_strategy"]
    if strategy not in ("default", "full"):
        raise CheckpointError(f"{source}: vision_feature_select_strategy {strategy!r} is not default or full")
    vision = hf.get("vision_config")
    tower = vision_tower_settings(LLAVA_VISION_CONFIG if vision is None else vision, f"{source} (vision_config)")
    check_feature_layer(layer, tower["vision_num_layers"], f"{source}: vision_feature_layer")
    text = hf.get("text_config") or {}
    tied = hf["tie_word_embeddings"] or bool(isinstance(text, dict) and text.get("tie_word_embeddings"))
    return dict(
        **tower,
        vision_feature_layer=layer,
        vision_feature_select=strategy,
        vision_projection="mlp",
        vision_projection_bias=hf["multimodal_projector_bias"],
        image_token_id=hf["image_token_index"],
        untie_embeddings_and_output_weights=not tied,  # (transformers ties when either config says so)
    )


def check_feature_layer(layer: int, depth: int, setting: str) -> None:
    """Refuse a feature layer that the encoder of `depth` layers does not have (hidden states 0 to depth)."""
    if not -depth - 1 <= layer <= depth:
        raise CheckpointError(
            f"{setting} {layer} is not a layer of the {depth}-layer vision encoder; give one from {-depth - 1} "
            f"to {depth} (-2: the one before the last, LLaVA's)"
        )


def with_language(language: Settings, vision: Settings, source: str) -> Settings:
    """The whole model's settings: the language model's, with the vision tower's and projector's over them; an image
    placeholder outside the vocabulary is refused (paratron embeds every token before the images replace theirs)."""
    settings = {**language, **vision}
    placeholder, vocab = settings["image_token_id"], settings["vocab_size"]
    if not 0 <= placeholder < vocab:
        raise CheckpointError(
            f"{source}: image_token_index {placeholder} is not an id of the {vocab}-token vocabulary "
            "(text_config.vocab_size); give the placeholder's id"
        )
    return settings


def text_config(hf: HFConfig, family: Family, source: str) -> HFConfig:
    """A vision-language config.json's `text_config`, with its model type (the family's first when it names none)."""
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: text_config is not a JSON object of model settings; correct it")
    kind = text.get("model_type", family.text_families[0])
    if kind not in family.text_families:
        raise CheckpointError(
            f"{source}: text_config's model_type {kind!r} is not supported in a {family.architecture}; "
            f"its language model must be one of {', '.join(family.text_families)}"
        )
    return {**text, "model_type": kind}


# ---------------------------------------------------------------- writing config.json


def refuse_unexportable(m: ModelConfig) -> None:
    """Refuse, in one line and before anything is written, a vision-language model LlavaForConditionalGeneration
    cannot hold."""
    if m.vision_projection != "mlp":
        raise CheckpointError(
            f"--vision-projection {m.vision_projection} has no equivalent in Hugging Face's "
            "LlavaForConditionalGeneration (its projector is Linear-GELU-Linear); export a model with "
            "--vision-projection mlp"
        )
    if m.img_h != m.img_w:
        raise CheckpointError(
            f"--img-h {m.img_h} --img-w {m.img_w}: Hugging Face's CLIP and SigLIP vision models take square "
            "images only; export a model with square images"
        )
    if m.vision_type == "clip" and m.vision_pooling_head:
        raise CheckpointError(
            "--vision-pooling-head on a clip encoder has no equivalent in Hugging Face's CLIPVisionModel; "
            "export a model without it"
        )


def vision_tower_config(m: ModelConfig) -> HFConfig:
    """The `vision_config` of paratron model `m`'s encoder."""
    siglip = m.vision_type == "siglip"
    config = {
        "model_type": "siglip_vision_model" if siglip else "clip_vision_model",
        "hidden_size": m.vision_hidden_size,
        "intermediate_size": m.vision_ffn_hidden_size,
        "num_hidden_layers": m.vision_num_layers,
        "num_attention_heads": m.vision_num_attention_heads,
        "num_channels": 3,
        "image_size": m.img_h,
        "patch_size": m.patch_dim,
        "hidden_act": "gelu_pytorch_tanh" if siglip else "quick_gelu",
        "layer_norm_eps": m.vision_norm_epsilon,
        "attention_dropout": 0.0,
    }
    return {**config, "vision_use_head": bool(m.vision_pooling_head)} if siglip else config


def llava_config(m: ModelConfig, family: Family) -> HFConfig:
    """The entries of a LLaVA config.json beside its `text_config`: the vision tower, projector and image features."""
    return {
        "vision_config": vision_tower_config(m),
        "image_token_index": m.placeholder_id,
        "image_seq_length": m.image_tokens,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": m.vision_feature_layer,
        "vision_feature_select_strategy": m.vision_feature_select,
        "multimodal_projector_bias": m.vision_projection_bias,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
    }


# ---------------------------------------------------------------- a released vision encoder's weights


def tower_weights(names: list[str], whole_model: bool) -> dict[str, str]:
    """A vision encoder folder's weight names -> their names in a LLaVA file (`vision_tower.*`): every name of a
    CLIPVisionModel / SiglipVisionModel (with or without `vision_model.`), the `vision_model.*` names alone of a
    CLIPModel / SiglipModel (`whole_model`; its text half and projections are left)."""
    inner = re.compile(r"^vision_model\.")
    return {name: TOWER + inner.sub("", name) for name in names if not whole_model or inner.match(name)}
