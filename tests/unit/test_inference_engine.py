"""The inference engine on one device against transformers: continuous batching equals one request at a time (and
transformers' greedy `generate`), prompt and generated-token log-probabilities equal its log-softmax, sampling is
seeded per request, stops and limits behave, and the cache gives every block back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from paratron.checkpoint.formats import hf_to_paratron
from paratron.checkpoint.pretrained import load_pretrained
from paratron.config import build_config
from paratron.config.inference import InferenceConfig
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.inference.engine import Engine
from paratron.inference.loading import FewRowLinear, engine_for_model, open_engine
from paratron.inference.params import RequestError, SamplingParams
from paratron.inference.sampling import apply_penalties, filtered
from paratron.inference.text import IncrementalText
from paratron.model import fused_linear
from paratron.model.fused_linear import FewRowChoices

from tiny import save_random_hf_model

LLAMA = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def prompts(lengths: tuple[int, ...] = (5, 9, 3, 17, 11, 7, 2, 13), vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class Letters:
    """A tokenizer whose token i is one letter (for stop strings); token 0 ends a document."""

    stop_ids = (0,)
    vocab_size = 96

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("llama")
    hf = save_random_hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA), folder / "hf")
    hf_to_paratron(folder / "hf", folder / "converted")
    return hf, load_pretrained(folder / "converted"), folder


def engine(model: torch.nn.Module, tokenizer: object = None, **settings) -> Engine:
    return engine_for_model(
        model, tokenizer, InferenceConfig(**{"kv_cache_tokens": 512, "kv_block_size": 4, **settings})
    )


def test_continuous_batching_equals_one_at_a_time_and_transformers(llama):
    hf, model, _ = llama
    params = SamplingParams(max_tokens=12)
    # a small cache and step budget: long prompts run in pieces and sequences are preempted and computed again
    tight = engine(model, kv_cache_tokens=48, max_batch_tokens=8, max_running_requests=3)
    batched = tight.generate(prompts(), params)
    assert tight.scheduler.preemptions > 0
    assert tight.free_cache_tokens == tight.cache_tokens  # every block given back
    roomy = engine(model)
    for prompt, output in zip(prompts(), batched):
        alone = roomy.generate([prompt], params)[0].completions[0].token_ids
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert output.completions[0].token_ids == alone == expected[0, len(prompt) :].tolist()
        assert output.completions[0].finish_reason == "length"


def test_prompt_and_token_logprobs_equal_transformers(llama):
    hf, model, _ = llama
    scored = engine(model).generate(prompts(), SamplingParams(max_tokens=0, prompt_logprobs=3))
    for prompt, output in zip(prompts(), scored):
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        assert output.completions[0].token_ids == [] and output.completions[0].finish_reason == "length"
        for i, entry in enumerate(output.prompt_logprobs[1:]):
            assert entry.token_id == prompt[i + 1]
            assert entry.logprob == pytest.approx(reference[i, prompt[i + 1]].item(), abs=1e-4)
            best = torch.topk(reference[i], 3)
            assert [t for t, _ in entry.top] == best.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    prompt = prompts()[3]
    output = engine(model).generate([prompt], SamplingParams(max_tokens=6, logprobs=2))[0].completions[0]
    run = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        min_new_tokens=6,
    )
    for entry, logits, token in zip(output.logprobs, run.logits, output.token_ids):
        reference = torch.log_softmax(logits[0].float(), dim=-1)
        assert entry.token_id == token and entry.logprob == pytest.approx(reference[token].item(), abs=1e-4)
        assert entry.top[0][0] == token and len(entry.top) == 2


def test_an_engine_that_owns_its_model_decodes_few_rows_its_way_with_the_same_results(llama, monkeypatch):
    """`paratron generate`'s engine owns its model: stacked weights in one storage, the linear layers computing a
    decoding step's few rows the faster way (here forced to the transposed way everywhere). Tokens and
    log-probabilities are those of an engine that leaves the model as it is, and transformers' tokens."""

    class Always(FewRowChoices):
        def use_transposed(self, flat, weight) -> bool:
            return True

    hf, model, folder = llama
    monkeypatch.setattr(fused_linear, "FEW_ROWS", Always())
    owned = engine_for_model(
        load_pretrained(folder / "converted"), None, InferenceConfig(kv_cache_tokens=512), owns_model=True
    )
    params = SamplingParams(max_tokens=8, logprobs=2)
    ours, theirs = owned.generate(prompts(), params), engine(model).generate(prompts(), params)
    for prompt, mine, other in zip(prompts(), ours, theirs):
        got, want = mine.completions[0], other.completions[0]
        assert got.token_ids == want.token_ids
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert got.token_ids == expected[0, len(prompt) :].tolist()
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)


