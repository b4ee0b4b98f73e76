"""Build a `Config` from its sources, lowest precedence first:

dataclass defaults < the checkpoint the run loads (its model) < the named model size (`model_name`) < the YAML
recipe < CLI flags; and remember where each setting came from, so that an error can say.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from paratron.config import schema
from paratron.config.fields import FieldInfo, all_fields, coerce
from paratron.config.megatron import ignored_like_megatron
from paratron.config.presets import model_preset
from paratron.config.samples import batch_schedule, sample_based_train_iters, step_schedule
from paratron.config.vision import VisionSettings
from paratron.errors import ConfigError

try:  # where the Traversable protocol lives: Python 3.11 and later, then 3.10
    from importlib.resources.abc import Traversable
except ImportError:
    from importlib.abc import Traversable

USER_RECIPES = "configs"
"""The folder of the current directory where users keep recipes of their own."""


def recipe_dirs() -> list[Traversable]:
    """Where `--config NAME` looks for NAME.yaml: ./configs first, so a user's recipe wins, then the
    recipes shipped inside the package (read through importlib.resources, so an installed wheel has them)."""
    dirs = [Path.cwd() / USER_RECIPES, importlib.resources.files("paratron") / "recipes"]
    return [d for d in dirs if d.is_dir()]


def available_recipes() -> list[str]:
    """The names `--config` accepts, from every recipe folder."""
    names = (p.name for d in recipe_dirs() for p in d.iterdir())
    return sorted({name.removesuffix(".yaml") for name in names if name.endswith(".yaml")})


def find_recipe(name_or_path: str) -> Traversable:
    """The YAML file `--config` means: a path to a file, else a recipe name looked up in recipe_dirs()."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.suffix not in (".yaml", ".yml") and os.sep not in name_or_path:
        for d in recipe_dirs():
            recipe = d / f"{name_or_path}.yaml"
            if recipe.is_file():
                return recipe
    known = ", ".join(available_recipes()) or "none found"
    raise ConfigError(
        f"--config {name_or_path}: no such file or recipe; recipes: {known}; "
        f"give one of them, a NAME.yaml in ./{USER_RECIPES}/ or the path of a YAML file"
    )


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
            if LEGACY_SETTINGS.get(key) == section:
                flat[key] = value
                continue
            if info is None or info.section != section:
                names = [f.name for f in fields.values() if f.section == section]
                raise ConfigError(f"{path}: unknown setting {section}.{key}{_did_you_mean(str(key), names)}")
            flat[key] = value
    return flat


def _did_you_mean(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


LEGACY_SETTINGS = {"use_distributed_optimizer": "parallel"}
"""Settings read from flags, recipes and saved configs that fold into another one (section they are read in):
Megatron-LM's --use-distributed-optimizer is --zero-stage 1 when no other stage is given."""

DATA_SOURCES = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "corpus", "mock_data")
"""The settings that say what a run reads: one given on the command line replaces all of the recipe's."""

NAMES_A_TOKENIZER = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""Settings by which a run names its tokenizer; a run that names none uses its checkpoint's."""

COUNTED = ("NullTokenizer", "TikTokenizer")
"""Tokenizers whose ids --vocab-size counts (Megatron-LM's meaning): a checkpoint's vocabulary, which holds
NullTokenizer's end-of-document id too, is not that count."""

VISION_FIELDS = frozenset(VisionSettings.__dataclass_fields__)
"""The settings of a vision model's encoder and projector, free where a text checkpoint gains them."""

SCHEDULE_LENGTHS = (
    ("train_iters", ("lr_decay_iters", "lr_wsd_decay_iters"), "lr_warmup_iters"),
    ("train_samples", ("lr_decay_samples", "lr_wsd_decay_samples"), "lr_warmup_samples"),
)
"""A run's length, the decay lengths that must fit in it and the warmup that must be shorter than the decay."""


