"""`paratron serve` as a process, used by real clients: the official openai client, plain HTTP streams (64 at once,
one that goes away), lm-evaluation-harness' `local-completions` model; SIGTERM; a tensor-parallel server."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from paratron.checkpoint.formats import hf_to_paratron
from paratron.inference.params import SamplingParams
from serve_model import engine_of, tiny_llama_folder

READY = re.compile(r"serving (\S+) on (http://\S+) ")
PROMPTS = ["alpha beta", "gamma", "delta epsilon zeta", "eta theta iota kappa", "lambda", "mu nu", "xi", "pi rho"]


class Server:
    """A `paratron serve` process, its address once it said it was ready, and its output files."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        command = [sys.executable, "-m", "paratron", "serve", "--port", "0", *flags]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 120
        while not (found := READY.search(self.out.read_text())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"the server did not start: {self.err.read_text()[-2000:]}")
            time.sleep(0.2)
        self.name, self.url = found.group(1), found.group(2)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def health(self) -> dict:
        return requests.get(f"{self.url}/health", timeout=10).json()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Llama with a 4,096-token context (room for a stream long enough to abort), converted to a
    paratron checkpoint."""
    folder = tmp_path_factory.mktemp("serve")
    tiny_llama_folder(folder / "hf", context=4096)
    hf_to_paratron(folder / "hf", folder / "tiny")
    return folder / "tiny"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    started = Server(tmp_path_factory.mktemp("server"), "--load", str(checkpoint), "--served-model-name", "tiny")
    yield started
    assert started.terminate() == 0, started.err.read_text()[-2000:]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return engine_of(checkpoint)


def greedy_texts(reference, prompts: list[str], max_tokens: int) -> list[str]:
    ids = [reference.tokenizer.encode(p) for p in prompts]
    outputs = reference.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [out.completions[0].text for out in outputs]


def stream_text(url: str, prompt: str, max_tokens: int) -> str:
    """One client's greedy completion, read as server-sent events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])


def test_openai_client_completions_and_chat(server, reference):
    client = server.client()
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(
        model="tiny", prompt=PROMPTS[:3], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in done.choices] == greedy_texts(reference, PROMPTS[:3], 10)
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == done.choices[0].text
    messages = [{"role": "user", "content": "alpha beta"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == chat.choices[0].message.content


def test_seeded_sampling_and_stop_strings(server):
    client = server.client()
    sample = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=2, extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**sample, seed=3).choices]
    assert first == [c.text for c in client.completions.create(**sample, seed=3).choices]
    assert first != [c.text for c in client.completions.create(**sample, seed=4).choices]
    text = first[0]
    stop = text[4:6]
    cut = client.completions.create(**{**sample, "n": 1}, seed=3, stop=[stop]).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_echoed_logprobs_equal_the_engines(server, reference):
    ids = reference.tokenizer.encode(PROMPTS[3])
    choice = (
        server.client().completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1).choices[0]
    )
    [scored] = reference.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in scored.prompt_logprobs[1:]], abs=1e-5
    )


def test_bad_requests_through_the_client(server):
    client = server.client()
    cases = [
        (openai.BadRequestError, dict(prompt="a", max_tokens=-1), "max_tokens"),
        (openai.BadRequestError, dict(prompt="alpha " * 4200), "prompt"),
        (openai.BadRequestError, dict(prompt="a", extra_body={"top_k": "x"}), "top_k"),
        (openai.NotFoundError, dict(prompt="a", model="gpt-4"), "model"),
    ]
    for error, kwargs, param in cases:
        with pytest.raises(error) as caught:
            client.completions.create(**{"model": "tiny", "max_tokens": 2, **kwargs})
        assert caught.value.body["param"] == param
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].finish_reason
    response = requests.post(f"{server.url}/v1/completions", data="{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_special_tokens_and_refusals_through_the_client(server, reference):
    client = server.client()
    sampling = dict(max_tokens=100, n=4, temperature=10.0, seed=1)  # (near-uniform: special tokens are drawn)
    special = {reference.tokenizer.eod_id, *reference.tokenizer.encode("<|im_start|><|im_end|>")}
    for skip in (True, False):
        params = SamplingParams(**sampling, ignore_eos=True, skip_special_tokens=skip)
        [expected] = reference.generate([reference.tokenizer.encode(PROMPTS[0])], params)
        assert any(set(c.token_ids[:-1]) & special for c in expected.completions)
        extra = {"ignore_eos": True, "skip_special_tokens": skip}
        done = client.completions.create(model="tiny", prompt=PROMPTS[0], **sampling, extra_body=extra)
        assert [c.text for c in done.choices] == [c.text for c in expected.completions]
        assert any("<|" in c.text for c in done.choices) == (not skip)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases = [
        (dict(response_format={"type": "json_object"}), "response_format", "json_object"),
        (dict(messages=[{"role": "user", "content": [image]}]), "messages", "image_url"),
        (dict(messages=[{"role": "developer", "content": "alpha"}]), "messages", "'developer'"),
    ]
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{**plain, **kwargs})
        assert caught.value.body["param"] == param and words in caught.value.body["message"]
        assert client.chat.completions.create(**plain).choices[0].finish_reason


