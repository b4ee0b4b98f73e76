"""Activation memory per transformer layer, counted exactly, against Korthikanti et al. (2022).

    .venv/bin/python bench/activation_memory.py
    .venv/bin/python bench/activation_memory.py --smoke  # TP 2 + SP only: does it still count what docs/memory.md says?

For each model variant (GPT-2 style: LayerNorm, GELU, dropout 0.1; Llama style: RMSNorm, SwiGLU,
rotary, no dropout), recomputation mode (none, selective, full) and layout (one process; tensor
parallel 2 with sequence parallelism, two gloo processes) it builds the model through
`paratron.parallel.parallelize` in bf16 with 1 and with 2 layers, runs one forward of one
micro-batch under `paratron.training.memory_report.SavedActivations`, and takes the difference: the
bytes one layer keeps for backward on rank 0, exactly (tensor storages, each counted once,
parameters excluded).

Beside each figure: the paper's formula (sbh(34 + 5as/h) without parallelism, divided by t
under tensor + sequence parallelism; 34sbh/t with selective recomputation; 2sbh/t with full),
and the formula adjusted for what this model and this machine do differently (see
docs/memory.md). Then the per-rank memory of a mid-size model (GPT, 1.3B parameters, 8 ranks)
with and without recomputation + ZeRO + sequence parallelism, from the formulas checked here
and in bench/zero_memory.py.

Writes bench/results/activation_memory.json and .md (a section for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks
from paratron.storage import write_text_atomic

S, B, H, A = 256, 2, 256, 4  # sequence, micro-batch, hidden, heads
VARIANTS = {
    "gpt": dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "llama": dict(
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        ffn_hidden_size=512,
        num_query_groups=2,
    ),
}
MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


LAYOUTS = {"TP1": (1, False), "TP2": (2, False), "TP2+SP": (2, True)}


def measure(tp: int, sequence_parallel: bool) -> dict[str, float]:
    """On each rank of a gloo world of size `tp`: bytes per layer / sbh for every variant and mode."""
    import torch.distributed as dist

    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize
    from paratron.training.memory_report import SavedActivations

    dist.init_process_group("gloo")
    topology = Topology(ParallelDims(tp, tp=tp), dist.get_rank())
    topology.create_groups()
    ids = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    out = {}
    for variant, shape in VARIANTS.items():
        for mode, recompute in MODES.items():
            saved = []
            for layers in (1, 2):
                config = build_config(
                    dict(
                        shape,
                        **recompute,
                        num_layers=layers,
                        hidden_size=H,
                        num_attention_heads=A,
                        seq_length=S,
                        max_position_embeddings=S,
                        vocab_size=512,
                        precision="bf16",
                        tensor_model_parallel_size=tp,
                        sequence_parallel=sequence_parallel,
                        mock_data=True,
                    )
                )
                with torch.device("meta"):
                    meta = GPT(config.model)
                model = parallelize(
                    meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
                )
                torch.manual_seed(0)
                with SavedActivations(model.module) as activations:
                    logits = model(ids)
                saved.append(activations.live)
                del logits
            out[f"{variant}/{mode}"] = (saved[1] - saved[0]) / (S * B * H)
    dist.destroy_process_group()
    return out


def paper(mode: str, t: int, sp: bool, a: int = A, s: int = S, h: int = H) -> float:
    """Korthikanti et al. per layer, in units of sbh bytes: sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism, all of it / t with sequence parallelism; selective drops the 5as/h term; full keeps
    the layer input (2sbh, / t with sequence parallelism)."""
    if mode == "full":
        return 2.0 / t if sp else 2.0
    quadratic = 5 * a * s / h if mode == "none" else 0.0
    return (34 + quadratic) / t if sp else 10 + (24 + quadratic) / t


def adjusted(variant: str, mode: str, t: int, sp: bool, a: int = A, s: int = S, h: int = H) -> float:
    """The paper's accounting redone for this model's layers and this machine's kernels (the
    derivation is in docs/memory.md): (replicated + sharded / t), or all / t with sequence parallelism."""
    if mode == "full":
        return 2.0 / t if sp else 2.0
    if variant == "gpt":
        # replicated: 2 layer-norm inputs (4), 2 dropout masks at 2 bytes (4), the inputs of the QKV
        # and first MLP matmuls (2 + 2), layer-norm statistics (8/h)
        replicated = 12 + 8 / h
        # sharded: q, k, v and the attention output (8), GELU input and output (16); without
        # recomputation CPU attention with dropout keeps q, k, v in fp32 (+6) and softmax, its
        # dropout mask and the dropped probabilities in fp32 (12as/h)
        sharded = 24 + (6 + 12 * a * s / h if mode == "none" else 0.0)
    else:
        f, g = 2.0, 0.5  # ffn width / h; key-value heads / heads (VARIANTS["llama"])
        # replicated: CPU RMSNorm keeps an fp32 copy of its input and of the normalized input
        # (2 x 8 + 8/h), inputs of the QKV and first MLP matmuls (2 + 2)
        replicated = 20 + 8 / h
        # sharded: q, k, v (2 + 4g), attention output (2), SwiGLU's gate, up, silu(gate), product (8f);
        # without recomputation the fused attention also keeps its fp32 log-sum-exp (4a/h)
        sharded = 2 + 4 * g + 2 + 8 * f + (4 * a / h if mode == "none" else 0.0)
    return (replicated + sharded) / t if sp else replicated + sharded / t


MID = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50304)
"""A mid-size GPT (1.3B parameters, GPT-3 XL shape) at micro-batch 1 on 8 ranks as TP 2 x DP 4."""
STEPS = [
    ("TP2 x DP4 (baseline)", False, "none", 0),
    ("+ sequence parallelism", True, "none", 0),
    ("+ selective recompute", True, "selective", 0),
    ("+ ZeRO-1 (distributed optimizer)", True, "selective", 1),
    ("+ ZeRO-2", True, "selective", 2),
    ("full recompute instead, with SP + ZeRO-2", True, "full", 2),
]


def state_bytes(psi: float, stage: int, n: int) -> float:
    """paratron's bf16 training state per parameter of a rank: bf16 weights (2), fp32 gradients (4),
    fp32 master weights (4) and Adam moments (8); ZeRO-1 shards the last two, ZeRO-2 the gradients too
    (the widths bench/zero_memory.py checks element by element)."""
    return psi * {0: 18, 1: 6 + 12 / n, 2: 2 + 16 / n}[stage]


def mid_size_table() -> tuple[list[dict], float]:
    from paratron.config import build_config
    from paratron.model.gpt import GPT

    config = build_config(dict(MID, max_position_embeddings=MID["seq_length"], mock_data=True))
    with torch.device("meta"):
        psi = sum(p.numel() for p in GPT(config.model).parameters())
    t, n, L, s, h, a = 2, 4, MID["num_layers"], MID["seq_length"], MID["hidden_size"], MID["num_attention_heads"]
    sbh = s * 1 * h
    rows = []
    for name, sp, mode, stage in STEPS:
        state = state_bytes(psi / t, stage, n)
        rows.append(
            dict(
                step=name,
                state=state,
                activations_paper=L * sbh * paper(mode, t, sp, a, s, h),
                activations_cpu=L * sbh * adjusted("gpt", mode, t, sp, a, s, h),
            )
        )
    return rows, psi


def markdown(rows: list[dict], mid: list[dict], psi: float, command: str) -> str:
    lines = [
        "## Activation memory per layer, against Korthikanti et al. (2022)",
        "",
        f"`{command}` (writes bench/results/activation_memory.json). Bytes one transformer layer saves "
        f"for backward on rank 0, counted exactly with saved-tensor hooks (`--log-memory` uses the same "
        f"counter), bf16, s = {S}, b = {B}, h = {H}, a = {A}, in units of sbh bytes. *paper*: the paper's "
        "formula; *adjusted*: the same accounting redone for this model's layers and the CPU kernels "
        "(docs/memory.md derives every term).",
        "",
        "| model | layout | recompute | measured | paper | measured / paper | adjusted | measured / adjusted |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['layout']} | {r['mode']} | {r['measured']:.3f} | {r['paper']:.2f} | "
            f"{r['measured'] / r['paper']:.3f} | {r['adjusted']:.3f} | {r['measured'] / r['adjusted']:.4f} |"
        )
    base = mid[0]["state"] + mid[0]["activations_paper"]
    base_cpu = mid[0]["state"] + mid[0]["activations_cpu"]
    lines += [
        "",
        f"Per-rank memory of a {psi / 1e9:.2f}B-parameter GPT (24 layers, hidden 2048, 16 heads, "
        "sequence 2048, micro-batch 1) on 8 ranks, from the formulas checked above and the training-state "
        "widths checked in the ZeRO section (GiB; activations of the transformer layers only):",
        "",
        "| layout | training state | activations (paper's kernels) | total | saved | "
        "activations (this CPU's kernels) | total | saved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in mid:
        total, total_cpu = r["state"] + r["activations_paper"], r["state"] + r["activations_cpu"]
        lines.append(
            f"| {r['step']} | {r['state'] / 2**30:.2f} | {r['activations_paper'] / 2**30:.2f} | "
            f"{total / 2**30:.2f} | {1 - total / base:.0%} | {r['activations_cpu'] / 2**30:.2f} | "
            f"{total_cpu / 2**30:.2f} | {1 - total_cpu / base_cpu:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS / "activation_memory.json")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, layouts=["TP2+SP"])

    rows = []
    for layout in args.layouts:
        tp, sp = LAYOUTS[layout]
        measured = run_ranks(measure, tp, tp, sp, timeout=900.0)[0]
        for key, value in measured.items():
            variant, mode = key.split("/")
            rows.append(
                dict(
                    variant=variant,
                    mode=mode,
                    layout=layout,
                    measured=value,
                    paper=paper(mode, tp, sp),
                    adjusted=adjusted(variant, mode, tp, sp),
                )
            )
            print(
                f"{variant:6s} {mode:9s} {layout:7s}: {value:8.3f} sbh (paper {paper(mode, tp, sp):.2f}, "
                f"adjusted {adjusted(variant, mode, tp, sp):.3f})",
                flush=True,
            )
    if args.smoke:
        wrong = [r for r in rows if abs(r["measured"] - r["adjusted"]) > 1e-3 * r["adjusted"]]
        assert not wrong, f"measured activations differ from docs/memory.md's accounting: {wrong}"
    mid, psi = mid_size_table()
    command = "python bench/activation_memory.py"
    payload = {
        "command": command,
        "shape": dict(s=S, b=B, h=H, a=A),
        "variants": VARIANTS,
        "torch": torch.__version__,
        "rows": rows,
        "mid_size": mid,
        "mid_psi": psi,
    }
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    text = markdown(rows, mid, psi, command)
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
