"""lm-evaluation-harness tasks on paratron's inference engine: the same per-sample numbers as the harness' own `hf`
model on the same weights, `paratron evaluate --tasks` end to end, `train --eval-tasks`, and the refusals.

Everything runs in this process (the harness in process, the CLI through `paratron.cli.main`); `simple_evaluate` runs
`git` (and torch's environment report) for its results' header, so the tests that evaluate are marked `spawns`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from test_cli import assert_one_line_error, in_process

from harness_tasks import CONTEXT, TASKS, checkpoints, write_tasks
from paratron.checkpoint import load_pretrained
from paratron.config import build_config
from paratron.config.inference import InferenceConfig
from paratron.data.tokenizer import NullTokenizer, Tokenizer
from paratron.errors import UserError
from paratron.inference import tasks as task_index
from paratron.inference.harness import ParatronLM
from paratron.inference.loading import engine_for_model
from paratron.inference.tasks import evaluate_engine, kept_alive, task_manager
from paratron.training.run import run_training


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("harness")
    checkpoint, hf = checkpoints(root)
    return {"checkpoint": checkpoint, "hf": hf, "tasks": write_tasks(root / "tasks")}


@pytest.fixture(scope="module", autouse=True)
def one_index_of_the_harness_tasks() -> Iterator[None]:
    """The harness' index of its own ~15,000 tasks built once for the module: each build parses every YAML file
    (about 20 s), and the refusals of an unknown task name each build it (the folder-only indexes stay fresh)."""
    built: dict[tuple, TaskManager] = {}
    real = task_index.TaskManager

    def cached(*args, **kwargs) -> TaskManager:
        if kwargs.get("include_defaults", True) is False:
            return real(*args, **kwargs)
        key = (args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = real(*args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(task_index, "TaskManager", cached)
        yield


def engine_of(checkpoint: Path):
    return engine_for_model(load_pretrained(checkpoint), Tokenizer.from_file(checkpoint), InferenceConfig())


def numbers(answer) -> list:
    """An answer as a list: [loglikelihood, is greedy] or [loglikelihood]."""
    return list(answer) if isinstance(answer, (list, tuple)) else [answer]


def answers(results: dict, task: str) -> list:
    """Each document's answers to its requests (a loglikelihood and whether greedy, a score, or a text), in order."""
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.spawns
@pytest.mark.parametrize("fewshot", [None, 3])  # (3 examples make contexts longer than the model's context)
def test_the_same_numbers_as_the_harness_hf_model(made, fewshot):
    manager = task_manager(TASKS, made["tasks"], ("--tasks", "--include-path"))
    engine = engine_of(made["checkpoint"])
    ours = evaluate_engine(engine, TASKS, manager, fewshot, bootstrap_iters=0, log_samples=True)
    hf = HFLM(pretrained=str(made["hf"]), max_length=CONTEXT - 1, batch_size=16, device="cpu")
    theirs = simple_evaluate(
        model=hf, tasks=list(TASKS), num_fewshot=fewshot, task_manager=manager, bootstrap_iters=0, log_samples=True
    )
    for task in ("tiny_choice", "tiny_rolling"):
        mine, reference = answers(ours, task), answers(theirs, task)
        assert len(mine) == len(reference) > 0
        for doc, (a, b) in enumerate(zip(mine, reference)):
            a, b = [numbers(r[0]) for r in a], [numbers(r[0]) for r in b]  # (loglikelihood[, is greedy]) each
            assert [x[1:] for x in a] == [x[1:] for x in b], (task, doc)
            assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-4), (task, doc)
    assert answers(ours, "tiny_answer") == answers(theirs, "tiny_answer")
    assert any(text[0][0] for text in answers(ours, "tiny_answer"))  # (something was generated)
    for task, metric in [
        ("tiny_choice", "acc,none"),
        ("tiny_choice", "acc_norm,none"),
        ("tiny_answer", "exact_match,none"),
    ]:
        assert ours["results"][task][metric] == theirs["results"][task][metric], (task, metric)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_rolling"][metric] == pytest.approx(
            theirs["results"]["tiny_rolling"][metric], rel=1e-5
        )
    longest = max(len(ParatronLM(engine).tok_encode(s["doc"]["text"])) for s in ours["samples"]["tiny_rolling"])
    assert longest > 2 * CONTEXT  # (the texts take several windows)


