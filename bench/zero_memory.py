"""Training-state memory per rank under data parallelism and ZeRO stages 1-3, against the ZeRO paper.

    .venv/bin/python bench/zero_memory.py                          # N = 1, 2, 4, 8; stages 0-3
    .venv/bin/python bench/zero_memory.py --dp 2 4 --stages 1 2
    .venv/bin/python bench/zero_memory.py --smoke                  # N = 1, 2: does it still run?

For each data-parallel size N it spawns N gloo processes on this machine; each builds the same
Llama-shaped GPT (4 layers, hidden 512, vocabulary 8192, untied input and output embeddings, about
21M parameters) at every requested ZeRO stage, runs one fp32 training step so that Adam's state
exists, and counts its training state with `paratron.parallel.data_parallel.state_memory.training_state_elements`
(exact: the tensors themselves, storage shared by views counted once). Stage 0 is plain data
parallelism (full gradient buffer, ordinary AdamW).

It writes bench/results/zero_memory.json (rank 0's figures and the maximum over ranks of every
count) and bench/results/zero_memory.md, a section ready for BENCHMARKS.md: the element counts as
multiples of psi (the model's parameter count), the bytes they would take at the ZeRO paper's
mixed-precision widths against the paper's formula, and the bytes actually held in fp32 against
the fp32 formula.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import LLAMA_SMALL, PRECISION, RESULTS, SEED, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks
from paratron.storage import write_text_atomic

MODEL = LLAMA_SMALL
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
SMOKE_MODEL |= dict(vocab_size=256)
RUN = dict(seq_length=128, micro_batch_size=2, mock_data=True, seed=SEED, ddp_bucket_size=4_000_000)
CATEGORIES = ("parameters", "gradients", "master", "optimizer_state")
FORMULAS = {
    "mixed": ("16 psi", "4 psi + 12 psi/N", "2 psi + 14 psi/N", "16 psi/N"),
    "fp32": ("16 psi", "8 psi + 8 psi/N", "4 psi + 12 psi/N", "16 psi/N"),
}


def measure(stages: list[int], shape: dict) -> list[dict]:
    """On one rank (inside a gloo world): this rank's training state at each stage after one step."""
    import torch.distributed as dist

    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel.data_parallel.state_memory import paper_bytes, training_state_elements
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import train_step

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = Topology(ParallelDims(world, tp=1, pp=1), rank)
    topology.create_groups()
    tokens = torch.randint(
        0,
        shape["vocab_size"],
        (RUN["micro_batch_size"], RUN["seq_length"] + 1),
        generator=torch.Generator().manual_seed(rank),
    )
    rows = []
    for stage in stages:
        config = build_config(dict(shape, **RUN, zero_stage=stage))
        with torch.device("meta"):
            meta = GPT(config.model)
        psi = sum(p.numel() for p in meta.parameters())
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        optimizer = build_optimizer(model, config.optimizer)
        # the gradient storage alive during backward, after each parameter's gradient has been
        # taken in (stage 2 must hold its shard plus the buckets being filled, never the full buffer)
        peak = {"bytes": 0}

        def probe(_: torch.Tensor, model: torch.nn.Module = model, peak: dict = peak) -> None:
            peak["bytes"] = max(peak["bytes"], training_state_elements(model)["gradients"]["bytes"])

        hooks = (
            [p.register_post_accumulate_grad_hook(probe) for p in model.trained_parameters]
            if model.gradients.reducer is not None
            else []
        )
        result = train_step(model, optimizer, [Batch(tokens[:, :-1], tokens[:, 1:])], Precision("fp32"), 1.0)
        for hook in hooks:
            hook.remove()
        report = training_state_elements(model, optimizer)
        reducer = model.gradients.reducer
        rows.append(
            {
                "stage": stage,
                "psi": psi,
                "loss": result.loss.item(),
                "report": report,
                "paper_bytes": paper_bytes(report),
                "backward_peak_gradient_bytes": peak["bytes"] or None,
                "buckets": len(reducer.buckets) if reducer is not None else None,
                "flat_length": reducer.total if reducer is not None else None,
                "largest_bucket": max(b.end - b.start for b in reducer.buckets) if reducer is not None else None,
            }
        )
        del model, optimizer
    dist.destroy_process_group()
    return rows