def test_seeded_sampling_is_reproducible_in_any_batch(llama):
    _, model, _ = llama
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.01,
        seed=7,
        n=3,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
    )
    first = engine(model).generate(prompts()[:3], params)
    again = engine(model, max_batch_tokens=4).generate(prompts()[:3][::-1], params)[::-1]
    tokens = [[c.token_ids for c in o.completions] for o in first]
    assert tokens == [[c.token_ids for c in o.completions] for o in again]
    assert len({tuple(t) for t in tokens[0]}) > 1  # n completions drawn independently
    other = engine(model).generate(prompts()[:1], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [c.token_ids for c in other[0].completions] != tokens[0]


def test_filters_and_penalties_match_transformers():
    torch.manual_seed(0)
    logits = torch.randn(96)
    for params, processor in [
        (SamplingParams(temperature=1, top_k=5), transformers.TopKLogitsWarper(5)),
        (SamplingParams(temperature=1, top_p=0.8), transformers.TopPLogitsWarper(0.8)),
        (SamplingParams(temperature=1, min_p=0.2), transformers.MinPLogitsWarper(0.2)),
    ]:
        ours = torch.isfinite(filtered(logits, params))
        theirs = torch.isfinite(processor(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0])
        assert torch.equal(ours, theirs), params
    seen = torch.tensor([3, 5, 5, 9])
    ours = apply_penalties(logits, SamplingParams(repetition_penalty=1.3), seen, seen[:0])
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.allclose(ours, theirs)
    ours = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), seen, seen)
    expected = logits.clone()
    expected[3] -= 0.75
    expected[5] -= 1.25
    expected[9] -= 0.75
    assert torch.allclose(ours, expected)


def test_stops_text_and_end_of_document(llama):
    _, model, _ = llama
    eng = engine(model, Letters())
    free = eng.generate(prompts()[:1], SamplingParams(max_tokens=12))[0].completions[0]
    text = Letters().decode(free.token_ids)
    stop = text[4:6]
    cut = eng.generate(prompts()[:1], SamplingParams(max_tokens=12, stop=(stop, "zzzz")))[0].completions[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.find(stop)]
    token = free.token_ids[3]
    ended = eng.generate(prompts()[:1], SamplingParams(max_tokens=12, stop_token_ids=(token,)))[0].completions[0]
    first = free.token_ids.index(token)
    assert ended.token_ids == free.token_ids[: first + 1] and ended.stop_reason == token
    assert ended.text == text[:first]  # (the stop token's text left out)
    streamed: list[str] = []
    eng.generate(
        prompts()[:1],
        SamplingParams(max_tokens=12, stop=(stop,)),
        on_output=lambda o: streamed.append(o.completions[0].text),
    )
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:])) and streamed[-1] == cut.text
    assert all(stop not in s for s in streamed)


