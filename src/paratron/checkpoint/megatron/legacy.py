"""Megatron-LM's legacy `torch` format: `latest_checkpointed_iteration.txt`,
`iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt` (or `release/`), one pickle per model-parallel
rank. Read at any tensor- and pipeline-parallel size (virtual stages included), the model's tensors
and the non-distributed optimizer's Adam state (its parameter indices matched to names through
Megatron's standard weight-decay groups); written at a chosen TP/PP with the local layer spec's names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from paratron.checkpoint.converted import Converted, ConvertOptions
from paratron.checkpoint.files import TRACKER
from paratron.checkpoint.megatron.locate import MEGATRON_FILE, MegatronCheckpoint, legacy_pp, rank_file
from paratron.checkpoint.megatron.settings import megatron_args, padded_vocab
from paratron.checkpoint.megatron.tensor_layout import (
    LAYER,
    LINEAR_MODULES,
    Shapes,
    from_paratron,
    merge_tp,
    split_tp,
    to_paratron,
)
from paratron.checkpoint.megatron.unpickle import safe_load
from paratron.config.schema import ModelConfig
from paratron.data.tokenizer import export_tokenizer
from paratron.errors import CheckpointError
from paratron.storage import FOLDER_SLACK, new_folder, save_object, tensor_bytes


def legacy_files(ckpt: MegatronCheckpoint) -> dict[tuple[int, int], dict[str, Any]]:
    """Every rank file of a legacy checkpoint, read once (the weights and the optimizer state both need them)."""
    if ckpt.loaded is None:
        ckpt.loaded = _read_rank_files(ckpt)
    return ckpt.loaded


def _read_rank_files(ckpt: MegatronCheckpoint) -> dict[tuple[int, int], dict[str, Any]]:
    """Every rank file of a legacy checkpoint, by (TP rank, PP stage), checked to hold a megatron-core model."""
    a = ckpt.args
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    pipelined = legacy_pp(ckpt.folder) > 1 or pp > 1
    files = {}
    for stage in range(pp):
        for rank in range(tp):
            first = (rank, stage) == (0, 0)
            loaded = ckpt.common if first else safe_load(rank_file(ckpt.folder, rank, stage, pipelined))
            if not isinstance(loaded, dict) or not chunk_keys(loaded):
                raise CheckpointError(f"{ckpt.folder}: rank ({rank}, {stage}) holds no model state")
            if float(loaded.get("checkpoint_version", 0)) < 3.0:
                raise CheckpointError(
                    f"{ckpt.folder}: checkpoint_version {loaded.get('checkpoint_version')} predates megatron-core's "
                    "GPTModel (3.0); only megatron-core GPT checkpoints are read"
                )
            files[(rank, stage)] = loaded
    return files


def chunk_keys(loaded: dict[str, Any]) -> list[str]:
    """`model`, or `model0`, `model1`, ... under virtual pipeline stages, in order."""
    return sorted((k for k in loaded if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))


def chunk_parameters(chunk: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A model chunk's tensors in its state_dict order (which is megatron-core's parameter order)."""
    names = {n: t for n, t in chunk.items() if not n.endswith("_extra_state") and isinstance(t, torch.Tensor)}
    if any(n.startswith("language_model.") for n in names):
        raise CheckpointError("a legacy Megatron model (language_model.*); only megatron-core's GPTModel is read")
    return names


def merge_legacy(files: dict[tuple[int, int], dict[str, Any]], pick: Any, gated: bool) -> dict[str, torch.Tensor]:
    """Tensors `pick((TP rank, stage), chunk index)` gives per rank, merged: TP slices joined, local layer
    numbers made global (virtual chunk outer, stage inner: Megatron's layer order)."""
    per_chunk: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for key, loaded in sorted(files.items(), key=lambda item: (item[0][1], item[0][0])):
        for v, _ in enumerate(chunk_keys(loaded)):
            per_chunk.setdefault((v, key[1]), []).append(pick(key, v))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for v, stage in sorted(per_chunk):
        ranks = per_chunk[(v, stage)]
        layers = {int(m.group(1)) for n in chunk_parameters(files[(0, stage)][chunk_keys(files[(0, stage)])[v]])
                  if (m := LAYER.match(n))}  # fmt: skip
        for name in ranks[0]:
            merged = merge_tp(name, [r[name] for r in ranks], gated)
            layer = LAYER.match(name)
            if layer:
                name = f"decoder.layers.{int(layer.group(1)) + offset}.{layer.group(2)}"
            if name == "output_layer.weight" and name in out:
                continue
            out[name] = merged
        offset += len(layers)
    return out