def summarize(size: int, per_rank: list[list[dict]]) -> list[dict]:
    """One entry per stage: rank 0's figures, the maximum over ranks, and the formulas."""
    from paratron.parallel.data_parallel.state_memory import zero_formula

    entries = []
    for i, first in enumerate(per_rank[0]):
        ranks = [rows[i] for rows in per_rank]
        stage, psi = first["stage"], first["psi"]
        worst = {c: {k: max(r["report"][c][k] for r in ranks) for k in ("elements", "bytes")} for c in CATEGORIES}
        worst["total_bytes"] = max(r["report"]["total_bytes"] for r in ranks)
        mixed = max(r["paper_bytes"]["total"] for r in ranks)
        mixed_formula, fp32_formula = zero_formula(stage, psi, size, "mixed"), zero_formula(stage, psi, size, "fp32")
        entries.append(
            {
                "dp": size,
                "stage": stage,
                "psi": psi,
                "buckets": first["buckets"],
                "flat_length": first["flat_length"],
                "largest_bucket": first["largest_bucket"],
                "rank0": first["report"],
                "rank0_paper_bytes": first["paper_bytes"],
                "max_over_ranks": worst,
                "elements_per_psi": {c: worst[c]["elements"] / psi for c in CATEGORIES},
                "mixed_bytes": mixed,
                "mixed_formula_bytes": mixed_formula,
                "mixed_formula": FORMULAS["mixed"][stage],
                "mixed_ratio": mixed / mixed_formula,
                "fp32_bytes": worst["total_bytes"],
                "fp32_formula_bytes": fp32_formula,
                "fp32_formula": FORMULAS["fp32"][stage],
                "fp32_ratio": worst["total_bytes"] / fp32_formula,
                "backward_peak_gradient_bytes": max(r["backward_peak_gradient_bytes"] or 0 for r in ranks) or None,
                "losses": [r["loss"] for r in ranks],
            }
        )
    return entries


