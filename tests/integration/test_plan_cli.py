"""`paratron plan` end to end through `run_plan(argv)` (what the CLI's `plan` command calls), in
process: it starts no workers; `paratron train --auto` runs the plan it picks (in subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from paratron.cli import main
from paratron.commands.plan import run as run_plan
from paratron.commands.train import parser as train_parser
from paratron.config.arguments import parse_config_arguments
from paratron.config.layout import resolve_layout
from paratron.config.loading import build_config
from paratron.distributed.launch import slurm_settings
from paratron.errors import ConfigError

TORCHRUN_2x8 = "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB"
LLAMA = ["--model", "llama3-8b", "--global-batch-size", "64", "--seq-length", "4096", "--mock-data"]


def test_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "out" / "plans.json"
    code = run_plan([*LLAMA, "--hardware", "h100-80g", "--nodes", "2", "--top", "3", "--output", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    assert printed[0].startswith("llama3-8b on 16 x h100-80g (80 GB, 989 TFLOP/s x 0.53), --global-batch-size 64 x ")
    assert printed[1].split()[:3] == ["#", "layout", "GB/rank"] and printed[3].lstrip().startswith("1  TP")
    rows = [line for line in printed if line[:3].strip().isdigit()]
    assert len(rows) == 3
    best = next(line for line in printed if line.startswith("best: "))[len("best: ") :]
    assert best.startswith(f"{TORCHRUN_2x8} -m paratron train --model-name llama3-8b ")
    document = json.loads(out.read_text())
    assert document["request"]["world_size"] == 16 and document["hardware"]["name"] == "h100-80g"
    plans = document["plans"]
    assert plans[0]["command"] == best and len(plans) >= 3
    assert plans[0]["slurm_command"].startswith("srun --nodes 2 --ntasks-per-node 1 paratron train --nproc-per-node 8 ")
    first = plans[0]
    assert {"layout", "settings", "memory_per_rank", "step_time_breakdown_s", "mfu", "tokens_per_s"} <= set(first)
    assert sum(first["step_time_breakdown_s"].values()) == pytest.approx(first["step_time_s"])
    assert all(m["total"] <= 80e9 for p in plans for m in p["memory_per_rank"])
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
    recipe, overrides, _ = parse_config_arguments(train_parser(), best.split(" train ", 1)[1].split())
    layout = resolve_layout(build_config(overrides, recipe), 16)
    assert (layout.tp, layout.pp, layout.dp, layout.micro_batch_size) == (
        first["settings"]["tensor_model_parallel_size"],
        first["settings"]["pipeline_model_parallel_size"],
        first["data_parallel_size"],
        first["settings"]["micro_batch_size"],
    )
    assert list(layout.pipeline.counts) == first["pipeline"]["layers_per_stage"]
    # every other layout considered is on record: why it is not a plan, what is known of its time
    others = document["other_layouts"]
    assert others and {o["reason"] for o in others} <= {"slower", "out of memory", "refused", "schedule too long"}
    for other in others:
        if other["reason"] == "slower":
            assert (other["step_time_s"] or other["step_time_at_least_s"]) > 1.1 * plans[0]["step_time_s"]
            assert other["command"].startswith(TORCHRUN_2x8)
        if other["reason"] == "out of memory" and other["peak_memory_bytes"] is not None:
            assert other["peak_memory_bytes"] > 80e9
    described = {p["layout"] for p in plans}
    assert not described & {o["layout"] for o in others if o["step_time_s"] is None}
    assert (tmp_path / "out" / "plans.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary left


def test_cpu_measured_and_plot_elsewhere(tmp_path, capsys):
    picture = tmp_path / "here.png"
    args = ["--model", "debug", "--global-batch-size", "8", "--seq-length", "64", "--mock-data", "--hardware", "cpu"]
    assert run_plan([*args, "--gpus-per-node", "2", "--plot", str(picture)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("debug on 2 x cpu (") and "--precision" not in printed.split("best: ")[1]
    assert picture.stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--hardware", "tpu"],
            "--hardware tpu: unknown preset; choose one of h100-80g, h200-141g, gb200, a100-80g, cpu",
        ),
        (["--world-size", "24", "--nodes", "2"], "--world-size 24 disagrees with --nodes 2 x --gpus-per-node 8"),
        (["--within", "0.5"], "--within 0.5: must be at least 1"),
        (["--nodes", "0"], "--nodes 0: must be at least 1"),
        (["--nodez", "2"], "unknown flag --nodez; did you mean --nodes?"),
        (["--device-memory-gb", "1"], "no layout of llama3-8b fits 1 GB per device on 8 ranks"),
    ],
)
def test_mistakes_are_one_line_config_errors(args, message):
    with pytest.raises(ConfigError) as caught:
        run_plan([*LLAMA, *args])
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "data",
    [["--data-path", "corpus/text_document", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"], []],
)
def test_the_best_command_runs_as_printed(capsys, data):
    """The printed command carries the user's data and tokenizer flags, or --mock-data (said plainly)
    when there were none: `paratron train` takes it as it is (its dry run validates it)."""
    shape = ["--model", "debug", "--global-batch-size", "8", "--seq-length", "32", "--hardware", "cpu"]
    assert run_plan([*shape, "--gpus-per-node", "2", "--top", "1", *data]) == 0
    printed = capsys.readouterr().out.splitlines()
    best = next(line for line in printed if line.startswith("best: "))
    assert best.startswith("best: paratron train --nproc-per-node 2 --model-name debug ")
    args = best.split(" train ", 1)[1].split()
    if data:
        assert args[args.index("--data-path") + 1] == "corpus/text_document" and "--mock-data" not in args
        assert args[args.index("--tokenizer-type") + 1] == "NullTokenizer"
        assert printed[-1] == best
    else:
        assert "--mock-data" in args
        assert printed[-1].startswith("(no data was given, so it trains on --mock-data: replace that with --data-path")
    assert main(["train", *args, "--dry-run", "--world-size", "2"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("dry run: world 2 = ")


def test_a_plan_across_nodes_prints_what_runs_on_every_node(capsys):
    """Across nodes every node starts its own launcher and they must meet: torchrun's own parser reads the
    printed line as a c10d rendezvous at the placeholders (not its default of a static one on 127.0.0.1, where
    every node would start as node 0), a line under it says what to fill in, and the srun line runs under
    Slurm as `paratron train` reads Slurm's environment."""
    shape = ["--model", "debug", "--global-batch-size", "8", "--seq-length", "32", "--hardware", "cpu"]
    assert run_plan([*shape, "--nodes", "2", "--gpus-per-node", "2", "--top", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(printed) if line.startswith("best: "))
    best, told, slurm = printed[at][len("best: ") :], printed[at + 1], printed[at + 2]
    torchrun = get_args_parser().parse_args(best.split()[1:])
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "2")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("c10d", "HOST:PORT", "JOB")
    assert torchrun.module and torchrun.training_script == "paratron" and torchrun.training_script_args[0] == "train"
    assert told == (
        "(run it on each of the 2 nodes, with HOST:PORT replaced by one node's address and a free port there and "
        "JOB by a name for the run, the same on every node; under Slurm this one line, in an allocation of 2 "
        "nodes, starts them all:)"
    )
    assert slurm.startswith("slurm: srun --nodes 2 --ntasks-per-node 1 paratron train --nproc-per-node 2 ")
    flags = slurm.split(" train ", 1)[1].split()
    assert flags[2:] == torchrun.training_script_args[1:]
    recipe, overrides, _ = parse_config_arguments(train_parser(), flags)
    config = build_config(overrides, recipe)
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1"}
    launch = slurm_settings({**env, "SLURM_JOB_NODELIST": "cpu[07-08]"}, config.parallel)
    assert (launch.nnodes, launch.nproc_per_node, launch.node_rank) == (2, 2, 1)
    assert (launch.rdzv_endpoint, launch.rdzv_id) == ("cpu07:29500", "slurm-77")
    assert main(["train", *flags, "--dry-run", "--world-size", "4"]) == 0, capsys.readouterr().err


