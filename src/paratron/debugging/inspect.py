"""`paratron inspect CKPT [--diff CKPT2] [--json] [--tensors all|none|N] [--no-verify]`: what a checkpoint holds.

Where it came from (paratron, Megatron-LM, Hugging Face; which iteration of a save directory, as --load takes it),
its model and the settings that differ from the defaults, the layout it was saved at, step and consumed samples,
precision, tokenizer, optimizer and resume state, every file against its recorded checksum, and a table of its
tensors (single-device name, shape, dtype, a checksum of the values). With --diff, the files of both are verified
(while the tensors are compared) unless --no-verify. Exit status: 0, 1 when a file fails its checksum (or, with
--diff, when the two differ, as `diff`), 2 for a path that is no checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratron.config.schema import Config
from paratron.debugging.checkpoint_view import MISMATCH, VERIFIED, CheckpointView, open_view, verify_files
from paratron.debugging.inspect_diff import diff_lines, diff_record, diff_views, dtype_name, flat_settings, natural_key
from paratron.errors import CheckpointError, UserError

DEFAULT_TENSORS = 40
"""Tensor rows shown without --tensors."""


@dataclass
class TensorRow:
    """One tensor as the table shows it."""

    name: str
    shape: list[int]
    dtype: str
    checksum: str
    """The first 16 hex digits of the sha256 of its values' bytes (the same at any layout the checkpoint was saved
    at: the tensor is assembled whole first)."""
    check: str
    """verified or MISMATCH (the recorded checksums of the files holding it), or empty where none are recorded."""


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order, 16 hex digits."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.cpu().numpy()).hexdigest()[:16]  # (the array's buffer, not a copy of it)


def tensor_rows(view: CheckpointView, limit: int | None) -> tuple[list[TensorRow], int]:
    """The first `limit` tensors (None: all) in name order, each read whole, summed and let go; and how many there
    are in all."""
    status = {f.name: f.status for f in view.files}
    rows = []
    with view.open_tensors() as tensors:
        names = sorted(tensors.names(), key=natural_key)
        for name in names if limit is None else names[:limit]:
            t = tensors.whole(name)
            files = view.tensor_files.get(name) or (["model.safetensors"] if "model.safetensors" in status else [])
            checks = {status.get(file, "") for file in files}
            check = MISMATCH if MISMATCH in checks else VERIFIED if checks == {VERIFIED} else ""
            rows.append(TensorRow(name, list(t.shape), dtype_name(t), tensor_checksum(t), check))
    return rows, len(names)


def main_settings(config: Config, view: CheckpointView) -> dict[str, Any]:
    """The model's main facts (what a reader asks first)."""
    m = config.model
    architecture = (
        f"{m.position_embedding_type} positions, {m.normalization}, {m.activation}, "
        f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'} embeddings"
    )
    facts: dict[str, Any] = {
        "architecture": architecture,
        "layers": m.num_layers,
        "hidden": m.hidden_size,
        "ffn hidden": m.ffn_hidden_size,
        "heads": m.num_attention_heads,
        "kv heads": m.num_query_groups or m.num_attention_heads,
        "vocab": m.vocab_size,
        "seq length": config.data.seq_length if view.source != "hf" else m.max_position_embeddings,
    }
    if m.num_experts:
        facts["experts"] = f"{m.num_experts} (top-{m.moe_router_topk})"
    if m.has_vision:
        facts["vision"] = f"{m.vision_model or 'own encoder'}, {m.vision_num_layers} layers"
    if m.lora_rank is not None:
        facts["lora"] = f"rank {m.lora_rank} on {','.join(m.lora_targets)}"
    return facts


def non_default_settings(config: Config, source: str) -> dict[str, Any]:
    """Every setting whose value is not paratron's default (the run directory and paths included); of a foreign
    checkpoint, which records a model and no run, the model's alone."""
    defaults = flat_settings(Config())
    sections = None if source == "paratron" else ("model.",)
    return {
        key: value
        for key, value in flat_settings(config).items()
        if defaults.get(key) != value and (sections is None or key.startswith(sections))
    }


def record(view: CheckpointView, rows: list[TensorRow], total: int) -> dict[str, Any]:
    """Every fact of one checkpoint, JSON-ready (what --json prints, what the text shows)."""
    return {
        "path": str(view.path),
        "given": str(view.given),
        "source": view.source,
        "iteration": view.iteration,
        "consumed_samples": view.consumed_samples,
        "other_iterations": view.other_iterations,
        "model": main_settings(view.config, view),
        "settings": non_default_settings(view.config, view.source),
        "layout": view.layout,
        "precision": view.precision,
        "tokenizer": view.tokenizer,
        "optimizer": view.optimizer,
        "training_state": view.training_state,
        "files": [vars(f) for f in view.files],
        "tensor_count": total if total >= 0 else None,
        "tensors": [vars(r) for r in rows],
        "notes": view.notes,
        "damaged": [f"{f.name} ({f.status})" for f in view.damaged],
    }