def test_requests_it_cannot_serve_are_refused_by_field(llama):
    _, model, _ = llama
    eng = engine(model, kv_cache_tokens=40)
    cases = [
        ([], SamplingParams(), "prompt", "empty"),
        ([1, 200], SamplingParams(), "prompt", "outside the vocabulary"),
        (list(range(64)), SamplingParams(max_tokens=1), "prompt", "context of 64"),
        ([1] * 60, SamplingParams(max_tokens=5), "max_tokens", "at most 4"),
        ([1] * 30, SamplingParams(max_tokens=20), "max_tokens", "KV cache"),
        ([1], SamplingParams(max_tokens=-1), "max_tokens", "negative"),
        ([1], SamplingParams(top_p=0), "top_p", "(0, 1]"),
        ([1], SamplingParams(n=0), "n", "at least 1"),
        ([1], SamplingParams(logprobs=21), "logprobs", "between 0 and 20"),
    ]
    for prompt, params, field, words in cases:
        with pytest.raises(RequestError, match=re.escape(words)) as caught:
            eng.add_request(prompt, params)
        assert caught.value.param == field
    assert not eng.has_work()
    whole_context = engine(model).generate([list(range(64))], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert whole_context[0].finished and len(whole_context[0].prompt_logprobs) == 64


def test_abort_frees_the_blocks(llama):
    _, model, _ = llama
    eng = engine(model)
    eng.add_request(prompts()[3], SamplingParams(max_tokens=30), request_id="a")
    eng.add_request(prompts()[4], SamplingParams(max_tokens=30), request_id="b")
    eng.step()
    eng.step()
    assert eng.free_cache_tokens < eng.cache_tokens
    eng.abort("a")
    outputs = {o.request_id: o for o in eng.step()}
    assert outputs["a"].completions[0].finish_reason == "abort" and not outputs["b"].finished
    eng.abort("b")
    eng.step()
    assert eng.free_cache_tokens == eng.cache_tokens and not eng.has_work()


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_sliding_window_and_experts_equal_transformers(tmp_path, family):
    shape = dict(LLAMA, sliding_window=6)
    if family == "mistral":
        hf = save_random_hf_model(transformers.MistralForCausalLM, transformers.MistralConfig(**shape), tmp_path / "hf")
    else:
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        hf = save_random_hf_model(transformers.MixtralForCausalLM, config, tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    model = load_pretrained(tmp_path / "converted")
    outputs = engine(model, max_batch_tokens=8).generate(prompts(), SamplingParams(max_tokens=8))
    for prompt, output in zip(prompts(), outputs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert output.completions[0].token_ids == expected[0, len(prompt) :].tolist()


def test_a_checkpoint_runs_in_its_precision(llama, tmp_path):
    hf, _, _ = llama
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf.float()
    eng = open_engine(build_config(dict(load=str(tmp_path / "bf16"), kv_cache_tokens=128)))
    assert eng.runner.dtype == torch.bfloat16 and eng.model_name == "bf16"
    assert {p.dtype for p in eng.runner.model.parameters()} == {torch.bfloat16}
    assert isinstance(eng.runner.model.output, FewRowLinear)  # (a checkpoint's model is laid out for decoding)
    asked = open_engine(build_config(dict(load=str(tmp_path / "bf16"), kv_cache_tokens=128)), precision="fp16")
    assert asked.runner.dtype == torch.float16 and asked.runner.cache.layers[0].keys.dtype == torch.float16
    prompt = prompts()[0]
    expected = hf.to(torch.bfloat16).generate(
        torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5
    )
    hf.float()
    assert (
        eng.generate([prompt], SamplingParams(max_tokens=5))[0].completions[0].token_ids
        == expected[0, len(prompt) :].tolist()
    )


def test_text_grows_token_by_token_as_the_whole_decodes():
    text = "naïve café — 東京 🙂 ok, héllo wörld! " * 3
    tokenizer = train_byte_level_bpe(iter([text] * 20), 300)
    ids = tokenizer.encode(text)
    growing = IncrementalText(tokenizer, ())
    seen = []
    for token in ids:
        assert growing.add(token) is None
        seen.append(growing.final())
    assert growing.text == tokenizer.decode(ids) and "\ufffd" not in "".join(seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    stopping = IncrementalText(tokenizer, ("東京 🙂", "zz"))
    found = next(s for s in (stopping.add(t) for t in ids) if s is not None)
    assert found == "東京 🙂" and stopping.text == "naïve café — "