def test_a_plan_on_one_node_prints_one_command(capsys):
    shape = ["--model", "debug", "--global-batch-size", "8", "--seq-length", "32", "--hardware", "cpu"]
    assert run_plan([*shape, "--gpus-per-node", "4", "--top", "1", "--mock-data"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("best: paratron train --nproc-per-node 4 --model-name debug ")
    assert not any(line.startswith(("slurm:", "(run it")) for line in printed)


def test_global_batch_is_required():
    with pytest.raises(ConfigError, match="needs --global-batch-size"):
        run_plan(["--model", "debug", "--seq-length", "64"])


def test_train_auto_runs_the_top_plan_for_this_machine(tmp_path):
    """--auto plans once in the launching process (the CPU measured for 2 processes) and every worker
    trains the chosen layout."""
    run = subprocess.run(
        [sys.executable, "-m", "paratron", "train", "--config", "debug", "--mock-data", "--nproc", "2", "--auto",
         "--train-iters", "6", "--log-interval", "1", "--no-progress-bar", "--no-tensorboard",
         "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    chosen = run.stdout.splitlines()[0]
    assert chosen.startswith("--auto: TP") and "predicted" in chosen and "GB per rank" in chosen
    layout = chosen.split(": ", 1)[1].split(",")[0]  # e.g. "TP1 CP1 PP1 DP2 mbs8 ZeRO-3"
    sizes = dict((part[:2], part[2:]) for part in layout.split() if part[:2] in ("TP", "PP", "DP"))
    assert f"TP {sizes['TP']} x CP 1 x DP {sizes['DP']} x PP {sizes['PP']}" in run.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_train_auto_refuses_layout_flags(capsys):
    flags = ["--config", "debug", "--mock-data", "--nproc", "2", "--auto", "--tensor-model-parallel-size", "2"]
    assert main(["train", *flags]) == 2
    assert "--auto chooses the layout itself; drop --tensor-model-parallel-size" in capsys.readouterr().err
