"""The command line end to end: training on several processes in subprocesses as a user runs them
(`--nproc` and torchrun); what starts no worker (validation messages, conversion, one-process
training, generation from the trained checkpoints) in process through `paratron.cli.main` (the
console script's code path), and one subprocess showing that a message reaches the terminal as the
exit code 2 and one line. Tensor-parallel training runs `paratron.cli.main` on two ranks forked
from `run_ranks`' server, as workers that torchrun started: what it checks does not depend on the
launch, which the other multi-process tests go through, and each fresh interpreter costs seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratron.cli import main
from paratron.distributed.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--no-progress-bar", "--no-tensorboard"]


def paratron(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "paratron", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`paratron ARGS` through the console script's entry point, in this process (no interpreter start)."""
    capsys.readouterr()
    code = main(list(args))
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--config", "debug", "--nproc", "3", "--tensor-model-parallel-size", "2"],
            "world size 3 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            ["--config", "debug", "--num-layers", "3", "--pipeline-model-parallel-size", "2", "--nproc", "2"],
            "--num-layers 3 with --pipeline-model-parallel-size 2: 3 layers do not split evenly into 2 stages",
        ),
        (
            ["--config", "debug", "--nproc", "2", "--global-batch-size", "12"],
            "--global-batch-size 12 is not divisible by --micro-batch-size 8 x data-parallel size 2",
        ),
        (["--config", "nosuchrecipe"], "--config nosuchrecipe: no such file or recipe"),
        (
            ["--config", "debug", "--no-mock-data", "--data-path", "/no/such/dir"],
            "--data-path /no/such/dir: neither a dataset prefix",
        ),
        (["--config", "debug", "--hidden-size", "0"], "--hidden-size 0: must be at least 1"),
        (["--config", "debug", "--seq-length", "512"], "--seq-length 512 exceeds --max-position-embeddings 256"),
        (
            ["--config", "debug", "--context-parallel-size", "2"],
            "world size 1 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 2",
        ),
        (["--config", "debug", "--hiden-size", "8"], "unknown flag --hiden-size; did you mean --hidden-size?"),
        (["--config", "debug", "--fp16", "--bf16"], "--fp16 and --bf16 were both given; choose one"),
        (["--config", "debug", "--nproc", "2", "--load", "."], ".: no checkpoint here"),
        (
            ["--config", "debug", "--nproc", "2", "--overlap-param-gather"],
            "--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer",
        ),
        (["--config", "debug", "--nproc", "2", "--zero-stage", "5"], "--zero-stage: 5 is not one of: 0, 1, 2, 3"),
        (
            [
                "--config",
                "debug",
                "--num-layers",
                "4",
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "24",
                "--micro-batch-size",
                "8",
            ],
            "--global-batch-size 24: the interleaved schedule needs a number of micro-batches (3) divisible by the "
            "pipeline size (2)",
        ),
    ],
)
def test_bad_settings_exit_2_with_one_line(args, expected, capsys):
    """In process: each message is the one `paratron train` prints before any worker starts (the
    subprocess test below shows that such a line reaches the user's terminal as it is)."""
    assert_one_line_error(in_process(capsys, "train", *args), expected)


def test_a_bad_setting_reaches_the_terminal_as_exit_code_2_and_one_line():
    """The one validation message checked through a real interpreter: the exit code the shell sees,
    a single line on stderr, no traceback (the in-process tests check each message)."""
    assert_one_line_error(paratron("train", "--config", "debug", "--hidden-size", "0"), "--hidden-size 0: must be")


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--hidden-size INT Width of the residual stream. (default: 64)" in text
    assert "--tensor-model-parallel-size INT Tensor-parallel degree" in text
    assert "--fp16 Train in fp16 mixed precision" in text
    top = in_process(capsys, "--help")
    assert top.returncode == 0 and "train" in top.stdout and "generate" in top.stdout


