"""One vision-language model from two released folders (`paratron convert --from hf LM --vision-model-path VIT`): a
Llama, Mistral or Qwen2 language model and a CLIP or SigLIP vision encoder (CLIPVisionModel, SiglipVisionModel, or
the vision half of a CLIPModel or SiglipModel) become a paratron model with a projector between them, freshly
initialized as paratron initializes it, ready for LLaVA's first stage (training the projector alone). Which layer
feeds the projector, which features it keeps and the projector's kind come from the options.

`read_hf_folder` is the Hugging Face reader of `checkpoint.formats`'s table: one folder, or the two combined.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from paratron.checkpoint.converted import Converted, ConvertOptions, config_from_settings, in_memory
from paratron.checkpoint.hf.families import FAMILIES
from paratron.checkpoint.hf.llava import TOWER, VISION_TOWERS, check_feature_layer, tower_weights, vision_tower_settings
from paratron.checkpoint.hf.read import load_tensors, read_hf_config, read_hf_model, weight_shapes
from paratron.checkpoint.hf.settings import model_settings
from paratron.checkpoint.hf.weights import weights_from_hf, weights_to_hf
from paratron.config.schema import Config, ModelConfig
from paratron.errors import CheckpointError, ConfigError
from paratron.model.gpt import GPT
from paratron.model.init import init_parameter

_WHOLE_MODELS = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}
"""Image-text models whose vision half is taken (their model type -> their vision config's)."""


def read_hf_folder(path: Path, options: ConvertOptions | None = None, tokenizer: bool = True) -> Converted:
    """A Hugging Face model directory as a converted model; with `options.vision_model_path`, that language model
    with the vision encoder of the other folder before it."""
    if options is None or options.vision_model_path is None:
        return read_hf_model(path, options, tokenizer)
    return read_combined(path, options.vision_model_path, options, tokenizer)


def read_combined(path: Path, vision_path: Path, options: ConvertOptions, tokenizer: bool = True) -> Converted:
    """The language model of folder `path` with the vision encoder of folder `vision_path` and a new projector."""
    language = read_hf_model(path, options, tokenizer)
    kind = language.hf_model_type or ""
    if kind not in FAMILIES["llava"].text_families:
        raise CheckpointError(
            f"{path / 'config.json'}: a {FAMILIES[kind].name} language model; --vision-model-path puts a vision "
            f"encoder before a {', '.join(FAMILIES[t].name for t in FAMILIES['llava'].text_families)} model only"
        )
    vision, whole_model = _vision_config(vision_path)
    tower = vision_tower_settings(vision, str(vision_path / "config.json"))
    config = _combined_config(read_hf_config(path), tower, options, str(path / "config.json"))
    m = config.model
    with torch.device("meta"):
        params = dict(GPT(m).named_parameters())
    with language.open_tensors() as tensors:
        state = {name: tensors.whole(name) for name in tensors.names()}
    state.update(_encoder_weights(vision_path, whole_model, {n: p for n, p in params.items() if _encoder(n)}, m))
    for name, param in params.items():  # (the projector: new, from paratron's initialization)
        if name.startswith("vision.projector."):
            state[name] = torch.empty(param.shape)
            init_parameter(name, state[name], m, config.training.seed)
    meta = {**language.meta, "vision_model_path": str(vision_path)}
    return dataclasses.replace(language, config=config, open_tensors=in_memory(state), meta=meta)


def _encoder(name: str) -> bool:
    return name.startswith("vision.encoder.")


def _vision_config(folder: Path) -> tuple[dict[str, Any], bool]:
    """A vision encoder folder's vision config, and whether the folder holds a whole image-text model."""
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"--vision-model-path {folder}: no config.json; give a Hugging Face vision encoder directory "
            "(CLIPVisionModel or SiglipVisionModel, or a CLIPModel or SiglipModel)"
        )
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except ValueError:
        raise CheckpointError(f"{file}: not valid JSON") from None
    kind = hf.get("model_type") if isinstance(hf, dict) else None
    if kind in _WHOLE_MODELS:
        vision = hf.get("vision_config") or {}
        return {**vision, "model_type": _WHOLE_MODELS[kind]} if isinstance(vision, dict) else vision, True
    if kind in VISION_TOWERS:
        return hf, False
    raise CheckpointError(
        f"{file}: model_type {kind!r} is not a vision encoder paratron reads; give a CLIPVisionModel or "
        f"SiglipVisionModel folder ({', '.join(VISION_TOWERS)}), or a CLIPModel or SiglipModel "
        f"({', '.join(_WHOLE_MODELS)})"
    )


def _combined_config(hf: dict[str, Any], tower: dict[str, Any], options: ConvertOptions, source: str) -> Config:
    """The paratron configuration of the language model of config.json `hf` with encoder `tower` and the options'
    feature layer, feature selection and projector."""
    layer = -2 if options.vision_feature_layer is None else options.vision_feature_layer
    check_feature_layer(layer, tower["vision_num_layers"], "--vision-feature-layer")
    chosen = {
        "vision_feature_layer": layer,
        "vision_feature_select": options.vision_feature_select,
        "vision_projection": options.vision_projection or "mlp",
    }
    try:
        return config_from_settings({**model_settings(hf, source), **tower, **chosen})
    except ConfigError as exc:
        raise CheckpointError(f"{source} with --vision-model-path: {exc}") from None


def _encoder_weights(
    folder: Path, whole_model: bool, params: dict[str, torch.Tensor], m: ModelConfig
) -> dict[str, torch.Tensor]:
    """The encoder's weights (paratron's names) from a vision encoder folder, checked by name and shape against
    the encoder of its config.json before any is loaded."""
    files, shapes = weight_shapes(folder)
    renamed = tower_weights(list(shapes), whole_model)  # (file name -> its name in a LLaVA file)
    found = {renamed[name]: shape for name, shape in shapes.items() if name in renamed}
    expected = {name: list(t.shape) for name, t in weights_to_hf(params, "llava").items()}
    source = folder / "config.json"
    for name, shape in expected.items():
        if found.get(name, shape) != shape:
            stored = name.removeprefix(TOWER)
            raise CheckpointError(f"{source}: the weights do not fit it ({stored} is {found[name]}, {shape} by it)")
    tensors = {renamed[name]: t for name, t in load_tensors(files).items() if name in renamed}
    return weights_from_hf(tensors, "llava", m, list(params), str(folder))
