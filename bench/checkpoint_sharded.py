"""Per-rank save and load of a checkpoint at several layouts: time and peak memory on each rank,
against the rank's shard and the model's largest tensor, and the save against
`torch.distributed.checkpoint` (DCP) saving the same state.

    .venv/bin/python bench/checkpoint_sharded.py
    .venv/bin/python bench/checkpoint_sharded.py --layouts tp4 zero3-dp4 --rounds 2
    .venv/bin/python bench/checkpoint_sharded.py --smoke  # a tiny model at TP 2: does it still run?

For each layout (TP1 on one process, TP2, TP4, ZeRO-3 over four data-parallel ranks), gloo
processes on this machine build the same GPT (default about 46M parameters: 4 layers, hidden
512, SwiGLU 1536, vocabulary 32768, untied; each embedding is 67 MB in fp32), take one AdamW
step, then in each round:

- paratron: `save_checkpoint` (each rank writes its boxes of the weights and of Adam's state,
  with SHA-256 checksums, the indexes, the atomic rename), then, after a barrier, loading it
  back at the same layout (`read_checkpoint` with checksum verification, `load_model_weights`,
  `load_optimizer`, each rank reading only its boxes);
- DCP: `torch.distributed.checkpoint.save` of the same tensors under the same keys (the rank's
  weight and optimizer boxes, taken the same way), to its own folder.

Peak memory is the rise of the process's resident high-water mark over its resident size at the
start of the operation (the mark is reset through /proc/self/clear_refs, so it is the
operation's own peak). DCP is timed twice: as it comes (`FileSystemWriter` fsyncs every file)
and with `sync_files=False`, as paratron writes (checksums instead). Reported per layout: the
slowest rank's times and the largest rank's peak, shard and file. Writes
bench/results/checkpoint_sharded.json and .md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import LLAMA_SMALL, RESULTS, SEED, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks
from paratron.storage import write_text_atomic

MODEL = LLAMA_SMALL | dict(vocab_size=32768, max_position_embeddings=128)  # each embedding 67 MB in fp32
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
SMOKE_MODEL |= dict(vocab_size=256)
RUN = dict(seq_length=64, micro_batch_size=1, mock_data=True, seed=SEED)
LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp4": (4, dict(tensor_model_parallel_size=4)),
    "zero3-dp4": (4, dict(zero_stage=3)),
}
MIB = 2**20


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class Peak:
    """The rise of resident memory during a `with` block (Linux: VmHWM, reset on entry)."""

    def __enter__(self) -> Peak:
        Path("/proc/self/clear_refs").write_text("5")
        self.base = _kib("VmRSS")
        self.started = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.rise = _kib("VmHWM") - self.base


def measure(settings: dict, directory: str, rounds: int) -> dict:
    """On one rank of a gloo world: build, step, then save / load / DCP-save `rounds` times."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from paratron.checkpoint.load import load_model_weights, weight_catalog
    from paratron.checkpoint.optimizer_state import load_optimizer, optimizer_snapshot
    from paratron.checkpoint.save import CheckpointContent, save_checkpoint, weight_boxes
    from paratron.checkpoint.verify import read_checkpoint
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed import rng
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import Axis, ParallelDims, Topology
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.parallel import parallelize
    from paratron.parallel.data_parallel.fully_sharded import local_tensor
    from paratron.parallel.sharding import full_shape

    ctx = initialize("gloo")  # (one process: no process group)
    config = build_config(dict(MODEL, **RUN, **settings))
    world, rank = ctx.world_size, ctx.rank

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    topology = Topology(ParallelDims.from_config(world, config.parallel), rank)
    topology.create_groups()
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    optimizer = build_optimizer(model, config.optimizer)
    ids = torch.randint(
        0, config.model.vocab_size, (1, RUN["seq_length"] + 1), generator=torch.Generator().manual_seed(0)
    )
    model.forward_backward([Batch(ids[:, :-1], ids[:, 1:])])
    optimizer.prepare_grads()
    optimizer.step()
    optimizer.after_step()
    params = list(model.module.parameters())
    state_tensors = [v for s in optimizer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    shard = sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in params + state_tensors)
    largest = max(torch.Size(full_shape(p)).numel() * p.element_size() for p in params)
    sharded = config.parallel.zero_stage > 0 and topology.size(Axis.DP_CP) > 1
    kinds = ("save", "load", "dcp_save", "dcp_nosync")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    peaks: dict[str, list[int]] = {kind: [] for kind in kinds}
    written = 0
    root = Path(directory)
    for round_ in range(rounds):
        target = root / f"paratron{round_}"
        barrier()
        content = CheckpointContent(
            1, 0, config, model.module, optimizer, rank_state={"rng": rng.capture(torch.device("cpu"))}
        )
        with Peak() as save:
            save_checkpoint(target, content, topology)
        folder = target / "iter_0000001"
        suffix = f"tp{topology.tp_rank:03d}_pp000_dp{topology.local_rank(Axis.DP_CP):03d}.safetensors"
        mine = [p for p in folder.iterdir() if p.name.endswith(suffix) or (world == 1 and p.suffix == ".safetensors")]
        written = sum(p.stat().st_size for p in mine)
        barrier()
        with Peak() as load:
            info = read_checkpoint(target)
            load_model_weights(info, model.module)
            with weight_catalog(info) as weights:
                load_optimizer(info.path, optimizer, model.module, weights)
        barrier()
        measured = {"save": save, "load": load}
        for kind, sync in (("dcp_save", True), ("dcp_nosync", False)):  # (DCP fsyncs its files by default)
            barrier()
            with Peak() as dcp_save:
                state, _ = weight_boxes(model.module, topology)
                snapshot = optimizer_snapshot(optimizer, model.module, topology, sharded)
                state.update({f"optimizer/{key}": value for key, value in snapshot.tensors.items()})
                folder = root / f"{kind}{round_}"
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=sync))
            del state, snapshot
            measured[kind] = dcp_save
        for kind, result in measured.items():
            times[kind].append(result.seconds)
            peaks[kind].append(result.rise)
        barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            shutil.rmtree(root / f"dcp_save{round_}", ignore_errors=True)
            shutil.rmtree(root / f"dcp_nosync{round_}", ignore_errors=True)
    return {"times": times, "peaks": peaks, "shard": shard, "largest": largest, "written": written}