def test_tensor_parallel_training_then_generate(tmp_path, capfd):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" * 40)
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    capfd.readouterr()
    argv = [
        "train",
        "--config",
        "debug",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--no-mock-data",
        "--data-path",
        str(corpus),
        "--vocab-size",
        "300",
        "--train-iters",
        "8",
        "--log-interval",
        "4",
        "--eval-interval",
        "8",
        "--run-dir",
        str(run),
        "--save",
        str(ckpt),
        "--sample-prompt",
        "def f3(x):",
        *QUIET,
    ]
    codes = run_ranks(main, 2, argv)  # (two ranks, as torchrun's workers of `paratron train --nproc 2`)
    out, err = capfd.readouterr()
    assert codes == [0, 0], err
    assert "world 2 = TP 2 x CP 1 x DP 1" in out
    assert "sample (temperature 0.7, top-k 40) continuing the prompt:" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 8]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    generated = in_process(capfd, "generate", "--load", str(ckpt), "--prompt", "def f1", "--max-new-tokens", "5")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def f1") and len(generated.stdout) > len("def f1")


@pytest.fixture(scope="module")
def data_parallel_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """One data-parallel run with the distributed optimizer, started by torchrun: (its result, run folder,
    checkpoint). Two tests read it: each launch costs three interpreter starts."""
    root = tmp_path_factory.mktemp("data-parallel")
    run, ckpt = root / "run", root / "ckpt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "paratron",
            "train",
            "--config",
            "debug",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "20000",
            "--train-iters",
            "3",
            "--lr-warmup-iters",
            "1",
            "--log-interval",
            "2",
            "--eval-iters",
            "0",
            "--run-dir",
            str(run),
            "--save",
            str(ckpt),
            *QUIET,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, run, ckpt


def test_runs_when_started_by_torchrun(data_parallel_run):
    result, run, _ = data_parallel_run
    assert result.returncode == 0, result.stderr
    assert "world 2 = TP 1 x CP 1 x DP 2" in result.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]  # every log interval, and the last step


def test_distributed_optimizer_run_saves_each_shard_and_resumes_at_another_layout(data_parallel_run, tmp_path, capsys):
    result, _, ckpt = data_parallel_run
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in (ckpt / "iter_0000003").glob("optimizer_*"))
    assert files == ["optimizer_tp000_pp000_dp000.safetensors", "optimizer_tp000_pp000_dp001.safetensors"]
    # the shards hold single-device names: one process without ZeRO resumes from them (in this process)
    result = in_process(
        capsys,
        "train",
        "--config",
        "debug",
        "--train-iters",
        "5",
        "--lr-warmup-iters",
        "1",
        "--eval-iters",
        "0",
        "--run-dir",
        str(tmp_path / "one"),
        "--load",
        str(ckpt),
        *QUIET,
    )
    assert result.returncode == 0, result.stderr
    assert "loaded" in result.stdout and "step 3" in result.stdout
    assert_one_line_error(
        in_process(capsys, "train", "--config", "debug", "--load", str(tmp_path / "nothing"), *QUIET),
        "no such checkpoint directory; check the path",
    )