def legacy_weights(ckpt: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    """The model's tensors of a legacy checkpoint, merged over its rank files (Megatron's names)."""
    files = legacy_files(ckpt)
    try:
        return merge_legacy(
            files, lambda key, v: chunk_parameters(files[key][chunk_keys(files[key])[v]]), bool(ckpt.args.get("swiglu"))
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{ckpt.folder}: {exc}") from None


def legacy_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam's moments (and fp32 masters) of a legacy checkpoint's non-distributed optimizer, under
    paratron's names; None when there are none (or they cannot be told apart by name)."""
    files = legacy_files(ckpt)
    per_rank = {key: _rank_optimizer(loaded) for key, loaded in files.items()}
    if any(state is None for state in per_rank.values()):
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for state in ("exp_avg", "exp_avg_sq", "master"):
        if all(state in part[0] for part in per_rank.values()):
            merged = merge_legacy(files, lambda key, v, s=state: per_rank[key][v][s], m.activation == "swiglu")
            out[state] = to_paratron(merged, m, str(ckpt.folder))
    if "exp_avg" not in out or "exp_avg_sq" not in out:
        return None  # (not Adam)
    steps = [t for part in per_rank.values() for chunk in part for t in chunk.get("step", {}).values()]
    out["step"] = {str(i): t.reshape(1).float() for i, t in enumerate(steps[:1])}
    return out


def _rank_optimizer(loaded: dict[str, Any]) -> list[dict[str, dict[str, torch.Tensor]]] | None:
    """One rank file's optimizer state per model chunk: state -> {Megatron name: local tensor}.

    The optimizer numbers parameters group by group, each group in megatron-core's parameter order;
    Megatron's standard groups split them by weight decay (biases and 1-D parameters have none), so
    each group's members follow from the names. Any other grouping returns None."""
    wrapper = loaded.get("optimizer")
    if not isinstance(wrapper, dict):
        return None
    inner = wrapper.get("optimizer", wrapper)
    if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
        return None
    masters = wrapper.get("fp32_from_fp16_params")
    chunks = [chunk_parameters(loaded[k]) for k in chunk_keys(loaded)]
    everything = [(v, n, t) for v, chunk in enumerate(chunks) for n, t in chunk.items()]
    no_decay = [(v, n) for v, n, t in everything if n.endswith(".bias") or t.dim() == 1]
    decay = [(v, n) for v, n, t in everything if not (n.endswith(".bias") or t.dim() == 1)]
    groups = inner["param_groups"]
    kinds = [float(g.get("wd_mult", 1.0)) == 0.0 for g in groups]
    if len(set(kinds)) != len(kinds):
        return None  # (more groups than the two standard ones: decoupled learning rates, overrides)
    out: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in chunks]
    for g, (group, no_wd) in enumerate(zip(groups, kinds)):
        members = no_decay if no_wd else decay
        if len(group["params"]) != len(members):
            return None
        for position, (index, (v, name)) in enumerate(zip(group["params"], members)):
            for key, value in inner["state"].get(index, {}).items():
                if key in ("exp_avg", "exp_avg_sq"):
                    out[v].setdefault(key, {})[name] = value
                elif key == "step":
                    out[v].setdefault("step", {})[name] = torch.as_tensor(value)
            if masters is not None:
                out[v].setdefault("master", {})[name] = masters[g][position]
    return out


# ---------------------------------------------------------------- writing

MEGATRON_CHECKPOINT = "the Megatron-LM checkpoint"
"""What a full disk's line says the conversion to Megatron-LM was writing."""


def write_megatron(model: Converted, destination: Path, options: ConvertOptions) -> Path:
    """Write a Megatron-LM legacy (`torch`) checkpoint of a converted model's weights at the options'
    tensor- and pipeline-parallel sizes, local layer-spec names, with the tracker file and an `args`
    Namespace of the model's architecture; the source's tokenizer, if it has one, goes into DST/tokenizer,
    which the args name (HuggingFaceTokenizer). Returns the iteration folder."""
    m = model.config.model
    tp, pp = options.tensor_parallel, options.pipeline_parallel
    _refuse_unwritable(model, tp, pp)
    padded = padded_vocab(m.vocab_size or 0, m.make_vocab_size_divisible_by, tp)
    with model.open_tensors() as tensors:
        state = {name: tensors.whole(name) for name in tensors.names()}
    whole = from_paratron(state, m, padded)
    args = megatron_args(model.config, tp, pp, padded, model.iteration, model.consumed_samples)
    needed = tensor_bytes(whole) + FOLDER_SLACK * tp * pp
    with new_folder(MEGATRON_CHECKPOINT, destination, needed, options.fix) as tmp:
        folder = tmp / f"iter_{model.iteration:07d}"
        if model.tokenizer_file is not None:  # as Megatron-LM's HuggingFaceTokenizer reads a folder
            (tmp / "tokenizer").mkdir()
            export_tokenizer(model.tokenizer_file.parent, tmp / "tokenizer")
            args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", str(destination.resolve() / "tokenizer")
        _write_ranks(folder, whole, m, tp, pp, {"args": args, "checkpoint_version": 3.0, "iteration": model.iteration})
        (tmp / TRACKER).write_text(f"{model.iteration}\n", encoding="utf-8")
    return destination / folder.name


def _refuse_unwritable(model: Converted, tp: int, pp: int) -> None:
    """What Megatron-LM's GPT checkpoints cannot hold, or a layout that does not divide the model."""
    m = model.config.model
    if tp < 1 or pp < 1:
        raise CheckpointError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1")
    if m.num_experts or m.lora_rank is not None or m.attention_type != "causal":
        raise CheckpointError(f"{model.path}: MoE, LoRA and non-causal attention models are not written to Megatron-LM")
    s = Shapes.of(m)
    if s.groups % tp or m.num_attention_heads % tp or m.ffn_hidden_size % tp:
        raise CheckpointError(
            f"--target-tensor-parallel-size {tp} must divide the query groups ({s.groups}), heads and FFN width"
        )
    if m.num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} must divide the {m.num_layers} layers")