@dataclass(frozen=True)
class SavedModel:
    """What a checkpoint says of the model it holds, for a run that loads it (read by `checkpoint.model_of`)."""

    where: str
    """How messages name it: "the checkpoint PATH"."""
    model: dict[str, Any]
    """Every model setting it was trained with."""
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """Data settings of its tokenizer (a Megatron-LM checkpoint's args), for a run that names none; a paratron
    checkpoint carries its tokenizer file instead."""
    folder: str | None = None
    """The folder the run loads where it is not --load's: a Hugging Face folder's converted copy."""


@dataclass(frozen=True)
class Resolution:
    """A run's settings and where they came from."""

    config: schema.Config
    origins: dict[str, str]
    """Where each setting that is neither given on the command line nor at its default got its value: "the recipe
    NAME", "--model NAME" or "the checkpoint PATH"."""
    notes: list[str]
    """One line each, for the user: recipe schedule lengths scaled to a shorter run, checkpoint values kept over
    the command line's (--use-checkpoint-args)."""
    saved: SavedModel | None = None
    ignored: dict[str, str] = field(default_factory=dict)
    """The command line's settings that Megatron-LM ignores in these settings (resolved as if not given), each with
    the warning to print (`resolve_settings` with `given`)."""


def build_config(overrides: dict[str, Any] | None = None, recipe: str | None = None) -> schema.Config:
    """Resolve a full Config from an optional recipe and field overrides (name -> value)."""
    return resolve_settings(overrides, recipe).config


CheckpointReader = Callable[[Mapping[str, Any]], "SavedModel | None"]
"""What the checkpoint a run loads says of its model, from the settings that name it as the command line and the
recipe give them (load, save, data_cache_path); None when the run loads none (`checkpoint.model_of.read_saved_model`).
The checkpoint layer reads it: this one imports nothing of it."""


def resolve_settings(
    overrides: dict[str, Any] | None = None,
    recipe: str | None = None,
    *,
    read_checkpoint: CheckpointReader | None = None,
    checkpoint_wins: bool = False,
    given: Collection[str] = (),
) -> Resolution:
    """The run's settings in one pass, lowest precedence first: defaults < the checkpoint --load names (what
    `read_checkpoint` reads of it) < --model's preset < the recipe < the command line
    (`overrides`). A data source on the command line replaces the recipe's; settings of `given` (those set on the
    command line) that Megatron-LM ignores in the result (`megatron.ignored_like_megatron`: --num-query-groups without
    --group-query-attention) are taken as not given, so that they fall back to the checkpoint's, the preset's, the
    recipe's or the default; a model setting that defines the architecture must then agree with the checkpoint's (or,
    with `checkpoint_wins`, gives way to it); recipe schedule lengths a shorter run cannot hold are scaled to it."""
    overrides = dict(overrides or {})
    from_yaml = read_yaml(find_recipe(recipe)) if recipe else {}
    if any(overrides.get(name) for name in DATA_SOURCES):
        from_yaml = {name: value for name, value in from_yaml.items() if name not in DATA_SOURCES}
    naming = {**from_yaml, **overrides}  # (the settings that name the checkpoint)
    if checkpoint_wins and not naming.get("load"):
        raise ConfigError("--use-checkpoint-args takes the model's settings from the checkpoint: add --load CKPT")
    saved = read_checkpoint(naming) if read_checkpoint is not None and naming.get("load") else None
    if saved is not None and saved.folder is not None:  # (a converted copy is what the run loads)
        overrides["load"] = saved.folder
    model_name = overrides.get("model_name", from_yaml.get("model_name"))
    named_by = (
        f"--model {model_name}" if "model_name" in overrides else f"model_name {model_name} in the recipe {recipe}"
    )
    layers = [
        (saved.where if saved else "", _carried(saved.model) if saved else {}),
        (named_by, model_preset(model_name) if model_name else {}),
        (f"the recipe {recipe}", from_yaml),
    ]
    below: dict[str, Any] = {}
    below_origins: dict[str, str] = {}
    for origin, values in layers:
        below.update(values)
        below_origins.update(dict.fromkeys(values, origin))
    named = any(below.get(name) or overrides.get(name) for name in (*NAMES_A_TOKENIZER, "mock_data"))
    if saved and saved.tokenizer and not named:
        _check_saved_tokenizer(saved)
        below.update(saved.tokenizer)
        below_origins.update(dict.fromkeys(saved.tokenizer, saved.where))
    config, origins = _over(below, below_origins, overrides, saved)
    ignored = ignored_like_megatron(config, given) if given else {}
    if ignored:
        overrides = {name: value for name, value in overrides.items() if name not in ignored}
        config, origins = _over(below, below_origins, overrides, saved)
    notes: list[str] = []
    if saved is not None:
        config = _keep_architecture(config, saved, origins, checkpoint_wins, notes)
    config = _fit_schedule(config, overrides, from_yaml, f"the recipe {recipe}", notes)
    return Resolution(config, origins, notes, saved, ignored)