def test_pipeline_training_with_profile_then_generate(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    result = paratron(
        "train",
        "--config",
        "debug",
        "--nproc",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-schedule",
        "zb-h1",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "4",
        "--lr-warmup-iters",
        "1",
        "--log-interval",
        "2",
        "--eval-interval",
        "4",
        "--profile-pipeline",
        "--run-dir",
        str(run),
        "--save",
        str(ckpt),
        *QUIET,
    )
    assert result.returncode == 0, result.stderr
    assert "world 2 = TP 1 x CP 1 x DP 1 x PP 2" in result.stdout
    assert "pipeline profile of step 4: bubble" in result.stdout
    assert "rank 0 held at most 2 micro-batch activations at once" in result.stdout
    for rank in (0, 1):
        events = json.loads((run / f"pipeline-trace-rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("ph") == "X"}
        assert names == {f"{kind}{m}" for kind in "FBW" for m in range(4)}  # 4 micro-batches: F, B and W each
    assert (run / "pipeline-timeline.png").stat().st_size > 0
    index = json.loads((ckpt / "iter_0000004" / "model.safetensors.index.json").read_text())["weight_map"]
    first, last = "model_tp000_pp000_dp000.safetensors", "model_tp000_pp001_dp000.safetensors"
    assert index["layers.0.attention.out_proj.weight"] == first
    assert index["final_norm.weight"] == last
    assert index["embedding.weight"] == first and "output.weight" not in index  # tied: the first stage writes it

    from paratron import load_pretrained

    model = load_pretrained(ckpt)  # one device, from the two stages' files
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)


def test_a_data_error_inside_the_workers_exits_2_without_hanging(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n")
    result = paratron(
        "train",
        "--config",
        "debug",
        "--nproc",
        "2",
        "--no-mock-data",
        "--data-path",
        str(tmp_path),
        *QUIET,
        timeout=120,
    )
    assert_one_line_error(result, "bad.txt: byte 3 of the file is not valid UTF-8")


def test_an_empty_data_directory_is_refused_before_launch(tmp_path, capsys):
    (tmp_path / ".hidden").write_text("not data")
    args = ["--config", "debug", "--nproc", "2", "--no-mock-data", "--data-path", str(tmp_path)]
    result = in_process(capsys, "train", *args)
    assert_one_line_error(result, f"--data-path {tmp_path}: no files found")


def test_generate_with_a_missing_checkpoint(tmp_path, capsys):
    assert_one_line_error(
        in_process(capsys, "generate", "--load", str(tmp_path / "none"), "--prompt", "x"),
        f"--load {tmp_path / 'none'}: no such checkpoint directory; check the path",
    )


@pytest.mark.spawns  # (the preprocessing workers)
def test_preprocess_then_train_on_the_prefix(tmp_path, capsys):
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 5}) for i in range(300)]
    (tmp_path / "code.jsonl").write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "out" / "code"
    result = in_process(
        capsys,
        "preprocess",
        "--input",
        str(tmp_path / "code.jsonl"),
        "--output-prefix",
        str(prefix),
        "--vocab-size",
        "300",
        "--append-eod",
        "--workers",
        "2",
        "--no-progress-bar",
    )
    assert result.returncode == 0, result.stderr
    assert "300 documents" in result.stdout and f"wrote {prefix}_text_document.bin" in result.stdout
    trained = in_process(
        capsys,
        "train",
        "--config",
        "debug",
        "--no-mock-data",
        "--data-path",
        f"{prefix}_text_document",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        f"{prefix}_tokenizer.json",
        "--train-iters",
        "6",
        "--eval-interval",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        "--data-cache-path",
        str(tmp_path / "cache"),
        *QUIET,
    )
    assert trained.returncode == 0, trained.stderr
    assert "vocab 512" in trained.stdout and "validation at step 6" in trained.stdout  # the recipe's 512 >= 300


def test_preprocess_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    result = in_process(
        capsys,
        "preprocess",
        "--input",
        str(tmp_path / "bad.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--no-progress-bar",
    )
    assert_one_line_error(result, "bad.jsonl:2: no key 'text' (--skip-bad-lines skips such lines)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    idx = tmp_path / "x.idx"
    idx.write_bytes(b"garbage!" * 8)
    (tmp_path / "x.bin").write_bytes(b"")
    result = in_process(
        capsys,
        "train",
        "--config",
        "debug",
        "--no-mock-data",
        "--data-path",
        str(tmp_path / "x"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
    )
    assert_one_line_error(result, "x.idx: bytes 0-8 are b'garbage!g', not the MMIDIDX magic")


def test_convert_from_hugging_face_and_back(tmp_path, capsys):
    import transformers

    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    result = in_process(
        capsys, "convert", "--from", "hf", str(tmp_path / "hf"), "--to", "paratron", str(tmp_path / "p")
    )
    assert result.returncode == 0, result.stderr
    assert f"train from it with: paratron train --load {tmp_path / 'p'} --finetune" in result.stdout
    result = in_process(
        capsys, "convert", "--from", "paratron", str(tmp_path / "p"), "--to", "hf", str(tmp_path / "back")
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "back" / "model.safetensors").is_file()
    for args, expected in (
        (["hf", str(tmp_path / "nothing"), "paratron", str(tmp_path / "x")], "no such directory"),
        (["hf", str(tmp_path / "hf"), "hf", str(tmp_path / "x")], "convert hf to paratron, or paratron to hf or peft"),
        (["hf", str(tmp_path / "hf"), "paratron", str(tmp_path / "p")], "already exists and is not empty"),
    ):
        assert_one_line_error(in_process(capsys, "convert", "--from", *args[:2], "--to", *args[2:]), expected)
    assert not (tmp_path / "x").exists()
