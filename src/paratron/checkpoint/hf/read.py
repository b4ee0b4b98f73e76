"""Reading a Hugging Face model directory: config.json (checked as transformers reads it) and its
weights (model.safetensors, or the shards model.safetensors.index.json names), checked against the
model the file describes, by name and shape, before any is loaded; a mismatch, or a weights file
that is missing, empty, cut short or not safetensors, is refused in one line naming the file, and
the left-out field whose default is to blame. `read_hf_model` is the reader `checkpoint.formats` and
`load_pretrained` use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paratron.checkpoint.converted import Converted, ConvertOptions, build_converted, config_from_settings, in_memory
from paratron.checkpoint.hf.families import FAMILIES
from paratron.checkpoint.hf.settings import model_settings
from paratron.checkpoint.hf.weights import IGNORED, tied_head_name, weights_from_hf, weights_to_hf, written_layout
from paratron.checkpoint.hf_defaults import DEFAULTS, WEIGHT_SHAPING, default_text, spelled, with_defaults
from paratron.config.schema import Config, ModelConfig
from paratron.data.tokenizer import Tokenizer
from paratron.errors import CheckpointError, ConfigError
from paratron.model.gpt import GPT


def read_hf_model(path: Path, options: ConvertOptions | None = None, tokenizer: bool = True) -> Converted:
    """A Hugging Face model directory as a converted model: its weights under paratron's names, and (unless
    `tokenizer` is off) its tokenizer, read here: a bad declaration of its special tokens is refused before
    anything is written."""
    hf, tensors = read_hf(path)
    source = str(path / "config.json")
    config = config_for_hf(hf, source)
    with torch.device("meta"):
        names = [n for n, _ in GPT(config.model).named_parameters()]  # (a tied output weight is the embedding's)
    state = weights_from_hf(tensors, hf["model_type"], config.model, names, str(path))
    tokenizer_file = path / "tokenizer.json"
    return Converted(
        path=path,
        config=config,
        open_tensors=in_memory(state),
        given=path,
        tokenizer=Tokenizer.from_file(tokenizer_file) if tokenizer and tokenizer_file.is_file() else None,
        tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
        hf_model_type=hf["model_type"],
        meta={"weights_only": True, "hf_model_type": hf["model_type"]},
    )


def read_hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json, refused with one line unless supported."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json; give a Hugging Face model directory")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError:
        raise CheckpointError(f"{config_file}: not valid JSON") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: not a JSON object of model settings; give the model's config.json")
    model_settings(hf, str(config_file))
    return hf


INDEX = "model.safetensors.index.json"
"""Hugging Face's map of a sharded model's tensors to the files that hold them."""


def read_hf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of a Hugging Face model directory (model.safetensors, or the shards
    its index names), read once every file opens and the tensors' names and shapes fit the config."""
    hf = read_hf_config(path)
    files, shapes = weight_shapes(path)
    layout = written_layout(list(shapes), hf["model_type"], str(path))  # (a family's earlier layouts renamed)
    source = str(path / "config.json")
    _check_weights_fit(hf, config_for_hf(hf, source).model, {layout[n]: s for n, s in shapes.items()}, source)
    return hf, {layout[name]: tensor for name, tensor in load_tensors(files).items()}


def weight_shapes(path: Path) -> tuple[list[Path], dict[str, list[int]]]:
    """The safetensors files of a model directory and the shape of each tensor they hold, read from their headers
    alone; each tensor must be in the file the index places it in."""
    files, placed = _weight_files(path)
    shapes: dict[str, list[int]] = {}
    holder: dict[str, str] = {}
    for file in files:
        for name, shape in _tensor_shapes(file).items():
            shapes[name], holder[name] = shape, file.name
    for name, file_name in placed.items():
        if holder.get(name) != file_name:
            raise CheckpointError(
                f"{path / file_name}: has no tensor {name}, which {INDEX} places there; fetch it again"
            )
    return files, shapes


def load_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors `files`, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(_unreadable(file, exc)) from None
    return tensors


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a model directory (those its index names, else every *.safetensors
    file) and the index's tensor -> file map (empty without an index)."""
    index = path / INDEX
    if index.is_file():
        try:
            placed = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / name for name in placed.values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index}: not a safetensors index (JSON with a weight_map); fetch it again"
            ) from None
        for file in files:
            if not file.is_file():
                raise CheckpointError(
                    f"{index}: names {file.name}, which is not in {path}; fetch that file (or remove the index "
                    "when one model.safetensors holds every tensor)"
                )
        return files, placed
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files, {}
    if any(path.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{path}: has PyTorch .bin weights only; paratron reads safetensors: save the model with "
            "save_pretrained(DIR, safe_serialization=True)"
        )
    raise CheckpointError(f"{path}: no weights (model.safetensors, or {INDEX} and its shards); add the model's weights")