def _over(
    below: dict[str, Any], below_origins: dict[str, str], overrides: dict[str, Any], saved: SavedModel | None
) -> tuple[schema.Config, dict[str, str]]:
    """The settings of the layers `below` the command line with its `overrides` over them, and where each came from."""
    merged, origins = {**below, **overrides}, {k: v for k, v in below_origins.items() if k not in overrides}
    context = _checkpoint_context(merged, saved)
    if context is not None:
        merged["seq_length"], origins["seq_length"] = context, saved.where  # type: ignore[union-attr]
    if saved is not None and origins.get("vocab_size") == saved.where and merged.get("tokenizer_type") in COUNTED:
        del merged["vocab_size"], origins["vocab_size"]  # (there --vocab-size counts the tokenizer's ids)
    return config_from_flat(merged), origins


def _checkpoint_context(merged: dict[str, Any], saved: SavedModel | None) -> int | None:
    """A fine-tuning run (or an evaluation) that gives no --seq-length takes the context its checkpoint's model
    holds (its --max-position-embeddings), not a default shorter than the model's samples; None otherwise."""
    if saved is None or "seq_length" in merged:
        return None
    finetune = all_fields()["finetune"]
    if not coerce(finetune, merged.get("finetune", False), finetune.flag):
        return None
    context = saved.model.get("max_position_embeddings")
    return int(context) if context else None


