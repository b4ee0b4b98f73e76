#!/usr/bin/env bash
# One GPU, one prepared run (under 8 minutes on an H100 or H200): the tests that exercise the device, then the
# single-GPU bf16 throughput and MFU table (llama3-1b and a 3B Llama at sequence 2048 and 4096: eager, then
# --compile, --cross-entropy-loss-fusion and fp8 hybrid added one at a time; synthetic tokens, one process, no
# recomputation), written to bench/results/gpu.md.
#
#     bash bench/gpu.sh            # from the repository root; PYTHON=... to pick the interpreter
#
# The commands are those of BENCHMARKS.md's "One GPU" section; MFU is against the device's dense bf16 spec sheet
# (distributed/init.py's table), over the last logged interval (steps 9-12), after warm-up.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="$ROOT/bench/results/gpu.md"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "bench/gpu.sh: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU" >&2
    exit 2
fi
cd "$ROOT" || exit 1

# 1. The tests that touch the device (those naming CUDA or the accelerator), in this process's GPU's presence.
mapfile -t DEVICE_TESTS < <(grep -l -i -E 'cuda|accelerator' tests/unit/test_*.py)
timeout 90 "$PYTHON" -m pytest -q -m "not spawns" -p no:cacheprovider "${DEVICE_TESTS[@]}" >"$WORK/tests.log" 2>&1
TESTS_RC=$?
TESTS_LINE="$(tail -n 1 "$WORK/tests.log")"
echo "device tests (${#DEVICE_TESTS[@]} files): $TESTS_LINE (exit $TESTS_RC)"

# 2. The throughput table: name | model flags | variant flags | sequence | micro-batch | global batch | seconds
#    allowed (with the tests' 90, at most 7.9 minutes in all). Each fast path is added to the one before it, so
#    every row's gain is read against the row above; the compiled runs share inductor's cache (the second one
#    compiles little).
LLAMA_3B="--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 --num-query-groups 8"
COMPILED="--compile"
FUSED="--compile --cross-entropy-loss-fusion"
FP8="--compile --cross-entropy-loss-fusion --fp8-format hybrid"
RUNS=(
    "llama3-1b|--model llama3-1b|eager|2048|4|16|40"
    "llama3-1b|--model llama3-1b|$COMPILED|2048|4|16|80"
    "llama3-1b|--model llama3-1b|$FUSED|2048|4|16|50"
    "llama3-1b|--model llama3-1b|$FP8|2048|4|16|80"
    "llama3-1b|--model llama3-1b|$FUSED|4096|2|16|50"
    "llama 3B (Llama 3.2 3B's shape)|--model llama3-1b $LLAMA_3B|eager|4096|1|8|50"
    "llama 3B (Llama 3.2 3B's shape)|--model llama3-1b $LLAMA_3B|$FUSED|4096|1|8|75"
)
for index in "${!RUNS[@]}"; do
    IFS='|' read -r name flags variant seq micro global seconds <<<"${RUNS[$index]}"
    extra="$variant"
    [ "$variant" = eager ] && extra=""
    # shellcheck disable=SC2086  # (the flags are words)
    timeout "$seconds" "$PYTHON" -m paratron train $flags $extra --bf16 --mock-data --seq-length "$seq" \
        --max-position-embeddings "$seq" --micro-batch-size "$micro" --global-batch-size "$global" \
        --train-iters 12 --log-interval 4 --eval-iters 0 --lr 3e-4 --lr-warmup-iters 2 --no-progress-bar \
        --run-dir "$WORK/run$index" >"$WORK/run$index.log" 2>&1
    echo "$?" >"$WORK/run$index.rc"
    echo "$name, $variant, sequence $seq: exit $(cat "$WORK/run$index.rc")"
done

"$PYTHON" - "$WORK" "$OUT" "$TESTS_LINE" "$TESTS_RC" "${RUNS[@]}" <<'PY'
"""The markdown table of the runs: the last logged interval of each, or why it has none."""
import json, sys
from pathlib import Path

import torch

work, out, tests_line, tests_rc, runs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
device = torch.cuda.get_device_name(0)
rows = []
for index, run in enumerate(runs):
    name, _, variant, seq, micro, batch, _ = run.split("|")
    metrics = work / f"run{index}" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if not lines:
        log = (work / f"run{index}.log").read_text().strip().splitlines()
        why = "out of memory" if any("out of memory" in line.lower() for line in log) else (log[-1] if log else "?")
        rows.append(f"| {name} | {variant} | {seq} | {batch} ({micro}) | failed (exit {(work / f'run{index}.rc').read_text().strip()}): {why[:120]} | | | |")
        continue
    last = lines[-1]
    rows.append(
        f"| {name} | {variant} | {seq} | {batch} ({micro}) | {last['tokens_per_s']:,.0f} | {last['tflops_per_device']:.0f} | "
        f"**{100 * last['mfu']:.1f}%** | {last['mem_gb']:.1f} GB |"
    )
text = "\n".join([
    f"# One GPU: bf16 throughput and MFU ({device})",
    "",
    f"torch {torch.__version__}, CUDA {torch.version.cuda}; bf16 with fp32 master weights, synthetic tokens,",
    "one process, no recomputation; the last logged interval (steps 9-12). Made by `bash bench/gpu.sh`.",
    "",
    "| model | fast paths | sequence | global batch (micro-batch) | tokens/s | TFLOP/s | MFU | memory |",
    "|---|---|---|---|---|---|---|---|",
    *rows,
    "",
    f"Device tests: {tests_line} (exit {tests_rc}).",
    "",
])
out.parent.mkdir(parents=True, exist_ok=True)
tmp = out.with_suffix(".md.tmp")
tmp.write_text(text)
tmp.replace(out)
print(text)
PY
