"""`paratron generate` end to end, in process through `paratron.cli.main` (one spawned two-rank run): a tiny random
Hugging Face Llama, converted, continued from every prompt source, as a conversation, with stop strings, several
completions and log-probabilities; transformers' greedy `generate` and log-softmax are the oracle."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from test_vision_evaluate import llava_folder
from tokenizers import AddedToken

from paratron.checkpoint.formats import paratron_to_megatron
from paratron.cli import main
from paratron.commands import generate as generate_command
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.inference.engine import Engine

from tiny import WORDS

REPO = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROMPTS = ["alpha beta gamma", "delta", "kappa lambda mu nu xi omicron pi alpha beta"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A random Llama saved by transformers (ChatML tokenizer, 64 positions) and its paratron conversion."""
    root = tmp_path_factory.mktemp("llama")
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(40)]
    tokenizer = train_byte_level_bpe(iter(texts), 300)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    hf = root / "hf"
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tokenizer.save(hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    assert main(["convert", "--from", "hf", str(hf), "--to", "paratron", str(root / "ckpt")]) == 0
    return root


def generate(capsys, *args: str) -> str:
    """stdout of `paratron generate ARGS` (which must succeed)."""
    capsys.readouterr()
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def jsonl(capsys, *args: str) -> list[dict]:
    return [json.loads(line) for line in generate(capsys, *args, "--jsonl").splitlines()]


def one_line_error(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["generate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def reference(llama) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    model = transformers.LlamaForCausalLM.from_pretrained(llama / "hf").eval()
    return model, transformers.PreTrainedTokenizerFast(tokenizer_file=str(llama / "hf" / "tokenizer.json"))


def greedy_reference(reference, prompt: str, new_tokens: int) -> list[int]:
    model, tokenizer = reference
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.size(1) :].tolist()


def test_a_prompt_is_continued_as_transformers_does_and_printed_after_itself(llama, reference, capsys):
    ckpt = str(llama / "ckpt")
    out = generate(capsys, "--load", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "8")
    [record] = jsonl(capsys, "--load", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "8")
    [completion] = record["completions"]
    assert completion["token_ids"] == greedy_reference(reference, PROMPTS[0], 8)
    assert completion["finish_reason"] == "length"
    assert out == PROMPTS[0] + completion["text"] + "\n"


def test_every_prompt_source_gives_the_same_outputs(llama, tmp_path, capsys, monkeypatch):
    ckpt, common = str(llama / "ckpt"), ["--max-new-tokens", "6"]
    flags = [a for p in PROMPTS for a in ("--prompt", p)]
    expected = jsonl(capsys, "--load", ckpt, *flags, *common)
    assert [r["prompt"] for r in expected] == PROMPTS
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for file in ("prompts.txt", "prompts.jsonl"):
        assert jsonl(capsys, "--load", ckpt, "--prompt-file", str(tmp_path / file), *common) == expected
    for args in (["--prompt-file", "-"], []):  # (stdin also when no prompt is given and it is not a terminal)
        for text in ("\n".join(PROMPTS), (tmp_path / "prompts.jsonl").read_text()):
            monkeypatch.setattr(sys, "stdin", io.StringIO(text))
            assert jsonl(capsys, "--load", ckpt, *args, *common) == expected


def test_prompts_run_together_as_each_alone(llama, capsys):
    ckpt, common = str(llama / "ckpt"), ["--max-new-tokens", "10"]
    together = generate(capsys, "--load", ckpt, *[a for p in PROMPTS for a in ("--prompt", p)], *common)
    alone = [generate(capsys, "--load", ckpt, "--prompt", p, *common) for p in PROMPTS]
    blocks = [f"--- --prompt {i} ---\n{text}" for i, text in enumerate(alone, 1)]
    assert together == "".join(blocks)


def test_a_conversation_keeps_its_history(llama, reference, capsys, monkeypatch):
    seen: list[list[int]] = []
    add_request = Engine.add_request

    def spy(self, prompt_ids, *args, **kwargs):
        seen.append(list(prompt_ids))
        return add_request(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("alpha beta\n\ngamma delta\n"))
    out = generate(capsys, "--load", str(llama / "ckpt"), "--chat", "--max-new-tokens", "4")
    answers = out.splitlines()
    assert len(seen) == 2 and len(answers) == 2
    _, tokenizer = reference
    first = "<|im_start|>user\nalpha beta<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(seen[0]) == first
    second = f"{first}{answers[0]}<|im_end|>\n<|im_start|>user\ngamma delta<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(seen[1]) == second


def test_a_stop_string_ends_the_text_before_it(llama, capsys):
    ckpt, common = str(llama / "ckpt"), ["--prompt", PROMPTS[1], "--max-new-tokens", "12"]
    [full] = jsonl(capsys, "--load", ckpt, *common)
    text = full["completions"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    [stopped] = jsonl(capsys, "--load", ckpt, *common, "--stop", stop, "--stop", "never seen")
    assert stopped["completions"][0]["text"] == text[: text.index(stop)]
    assert stopped["completions"][0]["finish_reason"] == "stop"


def test_several_completions_of_a_prompt(llama, capsys):
    ckpt = str(llama / "ckpt")
    args = ["--load", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--n", "3", "--temperature", "1.5"]
    [record] = jsonl(capsys, *args, "--seed", "3")
    texts = [c["text"] for c in record["completions"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # (sampled independently)
    assert jsonl(capsys, *args, "--seed", "3") == [record]  # (the same seed, the same samples)
    out = generate(capsys, *args, "--seed", "3")
    assert out == "".join(f"--- --prompt, completion {i} ---\n{PROMPTS[0]}{t}\n" for i, t in enumerate(texts, 1))


def test_logprobs_are_transformers_log_softmax(llama, reference, capsys):
    ckpt = str(llama / "ckpt")
    [record] = jsonl(capsys, "--load", ckpt, "--prompt", PROMPTS[2], "--max-new-tokens", "5", "--logprobs", "3")
    [completion] = record["completions"]
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPTS[2]) + completion["token_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(ids) - len(completion["token_ids"]) - 1
    for i, entry in enumerate(completion["logprobs"]):
        expected = logprobs[start + i]
        assert entry["token_id"] == completion["token_ids"][i]
        assert entry["logprob"] == pytest.approx(float(expected[entry["token_id"]]), abs=1e-4)
        top = torch.topk(expected, 3)
        assert [t for t, _ in entry["top"]] == top.indices.tolist()
        assert [p for _, p in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    out = generate(capsys, "--load", ckpt, "--prompt", PROMPTS[2], "--max-new-tokens", "5", "--logprobs", "3")
    header = "log-probabilities (token, log-probability, likeliest tokens):\n"
    assert out.startswith(PROMPTS[2] + completion["text"] + "\n" + header)
    lines = out[len(PROMPTS[2] + completion["text"] + "\n" + header) :].splitlines()
    assert len(lines) == 5 and lines[0].startswith(f"  {json.dumps(tokenizer.decode(completion['token_ids'][0]))}\t")
    assert [float(line.split("\t")[1]) for line in lines] == pytest.approx(
        [e["logprob"] for e in completion["logprobs"]], abs=1e-6
    )


def test_more_tokens_than_the_context_holds_are_refused(llama, reference, tmp_path, capsys):
    ckpt = str(llama / "ckpt")
    line = one_line_error(capsys, "--load", ckpt, "--prompt", "alpha beta", "--max-new-tokens", "5000")
    used = len(reference[1].encode("alpha beta"))
    assert f"--prompt: {used} prompt tokens + 5000 new ones exceed the model's context of 64 tokens" in line
    assert f"ask for at most {64 - used} (--max-new-tokens)" in line
    assert generate(capsys, "--load", ckpt, "--prompt", "alpha beta", "--max-new-tokens", str(64 - used))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "alpha"}) + "\n{not json\n")
    line = one_line_error(capsys, "--load", ckpt, "--prompt-file", str(tmp_path / "bad.jsonl"))
    assert f"{tmp_path / 'bad.jsonl'} line 2: not JSON" in line
    assert "--chat reads the conversation from standard input" in one_line_error(
        capsys, "--load", ckpt, "--chat", "--prompt", "x"
    )
    assert "--top-p 1.5: must be in (0, 1]" in one_line_error(capsys, "--load", ckpt, "--prompt", "x", "--top-p", "1.5")


def test_a_megatron_lm_checkpoint_and_a_hugging_face_folder_generate_alike(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    paratron_to_megatron(llama / "ckpt", tmp_path / "megatron")
    args = ["--prompt", PROMPTS[2], "--max-new-tokens", "8"]
    expected = generate(capsys, "--load", str(llama / "ckpt"), *args)
    assert generate(capsys, "--load", str(tmp_path / "megatron"), *args) == expected
    assert generate(capsys, "--load", str(llama / "hf"), *args) == expected


def test_two_tensor_parallel_ranks_generate_as_one_process(llama, capsys):
    args = ["generate", "--load", str(llama / "ckpt"), *[a for p in PROMPTS for a in ("--prompt", p)]]
    args += ["--max-new-tokens", "8", "--jsonl"]
    expected = generate(capsys, *args[1:])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "paratron", *args, "--nproc", "2", "--tensor-model-parallel-size", "2"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in result.stdout.splitlines()] == [json.loads(x) for x in expected.splitlines()]


def test_the_checkpoint_precision_unless_a_flag_names_one(llama, capsys, monkeypatch):
    opened, open_engine = [], generate_command.open_engine

    def recording(*args, **kwargs):
        engine = open_engine(*args, **kwargs)
        opened.append(engine.runner.dtype)
        return engine

    monkeypatch.setattr(generate_command, "open_engine", recording)
    args = ["--load", str(llama / "ckpt"), "--prompt", PROMPTS[0], "--max-new-tokens", "4"]
    for flags in ([], ["--bf16"], ["--fp16"], ["--fp32"], ["--precision", "bf16"]):
        generate(capsys, *args, *flags)
    assert opened == [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]


def test_an_image_prompt_is_answered_as_transformers_llava_does(llama, tmp_path, capsys):
    folder = llava_folder(tmp_path / "hf")
    Image.new("RGB", (20, 24), (220, 40, 40)).save(tmp_path / "a.png")
    assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(tmp_path / "ckpt")]) == 0
    args = ["--load", str(tmp_path / "ckpt"), "--image", str(tmp_path / "a.png"), "--chat-template", "tokenizer"]
    records = jsonl(capsys, *args, "--prompt", "mu", "--prompt", "nu xi", "--max-new-tokens", "6")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor.from_pretrained(folder),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    for record, prompt in zip(records, ["mu", "nu xi"], strict=True):
        messages = [{"role": "user", "content": f"<image>\n{prompt}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=text, images=[Image.open(tmp_path / "a.png").convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        expected = out[0, inputs["input_ids"].size(1) :].tolist()
        assert record["completions"][0]["token_ids"] == expected
        assert len(expected) > 2, expected  # (an answer, not an end of turn at once)
    assert "has no vision encoder" in one_line_error(
        capsys, "--load", str(llama / "ckpt"), "--image", str(tmp_path / "a.png"), "--prompt", "x"
    )


def test_a_lone_prompt_is_streamed_as_its_tokens_come(llama, capsys, monkeypatch):
    args = ["generate", "--load", str(llama / "ckpt"), "--prompt", PROMPTS[1], "--max-new-tokens", "12"]
    steps = []
    step = Engine.step

    def counted(self):
        outputs = step(self)
        steps.append(len(stdout.getvalue()))  # (what was printed before this step's output)
        return outputs

    stdout = io.StringIO()
    monkeypatch.setattr(Engine, "step", counted)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(args) == 0
    text = stdout.getvalue()
    assert text.startswith(PROMPTS[1]) and text.endswith("\n") and len(text) > len(PROMPTS[1]) + 1
    assert steps[0] == len(PROMPTS[1]) and len(set(steps)) > 3  # (the prompt first, then the text step by step)