def text_lines(facts: dict[str, Any]) -> list[str]:
    """The human-readable report of `record`'s facts."""
    where = facts["source"] + (f", iteration {facts['iteration']}" if facts["iteration"] is not None else "")
    lines = [f"checkpoint: {facts['path']} ({where})"]
    if facts["other_iterations"]:
        lines.append(f"  shown: the one --load takes; also here: {', '.join(facts['other_iterations'])}")
    if facts["iteration"] is not None:
        lines.append(f"step: {facts['iteration']}, consumed samples: {facts['consumed_samples']}")
    lines += [f"note: {note}" for note in facts["notes"]]
    lines.append("model: " + ", ".join(f"{k} {v}" for k, v in facts["model"].items()))
    lines.append(f"settings not at their defaults ({len(facts['settings'])}):")
    lines += [f"  {key} = {value!r}" for key, value in facts["settings"].items()]
    lines.append(
        "layout: " + ", ".join(f"{k} {v}" for k, v in facts["layout"].items()) if facts["layout"] else "layout: -"
    )
    lines.append(f"precision: {facts['precision']}")
    lines.append(f"tokenizer: {facts['tokenizer'] or 'none saved'}")
    optimizer = facts["optimizer"]
    lines.append(
        "optimizer: " + ", ".join(f"{k} {v}" for k, v in optimizer.items()) + " (tensors per state)"
        if optimizer
        else "optimizer: none (weights only)"
    )
    if facts["training_state"]:
        lines.append("training state: " + "; ".join(facts["training_state"]))
    lines.append(f"files ({len(facts['files'])}):")
    lines += [f"  {f['status']:<11} {_size(f['size']):>9}  {f['name']}" for f in facts["files"]]
    lines += _tensor_table(facts["tensors"], -1 if facts["tensor_count"] is None else facts["tensor_count"])
    damaged = facts["damaged"]
    lines.append(f"DAMAGED: {', '.join(damaged)}" if damaged else "intact")
    return lines


def _tensor_table(rows: list[dict[str, Any]], total: int) -> list[str]:
    if total < 0:
        return ["tensors: unreadable (see the note above)"]
    lines = [
        f"tensors: {total}"
        + (f" (first {len(rows)} shown; --tensors all lists every one)" if len(rows) < total else "")
    ]
    if rows:
        width = max(len(r["name"]) for r in rows)
        lines.append(f"  {'name':<{width}}  {'shape':<18} {'dtype':<9} {'sha256[:16]':<16}  its file's checksum")
        lines += [
            f"  {r['name']:<{width}}  {str(r['shape']):<18} {r['dtype']:<9} {r['checksum']:<16}  {r['check']}"
            for r in rows
        ]
    return lines


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def parse_tensor_limit(value: str) -> int | None:
    """--tensors: all (None), none (0) or a count."""
    if value == "all":
        return None
    if value == "none":
        return 0
    if value.isdigit():
        return int(value)
    raise UserError(f"--tensors {value}: give all, none or a number of tensors to list")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratron inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a --save folder (or one iter_* folder), Megatron-LM or HF folder")
    p.add_argument("--diff", type=Path, metavar="CKPT2", help="compare with this checkpoint, tensor by tensor")
    p.add_argument("--json", action="store_true", help="print the facts as JSON (for scripts)")
    p.add_argument("--tensors", default=str(DEFAULT_TENSORS), help=f"all, none or N rows (default {DEFAULT_TENSORS})")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the files' checksums (of both, with --diff): a little faster"
    )
    return p


def run_inspect(argv: list[str]) -> int:
    """The `paratron inspect` command: print, return the exit status (bad input raises `UserError`)."""
    args = parser().parse_args(argv)
    limit = parse_tensor_limit(args.tensors)
    if args.diff is not None:
        return run_diff(args.checkpoint, args.diff, verify=not args.no_verify, limit=limit, as_json=args.json)
    view = open_view(args.checkpoint, verify=not args.no_verify)
    try:
        rows, total = tensor_rows(view, limit)
    except CheckpointError as error:
        if not view.damaged:
            raise
        view.notes.append(f"tensors unreadable: {error}")
        rows, total = [], -1
    facts = record(view, rows, total)
    _print(facts if args.json else text_lines(facts), args.json)
    return 1 if facts["damaged"] else 0


def run_diff(path_a: Path, path_b: Path, verify: bool, limit: int | None, as_json: bool) -> int:
    """`inspect A --diff B`: the tensors compared pair by pair while a second thread checks both checkpoints' files
    against their recorded sha256 (hashing and torch let each other run: the check costs little wall time). Exit
    status 1 where they differ or a file is damaged."""
    a, b = open_view(path_a, verify=False), open_view(path_b, verify=False)
    with ThreadPoolExecutor(max_workers=1) as pool:
        verifying = pool.submit(lambda: (verify_files(a), verify_files(b))) if verify else None
        try:
            diff = diff_views(a, b)
        except CheckpointError as error:
            if verifying is not None:
                verifying.result()
            damaged = [f"{view.path / f.name} ({f.status})" for view in (a, b) for f in view.damaged]
            if damaged:
                raise CheckpointError(f"{', '.join(damaged)}: fails its recorded checksum ({error})") from None
            raise
        if verifying is not None:
            verifying.result()
    _print(diff_record(a, b, diff) if as_json else diff_lines(a, b, diff, limit), as_json)
    return 0 if diff.identical and not (a.damaged or b.damaged) else 1


def _print(what: Any, as_json: bool) -> None:
    text = json.dumps(what, indent=1, default=str) if as_json else "\n".join(what)
    sys.stdout.write(text + "\n")
