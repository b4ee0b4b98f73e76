"""Build a `Config` from its sources, lowest precedence first:

dataclass defaults < the named model size (`model_name`) < the YAML recipe < CLI flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from paratron.config import schema
from paratron.config.fields import all_fields, coerce
from paratron.config.presets import model_preset
from paratron.config.samples import sample_based_train_iters
from paratron.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]


def recipe_dirs() -> list[Path]:
    """Where `--config NAME` looks for NAME.yaml: ./configs, then the checkout paratron runs from."""
    dirs = [Path.cwd() / "configs", REPO_ROOT / "configs"]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def available_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})


def find_recipe(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.suffix not in (".yaml", ".yml") and os.sep not in name_or_path:
        for d in recipe_dirs():
            if (d / f"{name_or_path}.yaml").is_file():
                return d / f"{name_or_path}.yaml"
    known = ", ".join(available_recipes()) or "none found"
    raise ConfigError(f"--config {name_or_path}: no such file or recipe; recipes: {known}")


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe into {field: value}, checking that every key is a known setting of its section."""
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}; fix the syntax there") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(schema.SECTIONS)})")
    fields = all_fields()
    flat: dict[str, Any] = {}
    for section, values in tree.items():
        if section not in schema.SECTIONS:
            hint = _did_you_mean(str(section), schema.SECTIONS)
            raise ConfigError(f"{path}: unknown section '{section}'{hint}; sections are {', '.join(schema.SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping of settings")
        for key, value in values.items():
            info = fields.get(key)
            if info is None or info.section != section:
                names = [f.name for f in fields.values() if f.section == section]
                raise ConfigError(f"{path}: unknown setting {section}.{key}{_did_you_mean(str(key), names)}")
            flat[key] = value
    return flat


def _did_you_mean(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def build_config(overrides: dict[str, Any] | None = None, recipe: str | None = None) -> schema.Config:
    """Resolve a full Config from an optional recipe and field overrides (name -> value)."""
    overrides = dict(overrides or {})
    from_yaml = read_yaml(find_recipe(recipe)) if recipe else {}
    model_name = overrides.get("model_name", from_yaml.get("model_name"))
    merged: dict[str, Any] = dict(model_preset(model_name)) if model_name else {}
    merged.update(from_yaml)
    merged.update(overrides)
    return config_from_flat(merged)


def config_from_flat(values: dict[str, Any]) -> schema.Config:
    """A Config from {setting: value}, each value checked and converted; unset settings keep their defaults."""
    fields = all_fields()
    sections: dict[str, dict[str, Any]] = {section: {} for section in schema.SECTIONS}
    for name, value in values.items():
        info = fields.get(name)
        if info is None:
            raise ConfigError(f"{name}: unknown setting{_did_you_mean(name, fields)}")
        sections[info.section][name] = coerce(info, value, info.flag)
    defaults = schema.Config()
    config = schema.Config(
        **{section: dataclasses.replace(getattr(defaults, section), **values) for section, values in sections.items()}
    )
    return _steps_of_samples(config)


def _steps_of_samples(config: schema.Config) -> schema.Config:
    """With --train-samples the number of steps follows from it (and the batch ramp), as in Megatron-LM."""
    t = config.training
    if t.train_samples is None or not t.global_batch_size:
        return config
    try:
        ramp = t.rampup()
    except ValueError:
        return config  # (refused by validation)
    iters = sample_based_train_iters(t.train_samples, t.global_batch_size, ramp)
    if iters is None:
        return config
    return dataclasses.replace(config, training=dataclasses.replace(t, train_iters=iters))


def override(config: schema.Config, **values: Any) -> schema.Config:
    """A copy of `config` with some settings changed (by field name, checked as in build_config)."""
    flat = {name: value for section in config_to_dict(config).values() for name, value in section.items()}
    return config_from_flat({**flat, **values})


def config_to_dict(config: schema.Config) -> dict[str, dict[str, Any]]:
    """Nested plain-data form (for YAML/JSON dumps and checkpoints)."""
    return dataclasses.asdict(config)


def config_from_dict(tree: dict[str, dict[str, Any]]) -> schema.Config:
    """A Config from its nested form (a checkpoint's); one saved before the Megatron-LM defaults
    (no `openai_gelu` in it) keeps the model it trained: tanh GELU and a 4h SwiGLU width."""
    flat = {k: v for section in tree.values() for k, v in section.items()}
    model = tree.get("model", {})
    if model and "openai_gelu" not in model:
        flat["openai_gelu"] = True
        if model.get("activation") == "swiglu" and model.get("ffn_hidden_size") is None:
            flat["ffn_hidden_size"] = 4 * model["hidden_size"]
    return config_from_flat(flat)