def markdown(entries: list[dict], command: str) -> str:
    psi = entries[0]["psi"]
    lines = [
        "## Memory per rank under ZeRO",
        "",
        f"    {command}",
        "",
        f"Training state held by one data-parallel rank after one step (AdamW), counted tensor by tensor with "
        f"`paratron.parallel.data_parallel.state_memory.training_state_elements`: "
        f"a Llama-shaped GPT of 4 layers, hidden 512, "
        f"vocabulary 8192, untied embeddings, **psi = {psi:,} parameters**, gradient buckets of 4M elements, "
        f'N gloo processes on CPU. Element counts are multiples of psi (maximum over ranks). "Mixed" prices '
        f"those counts at the ZeRO paper's widths (2-byte parameters and gradients, 4-byte master weights, "
        f'two 4-byte Adam moments) against the paper\'s formula; "fp32" is the bytes actually allocated '
        f"(paratron trains fp32 weights, whose master weights are the parameters themselves) against the "
        f"same accounting with 4-byte parameters and gradients and no master copy.",
        "",
        "| N | stage | params | grads | master | Adam state | mixed bytes/psi | paper formula | ratio "
        "| fp32 bytes/psi | fp32 formula | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for e in entries:
        per = e["elements_per_psi"]
        lines.append(
            f"| {e['dp']} | {e['stage']} | {per['parameters']:.4f} | {per['gradients']:.4f} | {per['master']:.4f} "
            f"| {per['optimizer_state']:.4f} | {e['mixed_bytes'] / psi:.4f} | {e['mixed_formula']} = "
            f"{e['mixed_formula_bytes'] / psi:.4f} | {e['mixed_ratio']:.6f} | {e['fp32_bytes'] / psi:.4f} "
            f"| {e['fp32_formula']} = {e['fp32_formula_bytes'] / psi:.4f} | {e['fp32_ratio']:.6f} |"
        )
    worst = max(max(abs(e["mixed_ratio"] - 1), abs(e["fp32_ratio"] - 1)) for e in entries)
    lines += ["", reading(entries, worst), ""]
    return "\n".join(lines)


def reading(entries: list[dict], worst: float) -> str:
    """The short reading under the table, from the figures (not written in advance)."""
    psi = entries[0]["psi"]
    padding = max((e["flat_length"] - psi for e in entries if e["flat_length"] is not None), default=0)
    fit = (
        f"every row equals its formula to within {worst:.1e} (relative), the bucket padding: each bucket is "
        f"rounded up to a multiple of N so that it splits into equal shards (at most {padding} elements here)"
        if padding
        else "every row equals its formula exactly: with these shapes every gradient bucket "
        "already splits evenly over N, so there is no padding"
    )
    stage2 = [e for e in entries if e["stage"] == 2 and e["dp"] > 1]
    freed = all(e["max_over_ranks"]["gradients"]["elements"] * e["dp"] == e["flat_length"] for e in stage2)
    peaks = ", ".join(
        f"{e['backward_peak_gradient_bytes'] / 4 / psi:.3f} psi at N={e['dp']}"
        for e in stage2
        if e["backward_peak_gradient_bytes"]
    )
    largest = max((e["largest_bucket"] for e in stage2), default=0)
    during = (
        f" During backward its gradient storage peaked at {peaks}: the shard plus the one bucket being "
        f"filled (buckets close once they reach 4M elements; the largest, which takes in the embedding, "
        f"is {largest / psi:.3f} psi)."
        if peaks
        else ""
    )
    single = [e for e in entries if e["stage"] == 2 and e["dp"] == 1 and e["backward_peak_gradient_bytes"]]
    if single:
        during += (
            f" At N=1 stage 2 shards nothing, yet it still fills a bucket buffer and adds it into a "
            f"full-size shard: {single[0]['backward_peak_gradient_bytes'] / 4 / psi:.3f} psi of gradients "
            "during backward, against 1 psi for stages 0 and 1."
        )
    after = (
        "stage 2 also keeps only this rank's gradient shard (a bucket's full buffer lives only while it is "
        "filled and reduced; none is alive after the step)."
        if freed
        else "stage 2 should keep only this rank's gradient shard, but more gradient storage was alive after "
        "the step (see the JSON)."
    )
    return (
        f"Reading: {fit}. Stage 1 shards only the master weights and Adam state (the full gradient buffer "
        f"stays); {after}{during} Stage 3 (FSDP2) shards the parameters too. In fp32 the master weights "
        "are views of the parameters, so they cost elements but no bytes, and stage 1 saves 8 psi (1 - 1/N) "
        "bytes where the mixed-precision model promises 12 psi (1 - 1/N). Activations, communication buffers "
        "in flight and the allocator's caching are outside this count."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8], help="data-parallel sizes")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--output", type=Path, default=RESULTS / "zero_memory.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, dp=[1, 2])
    model = MODEL | SMOKE_MODEL if args.smoke else MODEL

    entries = []
    for size in args.dp:
        per_rank = run_ranks(measure, size, args.stages, model, timeout=900.0)
        entries += summarize(size, per_rank)
        for e in entries[-len(args.stages) :]:
            print(
                f"N={size} stage={e['stage']}: mixed {e['mixed_bytes'] / e['psi']:.4f} psi (formula "
                f"{e['mixed_formula_bytes'] / e['psi']:.4f}), fp32 {e['fp32_bytes'] / e['psi']:.4f} psi "
                f"(formula {e['fp32_formula_bytes'] / e['psi']:.4f})",
                flush=True,
            )
    command = "python bench/zero_memory.py" + "".join(
        f" --{flag} " + " ".join(map(str, value))
        for flag, value, default in (("dp", args.dp, [1, 2, 4, 8]), ("stages", args.stages, [0, 1, 2, 3]))
        if value != default
    )
    results = {
        "command": command,
        "model": model,
        "run": RUN,
        "precision": PRECISION,
        "optimizer": "AdamW",
        "torch": torch.__version__,
        "entries": entries,
    }
    write_text_atomic(args.output, json.dumps(results, indent=2))
    text = markdown(entries, command)
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
