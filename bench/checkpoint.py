"""Checkpoint save and load against `torch.save` / `torch.load` of the consolidated state, and the
time an asynchronous save hides.

    .venv/bin/python bench/checkpoint.py
    .venv/bin/python bench/checkpoint.py --hidden-size 768 --layers 8 --rounds 3
    .venv/bin/python bench/checkpoint.py --smoke  # tiny: does it still save, load and restore?

One process builds a GPT (default: 8 layers, hidden 512, vocabulary 32768: about 42M parameters),
runs one AdamW step so that the optimizer state exists, then, alternating in each round:

- paratron: `save_checkpoint` (weights in safetensors, optimizer pieces under single-device names,
  RNG state, meta.json with SHA-256 checksums, temporary folder renamed into place), and
  loading it back into a fresh model and optimizer (`read_checkpoint` with checksum verification,
  `load_model_weights`, `load_optimizer`);
- torch: `torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})` to one
  file and `torch.load` + `load_state_dict` (no checksums, no atomic rename);
- async: `begin_save(..., snapshot=True)` (what the training loop waits for under --async-save)
  and the background write, timed apart.

Reported: the median time of each, the bytes on disk, and the share of paratron's save time that
--async-save takes off the training loop. Writes bench/results/checkpoint.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.checkpoint.load import load_model_weights
from paratron.checkpoint.optimizer_state import load_optimizer
from paratron.checkpoint.save import BackgroundSave, CheckpointContent, begin_save, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.distributed import rng
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.batch import Batch
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.parallel import parallelize
from paratron.storage import write_text_atomic


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _trained(config):
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    optimizer = build_optimizer(model, config.optimizer)
    ids = torch.randint(0, config.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    model.forward_backward([Batch(ids[:, :-1], ids[:, 1:])])
    optimizer.prepare_grads()
    optimizer.step()
    optimizer.after_step()
    return model, optimizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--directory", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--output", type=Path, default=RESULTS / "checkpoint.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, layers=2, hidden_size=64, vocab_size=256, rounds=1)
    config = build_config(
        dict(
            num_layers=args.layers,
            hidden_size=args.hidden_size,
            num_attention_heads=8,
            vocab_size=args.vocab_size,
            seq_length=64,
            max_position_embeddings=64,
            mock_data=True,
            untie_embeddings_and_output_weights=True,
            seed=1,
        )
    )
    model, optimizer = _trained(config)
    params = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(dir=args.directory))
    times: dict[str, list[float]] = {
        k: []
        for k in ("paratron_save", "paratron_load", "torch_save", "torch_load", "async_blocking", "async_background")
    }
    sizes = {}
    try:
        for round_ in range(args.rounds):
            target = work / f"p{round_}"
            started = time.perf_counter()
            save_checkpoint(
                target,
                CheckpointContent(
                    1, 0, config, model.module, optimizer, rank_state={"rng": rng.capture(torch.device("cpu"))}
                ),
            )
            times["paratron_save"].append(time.perf_counter() - started)
            sizes["paratron"] = _size(target / "iter_0000001")

            fresh, fresh_optimizer = _trained(config)
            started = time.perf_counter()
            info = read_checkpoint(target)
            load_model_weights(info, fresh.module)
            load_optimizer(info.path, fresh_optimizer, fresh.module)
            times["paratron_load"].append(time.perf_counter() - started)
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
            assert same, "paratron's load did not restore the weights"

            file = work / f"t{round_}.pt"
            started = time.perf_counter()
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, file)
            times["torch_save"].append(time.perf_counter() - started)
            sizes["torch"] = _size(file)
            fresh, fresh_optimizer = _trained(config)
            started = time.perf_counter()
            state = torch.load(file, weights_only=True)
            fresh.module.load_state_dict(state["model"])
            fresh_optimizer.load_state_dict(state["optimizer"])
            times["torch_load"].append(time.perf_counter() - started)

            target = work / f"a{round_}"
            started = time.perf_counter()
            pending = begin_save(target, CheckpointContent(1, 0, config, model.module, optimizer), snapshot=True)
            background = BackgroundSave(pending)
            blocking = time.perf_counter() - started
            background.thread.join()  # (in training, the steps run meanwhile)
            times["async_background"].append(time.perf_counter() - started)
            started = time.perf_counter()
            background.finish()  # publishing: on the training thread, at the next save or the end
            times["async_blocking"].append(blocking + time.perf_counter() - started)
            for path in (work / f"p{round_}", work / f"a{round_}", file):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    hidden = 1 - median["async_blocking"] / median["paratron_save"]
    command = "python bench/checkpoint.py" + "".join(
        f" --{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("output", "directory", "smoke") and v != parser.get_default(k)
    )
    payload = {
        "command": command,
        "parameters": params,
        "times": times,
        "median": median,
        "bytes": sizes,
        "async_hidden_share": hidden,
        "torch": torch.__version__,
    }
    lines = [
        "## Checkpoints against torch.save",
        "",
        f"`{command}` (writes bench/results/checkpoint.json): one process, a {params / 1e6:.1f}M-parameter GPT "
        f"({args.layers} layers, hidden {args.hidden_size}, vocabulary {args.vocab_size}, untied) after one AdamW "
        f"step, fp32; median of {args.rounds} alternating rounds on this machine's disk. paratron's save includes "
        "SHA-256 checksums of every file and the atomic rename; its load verifies them and reads every tensor "
        "as boxes of the single-device tensor (the path that loads at any layout).",
        "",
        "| | paratron | torch.save / torch.load | paratron / torch |",
        "|---|---:|---:|---:|",
        f"| save (s) | {median['paratron_save']:.3f} | {median['torch_save']:.3f} | "
        f"{median['paratron_save'] / median['torch_save']:.2f} |",
        f"| load (s) | {median['paratron_load']:.3f} | {median['torch_load']:.3f} | "
        f"{median['paratron_load'] / median['torch_load']:.2f} |",
        f"| size (MB) | {sizes['paratron'] / 1e6:.1f} | {sizes['torch'] / 1e6:.1f} | "
        f"{sizes['paratron'] / sizes['torch']:.3f} |",
        "",
        f"--async-save: the training loop waits {median['async_blocking']:.3f} s (copying the weights and "
        f"optimizer state, then publishing at the next save) instead of {median['paratron_save']:.3f} s; the "
        f"files and their checksums take {median['async_background']:.3f} s in the background: {hidden:.0%} of "
        "the save time is taken off the training loop.",
    ]
    text = "\n".join(lines) + "\n"
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