def test_a_prompt_is_cut_from_the_left_to_the_context(made):
    model = ParatronLM(engine_of(made["checkpoint"]))
    assert model.max_length == CONTEXT - 1
    long = model.tok_encode(" ".join(["alpha beta"] * 40))
    ((score, _),) = model._loglikelihood_tokens([(("x", "y"), long, long[-3:])])
    ((cut, _),) = model._loglikelihood_tokens([(("x", "y"), long[-(CONTEXT - 3) :], long[-3:])])
    assert len(long) > CONTEXT and score == pytest.approx(cut, abs=1e-5)
    with pytest.raises(Exception, match="does not fit the model's 47 tokens of context"):
        model._loglikelihood_tokens([(("x", "y"), long[:1], long[:CONTEXT])])


@pytest.mark.spawns
def test_evaluate_tasks_on_the_command_line(made, tmp_path, capsys):
    output = tmp_path / "results.json"
    args = ["--load", str(made["checkpoint"]), "--tasks", "tiny_choice,tiny_rolling", "--include-path"]
    result = in_process(capsys, "evaluate", *args, str(made["tasks"]), "--limit", "5", "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert "|tiny_choice |" in result.stdout and "word_perplexity" in result.stdout
    saved = json.loads(output.read_text())
    assert set(saved["results"]) == {"tiny_choice", "tiny_rolling"}
    assert 0 <= saved["results"]["tiny_choice"]["acc,none"] <= 1
    assert saved["results"]["tiny_rolling"]["word_perplexity,none"] > 1
    assert saved["n-samples"]["tiny_choice"] == {"original": 12, "effective": 5}
    assert saved["config"]["model_name"] == "paratron" and saved["config"]["max_length"] == CONTEXT - 1
    assert "samples" not in saved


@pytest.mark.spawns
def test_train_logs_task_metrics(made, tmp_path):
    """With lr 0 the model does not move: the metrics logged at every evaluation are the checkpoint's."""
    checkpoint = made["checkpoint"]
    reference = evaluate_engine(
        engine_of(checkpoint),
        ["tiny_choice"],
        task_manager(["tiny_choice"], made["tasks"], ("a", "b")),
        limit=8,
        bootstrap_iters=0,
    )["results"]["tiny_choice"]
    text = tmp_path / "text.txt"
    text.write_text("alpha beta gamma delta epsilon zeta eta theta\n" * 50, encoding="utf-8")
    settings = dict(
        load=str(checkpoint.parent),
        data_path=[str(text)],
        seq_length=32,
        micro_batch_size=2,
        train_iters=3,
        lr=0.0,
        min_lr=0.0,
        eval_interval=2,
        eval_iters=0,
        eval_tasks=("tiny_choice",),
        eval_tasks_include_path=str(made["tasks"]),
        eval_tasks_limit=8,
        run_dir=str(tmp_path / "run"),
        progress_bar=False,
        tensorboard=False,
        log_interval=1,
    )
    run_training(build_config(settings, recipe=f"{checkpoint.parent}/model.yaml"))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    with_tasks = {r["step"]: r for r in records if "tasks/tiny_choice/acc" in r}
    assert sorted(with_tasks) == [2, 3]  # every --eval-interval, and at the end
    for record in with_tasks.values():
        assert record["tasks/tiny_choice/acc"] == pytest.approx(reference["acc,none"])
        assert record["tasks/tiny_choice/acc_norm"] == pytest.approx(reference["acc_norm,none"])
        assert "loss" in record


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tasks", "no_such_task"], "--tasks: no task named no_such_task in lm-evaluation-harness or --include-path"),
        (["--tasks", "tiny_choice", "--data-path", "x.txt"], "takes --tasks or --data-path, not both"),
        (["--tasks", "tiny_choice", "--limit", "0"], "--limit 0: give 1 or more"),
    ],
)
def test_evaluate_refuses(made, capsys, args, expected):
    flags = ["--load", str(made["checkpoint"]), "--include-path", str(made["tasks"]), *args]
    assert_one_line_error(in_process(capsys, "evaluate", *flags), expected)