def _carried(model: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model settings a run that loads it takes as its defaults (all but `MODEL_PER_RUN`)."""
    return {name: value for name, value in model.items() if name not in schema.MODEL_PER_RUN}


def _check_saved_tokenizer(saved: SavedModel) -> None:
    kind = saved.tokenizer.get("tokenizer_type")
    choices = all_fields()["tokenizer_type"].choices or ()
    if kind is not None and kind not in choices:
        raise ConfigError(
            f"{saved.where} was trained with Megatron-LM's {kind}, which paratron does not read; name the tokenizer "
            "with --tokenizer-type and its files"
        )


def _keep_architecture(
    config: schema.Config, saved: SavedModel, origins: dict[str, str], checkpoint_wins: bool, notes: list[str]
) -> schema.Config:
    """Refuse (or with `checkpoint_wins` undo, with a note) a model setting that gives the checkpoint's model
    another architecture."""
    theirs_model = schema.ModelConfig(**saved.model)
    ours, theirs = config.model.architecture(), theirs_model.architecture()
    for name in schema.MODEL_ARCHITECTURE:
        if origins.get(name) == saved.where or ours[name] == theirs[name]:
            continue
        if name == "vocab_size" and not config.data.mock_data:
            continue  # (the tokenizer decides it; the weights' shapes are checked as they load)
        if name in VISION_FIELDS and not theirs_model.has_vision:
            continue  # (a text checkpoint has no encoder to contradict: the run's is new)
        given = as_flag(name, getattr(config.model, name))
        origin = origins.get(name)
        label = "query groups" if name in ("group_query_attention", "num_query_groups") else name.replace("_", " ")
        theirs_text = f"{label} {_shown(theirs[name])}"
        from_where = f" (from {origin})" if origin else ""
        if checkpoint_wins:
            notes.append(f"{given}{from_where} gives way to {saved.where}'s {theirs_text} (--use-checkpoint-args)")
            continue
        if origin is None:
            fix = "leave it out"
        else:
            fix = f"take it out of {origin}" if origin.startswith("the recipe") else f"leave out {origin}"
        raise ConfigError(
            f"{given}{from_where} contradicts {saved.where} ({theirs_text}); {fix} to use the checkpoint's"
        )
    if not checkpoint_wins:
        return config
    kept = {name: getattr(theirs_model, name) for name in schema.MODEL_ARCHITECTURE}
    if not config.data.mock_data:
        del kept["vocab_size"]  # (the tokenizer decides it)
    if not theirs_model.has_vision:
        kept = {name: value for name, value in kept.items() if name not in VISION_FIELDS}
    origins.update(dict.fromkeys(kept, saved.where))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **kept))


def _fit_schedule(
    config: schema.Config, overrides: dict[str, Any], from_yaml: dict[str, Any], recipe: str, notes: list[str]
) -> schema.Config:
    """A run shortened on the command line keeps the recipe's schedule where it fits; a recipe's decay or warmup
    length that no longer fits is scaled by this run's length / the recipe's (the recipe's own run keeps its
    numbers)."""
    fields = all_fields()
    changes: dict[str, int] = {}
    for total, (decay_name, wsd_name), warmup_name in SCHEDULE_LENGTHS:
        run = _setting(config, total)
        planned = coerce(fields[total], from_yaml.get(total, fields[total].default), fields[total].flag)
        if total not in overrides or run is None or planned is None or run >= planned:
            continue
        from_recipe = {n for n in (decay_name, wsd_name, warmup_name) if n in from_yaml and n not in overrides}
        ratio = (run, planned, as_flag(total, run), recipe)
        decay = _setting(config, decay_name)
        if decay_name in from_recipe and decay is not None and decay > run:
            decay = changes[decay_name] = _scaled(decay_name, decay, ratio, 1, run, notes)
        decay = decay or run
        wsd = _setting(config, wsd_name)
        if wsd_name in from_recipe and wsd is not None and wsd > decay:
            changes[wsd_name] = _scaled(wsd_name, wsd, ratio, 1, decay, notes)
        warmup = _setting(config, warmup_name)
        if warmup_name in from_recipe and warmup >= decay:
            changes[warmup_name] = _scaled(warmup_name, warmup, ratio, 1, decay - 1, notes)  # (still a warmup)
    return override(config, **changes) if changes else config


def _scaled(name: str, value: int, ratio: tuple[int, int, str, str], least: int, most: int, notes: list[str]) -> int:
    """`value` x run / planned, kept within [least, most], with the note that says so."""
    run, planned, run_flag, recipe = ratio
    new = min(max(round(value * run / planned), least), most)
    notes.append(
        f"{as_flag(name, value)} (from {recipe}) does not fit {run_flag}: scaled to {new} ({value} x {run}/{planned})"
    )
    return new


def _setting(config: schema.Config, name: str) -> Any:
    return getattr(getattr(config, all_fields()[name].section), name)


def as_flag(name: str, value: Any) -> str:
    """How the command line gives `value` to setting `name`: --flag VALUE, or --flag / --no-flag for a switch."""
    flag = all_fields()[name].flag
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {_shown(value)}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def explain_origins(
    message: str, origins: dict[str, str], resolved: schema.Config, current: schema.Config | None = None
) -> str:
    """`message` (a one-line error about the settings) with where those it names came from when that was not the
    command line: "... (--lr-warmup-iters 5 comes from the recipe debug)". `origins` and `resolved` are a
    `Resolution`'s; `current` what became of its config (a setting changed since, by the launcher, is not
    explained)."""
    current = current or resolved
    by_flag = {info.flag: info.name for info in all_fields().values()}
    named = [by_flag[f] for f in dict.fromkeys(re.findall(r"--[a-z0-9]+(?:-[a-z0-9]+)*", message)) if f in by_flag]
    sources = [
        f"{as_flag(name, _setting(current, name))} comes from {origins[name]}"
        for name in named
        if name in origins
        and _setting(current, name) is not None
        and _setting(current, name) == _setting(resolved, name)
    ]
    return f"{message} ({'; '.join(sources)})" if sources else message


def config_from_flat(values: dict[str, Any]) -> schema.Config:
    """A Config from {setting: value}, each value checked and converted; unset settings keep their defaults."""
    fields = all_fields()
    sections: dict[str, dict[str, Any]] = {section: {} for section in schema.SECTIONS}
    for name, value in _fold_legacy(values).items():
        info = fields.get(name)
        if info is None:
            raise ConfigError(f"{name}: unknown setting{_did_you_mean(name, fields)}")
        sections[info.section][name] = coerce(info, value, info.flag)
    defaults = schema.Config()
    config = schema.Config(
        **{section: type(getattr(defaults, section))(**values) for section, values in sections.items()}
    )
    return _steps_of_samples(config)


def _fold_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with LEGACY_SETTINGS folded into the settings they mean (use_distributed_optimizer: ZeRO stage 1
    unless a stage above 0 is given)."""
    if "use_distributed_optimizer" not in values:
        return values
    values = dict(values)
    legacy = FieldInfo("parallel", "use_distributed_optimizer", bool, True, None, False, "")
    on = coerce(legacy, values.pop("use_distributed_optimizer"), legacy.flag)
    zero = all_fields()["zero_stage"]
    if on and not coerce(zero, values.get("zero_stage", zero.default), zero.flag):
        values["zero_stage"] = 1
    return values


