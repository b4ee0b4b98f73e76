"""The server's application in this process (starlette's TestClient): OpenAI's request and response bodies, the
engine's answers through them, errors, limits and the API key; the log-probabilities against transformers."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
import transformers
from starlette.testclient import TestClient

from paratron.cli import main
from paratron.data.sft import chat_stop_ids, tokenizer_chat_template
from paratron.inference.http_app import ServerSettings, build_app
from paratron.inference.openai_api import CompletionRequest, TokenTexts, completion_logprobs
from paratron.inference.params import SamplingParams, TokenLogprob
from paratron.inference.text import IncrementalText, TextDecoder, special_token_ids
from serve_model import engine_of, tiny_llama_folder

PROMPTS = ["alpha beta gamma", "delta", "kappa lambda mu nu xi"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def reference(folder):
    """An engine of its own, for the expected answers (the server's engine belongs to its thread)."""
    return engine_of(folder)


@pytest.fixture(scope="module")
def client(folder):
    with TestClient(build_app(engine_of(folder), ServerSettings("tiny"))) as client:
        yield client


def greedy(reference, prompt_ids: list[int], max_tokens: int, **params) -> tuple[str, list[int]]:
    [out] = reference.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, **params))
    return out.completions[0].text, out.completions[0].token_ids


def events(response) -> list[dict]:
    """The JSON bodies of a server-sent event stream, checking that it ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_greedy_completions_match_the_engine(client, reference):
    body = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    for choice, prompt in zip(body["choices"], PROMPTS):
        text, tokens = greedy(reference, reference.tokenizer.encode(prompt), 12)
        assert choice["text"] == text
        assert choice["finish_reason"] == ("length" if len(tokens) == 12 else "stop")
    prompt_tokens = sum(len(reference.tokenizer.encode(p)) for p in PROMPTS)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + body["usage"]["completion_tokens"]


def test_token_id_prompts_are_the_text_prompts(client, reference):
    ids = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_text = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    one = client.post("/v1/completions", json={"prompt": ids[0], "max_tokens": 6, "temperature": 0}).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    assert one["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_echoed_prompt_logprobs_are_transformers_log_softmax(client, reference, folder):
    """max_tokens 0 with echo and logprobs scores the prompt alone (as lm-evaluation-harness asks)."""
    ids = reference.tokenizer.encode(PROMPTS[2])
    request = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    choice = client.post("/v1/completions", json=request).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == reference.tokenizer.decode(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"] == [reference.tokenizer.decode([t]) for t in ids]
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for position in range(1, len(ids)):
        row = expected[position - 1]
        assert logprobs["token_logprobs"][position] == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top, best = logprobs["top_logprobs"][position], row.topk(3)
        expected_top = {}  # (tokens that read the same, e.g. parts of one character, keep the likeliest)
        for token_id, value in [*zip(best.indices.tolist(), best.values.tolist()), (ids[position], None)]:
            expected_top.setdefault(reference.tokenizer.decode([token_id]), value or row[token_id].item())
        assert top == pytest.approx(expected_top, abs=1e-4)
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:k]) for k in range(len(ids))]
    [scored] = reference.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert logprobs["token_logprobs"][1:] == [e.logprob for e in scored.prompt_logprobs[1:]]


def test_streamed_completions_equal_whole_ones(client):
    request = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 10, "temperature": 0.8, "seed": 7, "logprobs": 1}
    whole = client.post("/v1/completions", json=request).json()
    with client.stream("POST", "/v1/completions", json={**request, "stream": True, "echo": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response)
    texts, tokens, reasons = {}, {}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["token_logprobs"])
            reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        index, prompt = choice["index"], PROMPTS[choice["index"] // 2]
        assert texts[index] == prompt + choice["text"]  # (echoed)
        assert tokens[index][-len(choice["logprobs"]["token_logprobs"]) :] == choice["logprobs"]["token_logprobs"]
        assert reasons[index] == choice["finish_reason"]


def test_null_fields_take_their_defaults(client, reference):
    nulls = {"n": None, "stop": None, "seed": None, "logprobs": None, "top_p": None, "user": None}
    body = client.post("/v1/completions", json={"prompt": PROMPTS[1], "temperature": 0, **nulls}).json()
    assert body["choices"][0]["text"] == greedy(reference, reference.tokenizer.encode(PROMPTS[1]), 16)[0]
    assert body["choices"][0]["logprobs"] is None


def test_seeds_reproduce_and_differ(client):
    request = {"prompt": PROMPTS[0], "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    first = [c["text"] for c in client.post("/v1/completions", json=request).json()["choices"]]
    again = [c["text"] for c in client.post("/v1/completions", json=request).json()["choices"]]
    other = [c["text"] for c in client.post("/v1/completions", json={**request, "seed": 12}).json()["choices"]]
    assert first == again and len(set(first)) > 1 and other != first


def test_stop_strings_cut_the_text(client, reference):
    ids = reference.tokenizer.encode(PROMPTS[0])
    text, _ = greedy(reference, ids, 24, ignore_eos=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    request = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop": [stop], "ignore_eos": True}
    choice = client.post("/v1/completions", json=request).json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_chat_renders_the_template_and_streams_the_same(client, reference):
    messages = [{"role": "system", "content": "alpha"}, {"role": "user", "content": "beta gamma"}]
    template = tokenizer_chat_template("tokenizer", reference.tokenizer)
    ids = reference.tokenizer.encode(template.render(messages, add_generation_prompt=True))
    end = chat_stop_ids(template, reference.tokenizer)
    text, tokens = greedy(reference, ids, 8, stop_token_ids=end)
    request = {"messages": messages, "max_completion_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    body = client.post("/v1/chat/completions", json=request).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"] == {"role": "assistant", "content": text}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [reference.tokenizer.decode([t]) for t in tokens]
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert body["usage"]["prompt_tokens"] == len(ids)
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
        chunks = events(response)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == text
    streamed = [c for chunk in chunks for c in chunk["choices"][0]["logprobs"]["content"]]
    assert streamed == content


BAD_REQUESTS = [
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "model": "another"}, 404, "model"),
    ({"prompt": "alpha " * 200}, 400, "prompt"),
    ({"prompt": "alpha", "max_tokens": 127}, 400, "max_tokens"),
    ({"prompt": [[5, 99999]]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "a", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format"),
]


@pytest.mark.parametrize("request_body, status, param", BAD_REQUESTS)
def test_bad_requests_answer_openai_errors_and_the_server_goes_on(client, request_body, status, param):
    response = client.post("/v1/completions", json=request_body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    good = client.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 2, "temperature": 0})
    assert good.status_code == 200 and len(good.json()["choices"]) == 1


def test_malformed_bodies_and_unknown_routes(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


def test_limits_name_the_flag(folder):
    engine = engine_of(folder, max_prompt_tokens=5, max_request_n=2, max_request_tokens=4)
    with TestClient(build_app(engine, ServerSettings("tiny"))) as client:
        cases = [
            ({"prompt": "alpha beta gamma delta epsilon zeta"}, "prompt", "--max-prompt-tokens"),
            ({"prompt": "alpha", "n": 3}, "n", "--max-request-n"),
            ({"prompt": "alpha", "max_tokens": 5}, "max_tokens", "--max-request-tokens"),
        ]
        for body, param, flag in cases:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == param and flag in response.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "alpha"}], "temperature": 0}
        response = client.post("/v1/chat/completions", json=chat)  # (longer than 5 tokens once rendered)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_api_key(folder):
    with TestClient(build_app(engine_of(folder), ServerSettings("tiny", api_key="s3cret"))) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = client.get("/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert client.post("/tokenize", json={"prompt": "a"}, headers=headers).status_code == 401
        for route in ("/docs", "/openapi.json", "/redoc"):
            assert client.get(route).status_code == 404
        models = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]


def test_tokenizer_routes_are_the_tokenizer(client, reference):
    tokenizer = reference.tokenizer
    ids = client.post("/tokenize", json={"prompt": PROMPTS[2]}).json()
    assert ids["tokens"] == tokenizer.encode(PROMPTS[2]) and ids["count"] == len(ids["tokens"])
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPTS[2]}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and tokenizer.encode(info["eos_token"]) == [tokenizer.eod_id]
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 128
    response = client.post("/detokenize", json={"tokens": [10**6]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_completion_logprobs_block():
    texts = TokenTexts(lambda ids: {1: "ab", 2: "c", 3: "de"}[ids[0]])
    entries = [TokenLogprob(1, -0.5, [(2, -0.1), (1, -0.5)]), TokenLogprob(3, -float("inf"), [(2, -0.2)])]
    block = completion_logprobs(entries, texts, 4)
    assert block["tokens"] == ["ab", "de"] and block["text_offset"] == [4, 6]
    assert block["top_logprobs"] == [{"c": -0.1, "ab": -0.5}, {"c": -0.2, "de": -9999.0}]
    assert block["token_logprobs"] == [-0.5, -9999.0]


def test_an_engine_failure_answers_500_and_health_says_so(folder, monkeypatch):
    engine = engine_of(folder)

    def broken_step():
        raise RuntimeError("a broken kernel")

    monkeypatch.setattr(engine, "step", broken_step)
    with TestClient(build_app(engine, ServerSettings("tiny"))) as client:
        response = client.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 2})
        assert response.status_code == 500
        assert (
            response.json()["error"]["type"] == "server_error"
            and "a broken kernel" in response.json()["error"]["message"]
        )
        assert client.post("/v1/completions", json={"prompt": "alpha"}).status_code == 500
        assert client.get("/health").status_code == 503 and client.get("/health").json()["status"] == "failed"


def test_serve_refuses_bad_flags_in_one_line(folder, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    cases = [
        (["--port", "70000"], "--port 70000: must be between 0"),
        (["--port", port], f"--port {port}: already in use on 127.0.0.1"),
        (["--hidden-size", "64"], "--hidden-size: paratron serve takes the model from the checkpoint"),
        (["--api-key", " "], "--api-key: empty"),
    ]
    try:
        for flags, expected in cases:
            assert main(["serve", "--load", str(folder), *flags]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert expected in lines[-1] and not any("Traceback" in line for line in lines)
    finally:
        taken.close()


def test_an_idle_engine_keeps_the_other_ranks_waiting_about_every_second(folder, monkeypatch):
    engine = engine_of(folder)
    calls = []
    monkeypatch.setattr(engine, "keep_alive", lambda: calls.append(time.monotonic()))
    with TestClient(build_app(engine, ServerSettings("tiny"))) as client:
        time.sleep(3.2)
        assert client.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 2}).status_code == 200
    assert 2 <= len(calls) <= 4 and all(0.9 < b - a < 2 for a, b in zip(calls, calls[1:]))


SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ALPHA = [{"role": "user", "content": "alpha"}]
WILD = {"max_tokens": 100, "n": 4, "temperature": 10.0, "seed": 1, "ignore_eos": True}
"""Near-uniform sampling over the tiny vocabulary: these completions draw special tokens (checked below)."""


def test_the_text_decoder_leaves_special_tokens_out_or_spaces_them(reference):
    tokenizer = reference.tokenizer
    start, end = tokenizer.encode("<|im_start|>")[0], tokenizer.encode("<|im_end|>")[0]
    special = special_token_ids(tokenizer)
    assert special == {tokenizer.eod_id, start, end}
    ids = [start, end, *tokenizer.encode("alpha beta"), end, tokenizer.eod_id]
    assert TextDecoder(tokenizer, special).decode(ids) == "alpha beta"
    kept = TextDecoder(tokenizer, special, skip=False)
    assert kept.decode(ids) == "<|im_start|> <|im_end|>alpha beta<|im_end|> <|endoftext|>"
    joined = TextDecoder(tokenizer, special, skip=False, spaces=False)
    assert joined.decode(ids) == "<|im_start|><|im_end|>alpha beta<|im_end|><|endoftext|>" == tokenizer.decode(ids)
    for decoder in (TextDecoder(tokenizer, special), kept, joined):  # (token by token, the text is the whole's)
        growing = IncrementalText(decoder, ())
        for token in ids:
            growing.add(token)
        assert growing.text == decoder.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_completions_leave_special_tokens_out_unless_kept(client, reference, skip):
    prompt = reference.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(**WILD, skip_special_tokens=skip)
    [expected] = reference.generate([prompt], params)
    special = special_token_ids(reference.tokenizer)
    assert any(set(c.token_ids[:-1]) & special for c in expected.completions)  # (a special token inside the text)
    request = {"prompt": PROMPTS[0], **WILD, "skip_special_tokens": skip}
    texts = [c["text"] for c in client.post("/v1/completions", json=request).json()["choices"]]
    assert texts == [c.text for c in expected.completions]
    assert any(token in text for text in texts for token in SPECIAL) == (not skip)
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        chunks = [choice for chunk in events(response) for choice in chunk["choices"]]
    assert ["".join(c["text"] for c in chunks if c["index"] == i) for i in range(4)] == texts


@pytest.mark.parametrize("skip", [True, False])
def test_chat_answers_leave_special_tokens_out_unless_kept(client, skip):
    request = {"messages": ALPHA, **WILD, "seed": 6, "skip_special_tokens": skip}
    answers = [c["message"]["content"] for c in client.post("/v1/chat/completions", json=request).json()["choices"]]
    assert any(token in answer for answer in answers for token in SPECIAL) == (not skip)
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
        chunks = [choice for chunk in events(response) for choice in chunk["choices"]]
    assert ["".join(c["delta"].get("content", "") for c in chunks if c["index"] == i) for i in range(4)] == answers


def test_the_decoding_fields_reach_the_engine():
    request = CompletionRequest(prompt="a", skip_special_tokens=False, spaces_between_special_tokens=False)
    params = request.params(4)
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    assert SamplingParams().skip_special_tokens and SamplingParams().spaces_between_special_tokens


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
BAD_CHATS = [
    ({"response_format": {"type": "json_object"}}, "response_format", "'json_object' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "'json_schema'"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "not supported"),
    ({"function_call": {"name": "f"}}, "function_call", "not supported"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages", "role 'tool'; the roles it may have: system, user"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages", "content part of type 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
     "messages", "type 'input_audio'"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, words", BAD_CHATS)
def test_chat_requests_for_what_the_server_does_not_do_are_refused(client, fields, param, words):
    for route in ("/v1/chat/completions", "/tokenize") if param == "messages" else ("/v1/chat/completions",):
        response = client.post(route, json={"messages": ALPHA, "max_tokens": 2, **fields})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
    good = client.post("/v1/chat/completions", json={"messages": ALPHA, "max_tokens": 2, "temperature": 0})
    assert good.status_code == 200 and len(good.json()["choices"]) == 1


def test_chat_takes_what_asks_for_nothing_more(client):
    plain = {"messages": ALPHA, "max_tokens": 3, "temperature": 0}
    expected = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "al"}, {"type": "text", "text": "pha"}]}]
    for fields in ({"response_format": {"type": "text"}}, {"function_call": "none"}, {"messages": text_parts}):
        response = client.post("/v1/chat/completions", json={**plain, **fields})
        assert response.status_code == 200 and response.json()["choices"][0]["message"] == expected