def test_evaluate_refuses_a_missing_include_path(made, capsys, tmp_path):
    flags = ["--load", str(made["checkpoint"]), "--tasks", "x", "--include-path", str(tmp_path / "none")]
    assert_one_line_error(in_process(capsys, "evaluate", *flags), "--include-path")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--mock-data"], "--mock-data has none"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], "NullTokenizer reads token ids"),
        (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--nproc", "2"], "drop --sequence-parallel"),
        (["--zero-stage", "3", "--nproc", "2"], "does not run --zero-stage 3; drop --zero-stage"),
        (["--context-parallel-size", "2", "--nproc", "2"], "drop --context-parallel-size"),
        (
            ["--num-experts", "2", "--expert-model-parallel-size", "2", "--nproc", "2"],
            "drop --expert-model-parallel-size",
        ),
        (
            ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--nproc", "2"]
            + ["--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1", "--global-batch-size", "4"],
            "does not run virtual pipeline stages; drop --num-layers-per-virtual-pipeline-stage",
        ),
    ],
)
def test_train_refuses_what_the_engine_cannot_run(made, capsys, tmp_path, flags, expected):
    base = ["--model", "debug", "--train-iters", "1", "--eval-tasks", "tiny_choice", "--run-dir", str(tmp_path)]
    if "--mock-data" not in flags:
        text = tmp_path / "text.txt"
        text.write_text("1 2 3 4\n" * 10, encoding="utf-8")
        base += ["--data-path", str(text)]
    assert_one_line_error(in_process(capsys, "train", *base, *flags), expected)


def test_train_refuses_an_unknown_task_before_it_starts(made, capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("alpha beta\n" * 10, encoding="utf-8")
    flags = ["--model", "debug", "--train-iters", "1", "--data-path", str(text), "--run-dir", str(tmp_path / "run")]
    flags += ["--eval-tasks", "tiny_choice", "nope", "--eval-tasks-include-path", str(made["tasks"])]
    assert_one_line_error(
        in_process(capsys, "train", *flags), "--eval-tasks: no task named nope in lm-evaluation-harness"
    )
    assert not (tmp_path / "run").exists()


def test_generation_arguments_map_onto_sampling_params(made):
    model = ParatronLM(engine_of(made["checkpoint"]), max_gen_toks=20)
    params, until = model.sampling_params({"until": ["\n"], "max_gen_toks": 5}, "</eos>")
    assert (params.max_tokens, params.temperature, params.stop, until) == (5, 0.0, ("\n", "</eos>"), ["\n", "</eos>"])
    sampled, _ = model.sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 3}, "")
    assert (sampled.temperature, sampled.top_p, sampled.seed, sampled.max_tokens) == (0.7, 0.9, 3, 20)
    greedy, _ = model.sampling_params({"do_sample": False, "temperature": 0.7}, "")
    assert greedy.temperature == 0.0
    with pytest.raises(UserError, match="generation_kwargs num_beams: not supported"):
        model.sampling_params({"num_beams": 4}, "")
    with pytest.raises(UserError, match="max_gen_toks 47: a generation takes 1 to 46 tokens"):
        model.sampling_params({"max_gen_toks": 47}, "")


def test_the_waiting_ranks_hear_from_the_controller_between_requests():
    """`kept_alive`: keep_alive every `every_s` while the harness does other work, never during a generate."""

    class Engine:
        def __init__(self) -> None:
            self.beats, self.during_generate, self.generating = 0, 0, False

        def keep_alive(self) -> None:
            self.beats += 1
            self.during_generate += self.generating

        def generate(self, prompts, params):
            self.generating = True
            time.sleep(0.2)
            self.generating = False
            return ["done"]

    engine = Engine()
    with kept_alive(engine, every_s=0.02) as shared:
        time.sleep(0.2)
        beats = engine.beats
        assert shared.generate([[1]], None) == ["done"]
    assert beats >= 3 and engine.during_generate == 0
    settled = engine.beats
    time.sleep(0.1)
    assert engine.beats == settled  # (the thread ended with the context)


@pytest.mark.parametrize("tokenizer", [None, NullTokenizer(100)])
def test_a_model_without_a_text_tokenizer_is_refused(tokenizer):
    class Engine:
        model_name, max_model_len = "ckpt", 64

    Engine.tokenizer = tokenizer
    with pytest.raises(UserError, match="ckpt has no tokenizer that reads text"):
        ParatronLM(Engine())