def _steps_of_samples(config: schema.Config) -> schema.Config:
    """With --train-samples the number of steps follows from it (and the batch schedule), as in Megatron-LM;
    with --step-batch-size-schedule and no --global-batch-size, the global batch is the schedule's last."""
    config = _global_batch_of_schedule(config)
    t = config.training
    if t.train_samples is None or not t.global_batch_size:
        return config
    schedule = batch_schedule(t, t.global_batch_size, config.data.seq_length)
    if schedule is None and (t.rampup_batch_size or t.step_batch_size_schedule):
        return config  # (refused by validation)
    iters = sample_based_train_iters(t.train_samples, t.global_batch_size, schedule)
    if iters is None:
        return config
    return dataclasses.replace(config, training=dataclasses.replace(t, train_iters=iters))


def _global_batch_of_schedule(config: schema.Config) -> schema.Config:
    """--step-batch-size-schedule without --global-batch-size: the global batch is its last batch."""
    t = config.training
    text = t.step_schedule_text()
    if text is None or t.global_batch_size is not None:
        return config
    try:
        last = step_schedule(text, config.data.seq_length).global_batch_size
    except ValueError:
        return config  # (refused by validation)
    return dataclasses.replace(config, training=dataclasses.replace(t, global_batch_size=last))


def override(config: schema.Config, **values: Any) -> schema.Config:
    """A copy of `config` with some settings changed (by field name, checked as in build_config)."""
    flat = {name: value for section in config_to_dict(config).values() for name, value in section.items()}
    return config_from_flat({**flat, **values})


def config_to_dict(config: schema.Config) -> dict[str, dict[str, Any]]:
    """Nested plain-data form (for YAML/JSON dumps and checkpoints): tuples as lists, and the settings a section
    derived as None, so that reading it back derives them again."""
    return {section: settings_of(getattr(config, section)) for section in schema.SECTIONS}


def settings_of(section: Any) -> dict[str, Any]:
    """One section's settings in plain data (see config_to_dict)."""
    derived = getattr(section, "derived", frozenset())
    return {
        f.name: None if f.name in derived else _plain(getattr(section, f.name)) for f in dataclasses.fields(section)
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


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