def _tensor_shapes(file: Path) -> dict[str, list[int]]:
    """The names and shapes of a safetensors file's tensors, from its header alone."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(_unreadable(file, exc)) from None


def _unreadable(file: Path, error: Exception) -> str:
    """One line on why a weights file cannot be read, and what to do."""
    if isinstance(error, OSError):
        return f"{file}: cannot be read ({error.strerror or error}); check the file and its permissions"
    size = file.stat().st_size
    if size == 0:
        return f"{file}: is empty (0 bytes); copy or download the weights again"
    with open(file, "rb") as f:
        start = f.read(64)
    if start.startswith(b"version https://git-lfs"):
        return f"{file}: is a Git LFS pointer, not the weights; fetch them with git lfs pull (or download the file)"
    reason = str(error).splitlines()[0].removeprefix("Error while deserializing header: ")
    if "incomplete metadata" in reason:
        return f"{file}: is cut short ({size} bytes, fewer than its header lists); copy or download it again"
    return (
        f"{file}: is not a safetensors file ({reason}); download it again, or save the model with "
        "save_pretrained(DIR, safe_serialization=True)"
    )


def _check_weights_fit(hf: dict[str, Any], m: ModelConfig, shapes: dict[str, list[int]], source: str) -> None:
    """Refuse weights whose tensor names or shapes are not those of model `m` (read from `hf`): naming the
    fields config.json leaves out whose transformers defaults shape the weights, if any."""
    kind = hf["model_type"]
    with torch.device("meta"):
        expected = {
            name: list(tensor.shape) for name, tensor in weights_to_hf(dict(GPT(m).named_parameters()), kind).items()
        }
    problem = None
    for name, shape in expected.items():
        if name not in shapes:
            problem = f"the weights have no {name}"
        elif shapes[name] != shape:
            problem = f"{name} is {shapes[name]} in the weights, {shape} by config.json"
        if problem:
            break
    tied_head = tied_head_name(FAMILIES[kind]) if not m.untie_embeddings_and_output_weights else None
    extra = [n for n in shapes if n not in expected and n != tied_head and not IGNORED.search(n)]
    if problem is None and extra:
        problem = f"the weights hold {extra[0]}, which the model of config.json lacks"
    if problem:
        raise CheckpointError(_blame(hf, source, f"the weights do not fit it ({problem})"))


def _blame(hf: dict[str, Any], source: str, problem: str) -> str:
    """One line for a config.json that does not describe its model, naming the fields it leaves out whose
    transformers defaults shape the weights (the likely cause), or else config.json as a whole."""
    kind = hf["model_type"]
    parts = _nested_parts(hf) if FAMILIES[kind].text_families else [("", kind, hf)]
    suspects = [
        (where, part_kind, name)
        for where, part_kind, part in parts
        for name in with_defaults(part, part_kind)[1]
        if name in WEIGHT_SHAPING
    ]
    fixed = [suspect for suspect in suspects if DEFAULTS[suspect[1]][suspect[2]] is not None]
    suspects = fixed or suspects  # (a derived default, head_dim's say, is to blame only when nothing else is)
    if not suspects:
        return f"{source}: {problem}; correct config.json or give the weights it was saved with"
    many = len(suspects) > 1
    missing = ", ".join(where + spelled(part_kind, name) for where, part_kind, name in suspects)
    defaults = ", ".join(where + default_text(part_kind, name) for where, part_kind, name in suspects)
    kinds = " and ".join(dict.fromkeys(part_kind for _, part_kind, _ in suspects))
    return (
        f"{source}: has no {missing}, and with transformers' default{'s' * many} for a {kinds} model ({defaults}) "
        f"{problem}; add {'them' if many else 'it'}"
    )


def _nested_parts(hf: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """A vision-language config.json's nested configs whose left-out fields shape the weights: (where, model type,
    the config) of its `text_config` and, when given, its `vision_config` (without one, LLaVA-1.5's tower is whole)."""
    text = hf.get("text_config") or {}
    parts = [("text_config.", text.get("model_type", FAMILIES[hf["model_type"]].text_families[0]), text)]
    vision = hf.get("vision_config")
    if isinstance(vision, dict):
        parts.append(("vision_config.", vision.get("model_type", "clip_vision_model"), vision))
    return parts


def config_for_hf(hf: dict[str, Any], source: str) -> Config:
    """The paratron configuration of a Hugging Face config.json; a model paratron cannot build is
    refused in one line that names the file (and the left-out field to blame, if any)."""
    try:
        return config_from_settings(model_settings(hf, source))
    except ConfigError as exc:
        raise CheckpointError(_blame(hf, source, f"it describes a model paratron cannot build ({exc})")) from None


def model_from_hf(path: Path, device: torch.device | str = "cpu") -> GPT:
    """A single-device paratron model with a Hugging Face directory's weights, in eval mode."""
    return build_converted(read_hf_model(path, tokenizer=False), device).eval()