def test_a_client_that_leaves_frees_its_blocks(server):
    """A stream closed after its first token, and a whole answer whose client stopped waiting, are aborted
    (not run to their 4,000th token) and their cache blocks freed. Asserted by the order of events the server
    reports, with bounds no busy machine reaches, not by how long it took."""
    total, aborted = server.health()["cache_tokens"], server.health()["aborted_requests"]
    body = {"prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    response = requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=60)
    lines = response.iter_lines()
    next(line for line in lines if line)
    assert server.health()["free_cache_tokens"] < total
    response.close()
    wait_for_idle(server, aborted + 1, total)
    with pytest.raises(requests.exceptions.ReadTimeout):  # (a client that stops waiting for a whole answer)
        requests.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_for_idle(server, aborted + 2, total)


def wait_for_idle(server: Server, aborted: int, total: int) -> None:
    """Until the server has aborted `aborted` requests in all and runs none, with all its cache free."""
    health = server.health()
    for _ in range(1200):
        if health["aborted_requests"] == aborted and not health["requests"] and health["free_cache_tokens"] == total:
            return
        time.sleep(0.05)
        health = server.health()
    raise AssertionError(f"not aborted: {health}")


def test_64_concurrent_streams_get_what_one_client_gets(server, reference):
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(64)]
    alone = {p: stream_text(server.url, p, 16) for p in PROMPTS}
    assert list(alone.values()) == greedy_texts(reference, PROMPTS, 16)
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(lambda p: stream_text(server.url, p, 16), prompts))
    assert together == [alone[p] for p in prompts]


def test_sigterm_lets_a_running_stream_finish(checkpoint, tmp_path):
    server = Server(tmp_path, "--load", str(checkpoint))
    body = {"prompt": "alpha", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line)
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 300
    assert server.process.wait(timeout=60) == 0, server.err.read_text()[-2000:]


def test_tensor_parallel_server_answers_as_one_process(server, checkpoint, tmp_path):
    one = server.client().completions.create(model="tiny", prompt=PROMPTS[:4], max_tokens=12, temperature=0)
    flags = ["--load", str(checkpoint), "--served-model-name", "tiny", "--nproc", "2"]
    parallel = Server(tmp_path, *flags, "--tensor-model-parallel-size", "2", "--distributed-backend", "gloo")
    try:
        two = parallel.client().completions.create(model="tiny", prompt=PROMPTS[:4], max_tokens=12, temperature=0)
        assert [c.text for c in two.choices] == [c.text for c in one.choices]
        assert "tensor 2 x pipeline 1" in parallel.out.read_text()
    finally:  # (the workers end as one process does; the launcher reports that as an interruption)
        assert parallel.terminate() == 130, parallel.err.read_text()[-2000:]
    assert "Traceback" not in parallel.err.read_text()


TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_evaluation_harness_through_the_server_equals_its_hf_model(server, checkpoint, tmp_path):
    """The harness' own `local-completions` model (remote tokenizer) against its `hf` model on the exported
    checkpoint: the same loglikelihood per choice (1e-4) and the same accuracy."""
    import lm_eval  # (slow to import: only here)
    from lm_eval.tasks import TaskManager

    from paratron.cli import main

    assert main(["convert", "--from", "paratron", str(checkpoint), "--to", "hf", str(tmp_path / "hf")]) == 0
    rng = random.Random(0)
    words = PROMPTS[2].split() + PROMPTS[3].split()
    with open(tmp_path / "docs.jsonl", "w") as docs:
        for _ in range(12):
            question = " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
            choices = [" " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(3)]
            docs.write(json.dumps({"question": question, "choices": choices, "answer": rng.randrange(3)}) + "\n")
    (tmp_path / "tiny_choice.yaml").write_text(TASK.format(docs=tmp_path / "docs.jsonl"))
    tasks = TaskManager(include_path=str(tmp_path))
    common = dict(tasks=["tiny_choice"], task_manager=tasks, log_samples=True)
    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", device="cpu", batch_size=4, **common
    )
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.url}/v1/completions,model=tiny,tokenizer_backend=remote,num_concurrent=4",
        **common,
    )
    assert served["results"]["tiny_choice"]["acc,none"] == hf["results"]["tiny_choice"]["acc,none"]
    expected = [[r[0][0] for r in s["resps"]] for s in hf["samples"]["tiny_choice"]]
    got = [[r[0][0] for r in s["resps"]] for s in served["samples"]["tiny_choice"]]
    assert len(got) == 12 and got == [pytest.approx(e, abs=1e-4) for e in expected]