def summarize(name: str, world: int, per_rank: list[dict]) -> dict:
    median = {
        kind: statistics.median(
            max(r["times"][kind][i] for r in per_rank) for i in range(len(per_rank[0]["times"][kind]))
        )
        for kind in ("save", "load", "dcp_save", "dcp_nosync")
    }
    return {
        "layout": name,
        "world": world,
        "save_s": median["save"],
        "load_s": median["load"],
        "dcp_save_s": median["dcp_save"],
        "dcp_nosync_s": median["dcp_nosync"],
        "save_peak": max(max(r["peaks"]["save"]) for r in per_rank),
        "load_peak": max(max(r["peaks"]["load"]) for r in per_rank),
        "dcp_peak": max(max(r["peaks"]["dcp_save"]) for r in per_rank),
        "shard": max(r["shard"] for r in per_rank),
        "written": max(r["written"] for r in per_rank),
        "largest": per_rank[0]["largest"],
    }


def markdown(rows: list[dict], command: str, rounds: int) -> str:
    lines = [
        "## Sharded checkpoints: per-rank save and load",
        "",
        f"`{command}` (writes bench/results/checkpoint_sharded.json): gloo processes on this 2-core machine, "
        "a 46M-parameter GPT (4 layers, hidden 512, SwiGLU 1536, vocabulary 32768, untied: each embedding "
        f"{rows[0]['largest'] / MIB:.0f} MiB in fp32) after one AdamW step, fp32; median over {rounds} rounds "
        "of the slowest rank's time, and the largest rank's peak. Peak: the rise of the rank's resident "
        "high-water mark during the operation. Shard: the rank's weights and optimizer state in memory; "
        "file: what the rank wrote.",
        "",
        "| layout | ranks | shard (MiB) | file (MiB) | save (s) | save peak (MiB) | load (s) | load peak (MiB) "
        "| DCP save (s) | DCP peak (MiB) | save / DCP | DCP without fsync (s) | save / DCP without fsync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['shard'] / MIB:.0f} | {r['written'] / MIB:.0f} | {r['save_s']:.3f} "
            f"| {r['save_peak'] / MIB:.0f} | {r['load_s']:.3f} | {r['load_peak'] / MIB:.0f} | {r['dcp_save_s']:.3f} "
            f"| {r['dcp_peak'] / MIB:.0f} | {r['save_s'] / r['dcp_save_s']:.2f} | {r['dcp_nosync_s']:.3f} "
            f"| {r['save_s'] / r['dcp_nosync_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--directory", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--output", type=Path, default=RESULTS / "checkpoint_sharded.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, layouts=["tp2"], rounds=1)
    model = SMOKE_MODEL if args.smoke else {}

    rows = []
    for name in args.layouts:
        world, settings = LAYOUTS[name]
        work = Path(tempfile.mkdtemp(dir=args.directory))
        try:
            per_rank = run_ranks(measure, world, model | settings, str(work), args.rounds, timeout=1800.0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append(summarize(name, world, per_rank))
        print(json.dumps(rows[-1]), flush=True)
    command = (
        "python bench/checkpoint_sharded.py"
        + (f" --layouts {' '.join(args.layouts)}" if args.layouts != list(LAYOUTS) else "")
        + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    )
    payload = {"command": command, "model": MODEL | model, "run": RUN, "torch": torch.__version__, "rows": rows}
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    text = markdown(rows, command, args.rounds)
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