def _write_ranks(
    folder: Path, whole: dict[str, torch.Tensor], m: ModelConfig, tp: int, pp: int, common: dict[str, Any]
) -> None:
    """One `mp_rank_TT[_PPP]/model_optim_rng.pt` per (TP rank, stage): its slice of its stage's tensors."""
    gated = Shapes.of(m).gated
    per_stage = m.num_layers // pp
    for stage in range(pp):
        stage_state = _stage(whole, m, stage, pp, per_stage)
        for rank in range(tp):
            tensors = {}
            for name, tensor in stage_state.items():
                if name.endswith("._extra_state"):
                    tensors[name] = None
                else:
                    tensors[name] = split_tp(name, tensor, tp, gated)[rank].clone()
            name = f"mp_rank_{rank:02d}_{stage:03d}" if pp > 1 else f"mp_rank_{rank:02d}"
            (folder / name).mkdir(parents=True)
            save_object({**common, "model": tensors}, folder / name / MEGATRON_FILE)


def _stage(whole: dict[str, torch.Tensor], m: ModelConfig, stage: int, pp: int, per_stage: int) -> dict[str, Any]:
    """One pipeline stage's tensors under its local layer numbers, with the local spec's (empty)
    `_extra_state` entries of each linear layer, in megatron-core's state_dict order."""
    first, last = stage == 0, stage == pp - 1
    out: dict[str, Any] = {}
    if first:
        out.update({k: v for k, v in whole.items() if k.startswith("embedding.")})
    for local in range(per_stage):
        prefix = f"decoder.layers.{stage * per_stage + local}."
        for name, tensor in whole.items():
            if name.startswith(prefix):
                out[f"decoder.layers.{local}." + name[len(prefix) :]] = tensor
        for linear in LINEAR_MODULES:
            out[f"decoder.layers.{local}.{linear}._extra_state"] = None
    if last:
        out.update({k: v for k, v in whole.items() if k.startswith("decoder.final_layernorm.")})
        if m.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = whole["output_layer.weight"]
        elif pp > 1:  # (megatron-core's last stage keeps its own copy of the tied embedding)
            out["output_layer.weight"] = whole["embedding.word_embeddings.weight"]
        out["output_layer._extra_state"] = None
    return out
