"""The planner against published training runs: Llama 3 405B on H100s (Dubey et al. 2024, Table 4)
and Megatron-LM's GPT runs on A100s (Narayanan et al. 2021, Tables 1 and 2).

    .venv/bin/python bench/plan_published.py                      # every run, with the planner's search
    .venv/bin/python bench/plan_published.py --no-search          # predictions only (seconds)
    .venv/bin/python bench/plan_published.py --smoke              # the same, checked, results elsewhere

For each run (`paratron.planning.published`, which documents the data and how each run is put
into paratron's settings): whether its layout fits the device as `paratron train --dry-run` would
predict it (with the least recomputation that fits where the paper leaves it open), its predicted
MFU beside the published one in the same FLOPs count (relative error), and the planner's top plan
for the same model, batch and cluster with its predicted MFU, checked to be no slower than the
published layout in paratron's settings.

Calibrated (`paratron.planning.hardware`): the H100 preset's matmul efficiency on the 8,192-GPU
Llama 3 row, the A100's on the 145.6B row; `--calibrate` refits both and prints the values.

Prints the table for BENCHMARKS.md and writes it, with every row's numbers, to
bench/results/plan_published.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.planning.hardware import preset
from paratron.planning.published import RUNS, Run, evaluate
from paratron.storage import write_text_atomic

CALIBRATION = {"h100-80g": 0, "a100-80g": 3}
"""Preset -> the index in RUNS of the run its matmul efficiency is fitted to."""
LIMIT = 0.15


def fitted_efficiency(run: Run) -> float:
    """The matmul efficiency that makes the run's predicted MFU its published one (bisection)."""
    low, high = 0.2, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        machine = dataclasses.replace(preset(run.hardware), nodes=run.gpus // 8, matmul_efficiency=middle)
        low, high = (low, middle) if evaluate(run, machine, search=False)["relative_error"] > 0 else (middle, high)
    return (low + high) / 2


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | layout (as published) | fits: GB (recomputation) | published MFU | in paratron's count | predicted "
        "| error | top plan | its MFU | no slower | top / as run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = f"{'yes' if r['fits'] else 'NO'}: {r['peak_memory_gb']:.1f} ({r['recomputation_to_fit']})"
        calibrated = " (calibration)" if r.get("calibration") else ""
        top = (
            f"{r['top_plan']} | {100 * r['top_plan_mfu']:.1f}% | {'yes' if r['top_plan_not_slower'] else 'NO'} | "
            f"{r['top_plan_vs_as_run']:.3f}"
            if "top_plan" in r
            else "- | - | - | -"
        )
        lines.append(
            f"| {r['run']} | {r['layout']} | {fits} | {100 * r['published_mfu']:.1f}% | "
            f"{100 * r['published_model_mfu']:.1f}% | {100 * r['predicted_mfu']:.1f}% | "
            f"{100 * r['relative_error']:+.1f}%{calibrated} | {top} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-search", action="store_true", help="Skip the planner's search (predictions only).")
    parser.add_argument("--calibrate", action="store_true", help="Refit the presets' matmul efficiency and print it.")
    parser.add_argument("--output", type=Path, default=RESULTS / "plan_published.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, no_search=True)
    if args.calibrate:
        for name, index in CALIBRATION.items():
            print(f"{name}: matmul efficiency {fitted_efficiency(RUNS[index]):.3f} (fitted to {RUNS[index].name})")
    rows = []
    for index, run in enumerate(RUNS):
        start = time.perf_counter()
        row = evaluate(run, search=not args.no_search)
        row["calibration"] = CALIBRATION.get(run.hardware) == index
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{run.name}: predicted {100 * row['predicted_mfu']:.1f}% MFU, error {100 * row['relative_error']:+.1f}%")
    text = markdown(rows)
    checks = {
        "every published layout fits": all(r["fits"] for r in rows),
        f"every prediction within {100 * LIMIT:.0f}%": all(abs(r["relative_error"]) <= LIMIT for r in rows),
        "every top plan no slower": all(r.get("top_plan_not_slower", True) for r in rows),
    }
    text += "\n\n" + "\n".join(f"- {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items()) + "\n"
    print("\n" + text)
    payload = {"runs": rows, "checks": checks, "limit": LIMIT}
    payload["markdown"] = text
    write_text_atomic(args.output, json.dumps(payload, indent=1) + "\n")
    if args.smoke:
        assert all(checks.values()), f"the planner no longer predicts the published runs: {checks}"


if __name__ == "__main__":
    main()
