"""Fine-tuning from the command line: `paratron evaluate` against transformers, bad conversations,
`preprocess --sft`, per-task validation, task shares of a blend, and LoRA export.

Every command runs in this process through `paratron.cli.main` (the code path of the console
script, minus the interpreter start-up): none of them starts a worker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import peft  # the references; installed with the test extras
import pytest
import torch
import transformers
from test_cli import QUIET, assert_one_line_error, in_process
from tokenizers import AddedToken

from paratron.checkpoint import load_pretrained
from paratron.cli import main
from paratron.config import build_config
from paratron.data.build import build_data
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.inference.params import SamplingParams
from paratron.model.lora import LoRALinear
from serve_model import engine_of

from tiny import WORDS, write_conversations

# ChatML with the assistant turn marked for transformers' return_assistant_tokens_mask
CHATML_WITH_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "alpha beta"},
        {"role": "user", "content": "gamma delta epsilon"},
        {"role": "assistant", "content": "zeta eta"},
        {"role": "user", "content": "theta"},
        {"role": "assistant", "content": "iota kappa lambda mu"},
    ],
    [{"role": "user", "content": "nu xi"}, {"role": "assistant", "content": "omicron pi alpha beta gamma"}],
    [
        {"role": "user", "content": "delta"},
        {"role": "assistant", "content": "epsilon"},
        {"role": "user", "content": "zeta eta theta iota"},
        {"role": "assistant", "content": "kappa lambda"},
    ],
] * 3


def hf_model_folder(folder: Path, kind: str) -> Path:
    """A random Hugging Face Llama or Qwen2 with a ChatML tokenizer whose template marks assistant turns."""
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 20), 200)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    folder.mkdir(parents=True)
    tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML_WITH_GENERATION, "eos_token": "<|im_end|>"}), encoding="utf-8"
    )
    settings = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**settings) if kind == "llama" else transformers.Qwen2Config(**settings)
    model_class = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    model_class(config).save_pretrained(folder)
    return folder


def transformers_loss(folder: Path) -> tuple[float, int]:
    """Per-token mean over all conversations, labels -100 outside assistant turns, as transformers computes it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([encoded["input_ids"]])
        labels = torch.where(torch.tensor([encoded["assistant_masks"]]).bool(), ids, -100)
        with torch.no_grad():
            logits = model(ids).logits
        total += torch.nn.functional.cross_entropy(
            logits[0, :-1].double(), labels[0, 1:], ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels[0, 1:] != -100).sum())
    return total / count, count


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_evaluate_equals_transformers_on_conversations(tmp_path, kind):
    folder = hf_model_folder(tmp_path / "hf", kind)
    assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(tmp_path / "ckpt")]) == 0
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    expected, tokens = transformers_loss(folder)
    for packing in ("--sft-pack", "--no-sft-pack"):
        output = tmp_path / f"eval{packing}.json"
        common = ["--load", str(tmp_path / "ckpt"), "--sft", "--data-path", str(data), "--seq-length", "128"]
        assert main(["evaluate", *common, packing, "--micro-batch-size", "2", "--output", str(output)]) == 0
        result = json.loads(output.read_text())
        assert result["tokens"] == tokens and result["tasks"]["chats"]["tokens"] == tokens
        assert result["loss"] == pytest.approx(expected, rel=1e-5), packing


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("conversations")
    write_conversations(folder)
    return folder


def sft_flags(data: Path, run_dir: Path, *paths: str) -> list[str]:
    return [
        "--config",
        "debug",
        "--no-mock-data",
        "--sft",
        "--data-path",
        *(paths or [str(data / "chat.jsonl")]),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(data / "tokenizer.json"),
        "--chat-template",
        "chatml",
        "--seq-length",
        "64",
        "--log-interval",
        "1",
        "--train-iters",
        "6",
        "--lr-warmup-iters",
        "1",
        "--eval-iters",
        "0",
        "--run-dir",
        str(run_dir),
        *QUIET,
    ]


BAD_LINES = {
    "not-json": ("{'messages': ", "not valid JSON"),
    "no-form": (json.dumps({"text": "alpha"}), "messages"),
    "no-assistant": (json.dumps({"messages": [{"role": "user", "content": "alpha"}]}), "no assistant"),
    "unknown-role": (json.dumps({"messages": [{"role": "bot", "content": "alpha"}]}), "bot"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_conversation_is_named_by_file_and_line(tmp_path, conversations, capsys, case):
    line, expected = BAD_LINES[case]
    good = (conversations / "qa.jsonl").read_text().splitlines()[:2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*good, line]) + "\n", encoding="utf-8")
    save = tmp_path / "ckpt"
    code = main(["train", *sft_flags(conversations, tmp_path / "run", str(bad)), "--save", str(save)])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1, error
    assert "bad.jsonl:3:" in error[0] and expected in error[0], error[0]
    assert not save.exists()  # nothing half-written


def test_a_template_that_fails_to_render_is_named(tmp_path, conversations, capsys):
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    )
    flags = sft_flags(conversations, tmp_path / "run", str(conversations / "qa.jsonl"))
    result = in_process(capsys, "train", *flags, "--chat-template", str(template))
    assert_one_line_error(result, "qa.jsonl:1:")
    assert "needs a system turn" in result.stderr


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--lora-rank", "0"], "--lora-rank 0: must be at least 1"),
        (["--lora-rank", "4", "--lora-targets", "qkv,attn"], "--lora-targets qkv,attn: unknown layer attn"),
        (["--sft-truncation", "error", "--seq-length", "8"], "chat.jsonl:1:"),
    ],
)
def test_bad_settings_are_named(tmp_path, conversations, capsys, flags, expected):
    assert main(["train", *sft_flags(conversations, tmp_path / "run"), *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and expected in error[0], error


def test_preprocessed_conversations_train_like_the_jsonl(tmp_path, conversations):
    prefix = tmp_path / "pre" / "chat"
    assert (
        main(
            [
                "preprocess",
                "--sft",
                "--input",
                str(conversations / "chat.jsonl"),
                "--output-prefix",
                str(prefix),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(conversations / "tokenizer.json"),
                "--chat-template",
                "chatml",
            ]
        )
        == 0
    )
    assert main(["train", *sft_flags(conversations, tmp_path / "raw")]) == 0
    assert main(["train", *sft_flags(conversations, tmp_path / "pre-run", str(prefix))]) == 0
    raw, pre = (
        [json.loads(x)["loss"] for x in open(d / "metrics.jsonl")] for d in (tmp_path / "raw", tmp_path / "pre-run")
    )
    assert raw == pre and len(raw) == 6


def test_blend_shares_follow_the_weights_and_validation_is_per_task(tmp_path, conversations):
    chat, qa = str(conversations / "chat.jsonl"), str(conversations / "qa.jsonl")
    flags = sft_flags(conversations, tmp_path / "run", "0.7", chat, "0.3", qa)
    flags += ["--eval-iters", "1", "--eval-interval", "3", "--split", "80,20,0"]
    assert main(["train", *flags]) == 0
    records = [json.loads(line) for line in open(tmp_path / "run" / "eval.jsonl")]
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        tasks = record["tasks"]
        assert set(tasks) == {"chat", "qa"} and all(t["tokens"] > 0 for t in tasks.values())
        overall = sum(t["loss"] * t["tokens"] for t in tasks.values()) / sum(t["tokens"] for t in tasks.values())
        assert record["val_loss"] == pytest.approx(overall, rel=1e-6)
    # the training blend: which task each of the first 2,000 samples comes from
    config = build_config(
        dict(
            sft=True,
            data_path=["0.7", chat, "0.3", qa],
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(conversations / "tokenizer.json"),
            chat_template="chatml",
            seq_length=48,
            train_iters=250,
            micro_batch_size=8,
            eval_iters=0,
            data_cache_path=str(tmp_path / "cache"),
        )
    )
    train = build_data(config, 8, log=lambda _: None).train
    shares = np.bincount(np.asarray(train.dataset_index[:2000]), minlength=2) / 2000
    assert shares == pytest.approx([0.7, 0.3], abs=0.01)


def test_lora_checkpoints_export_merged_and_as_peft(tmp_path):
    folder = hf_model_folder(tmp_path / "hf", "llama")
    assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(tmp_path / "base")]) == 0
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    flags = [
        "train",
        "--config",
        str(tmp_path / "base" / "model.yaml"),
        "--load",
        str(tmp_path / "base"),
        "--finetune",
        "--sft",
        "--data-path",
        str(data),
        "--seq-length",
        "96",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "3",
        "--lr",
        "0.05",
        "--eval-iters",
        "0",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "qkv,fc2",
        "--save",
        str(tmp_path / "lora"),
        "--run-dir",
        str(tmp_path / "run"),
        *QUIET,
    ]
    assert main(flags) == 0
    lora = ["convert", "--from", "paratron", str(tmp_path / "lora")]
    assert main([*lora, "--to", "hf", str(tmp_path / "plain")]) == 2  # adapters need --merge-lora
    assert main([*lora, "--to", "hf", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert main([*lora, "--to", "peft", str(tmp_path / "adapter")]) == 0

    ids = torch.tensor([Tokenizer.from_file(folder).encode("<|im_start|>user\nalpha beta<|im_end|>\n")])
    ours = load_pretrained(tmp_path / "lora")(ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert (ours - base(ids).logits).abs().max() > 1e-3  # the adapters trained
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapted(ids).logits, ours, rtol=1e-4, atol=1e-4)
    # (served as it is, unmerged: generate and serve build the adapters from the checkpoint)
    engine = engine_of(tmp_path / "lora")
    trained = [m.lora_b for m in engine.runner.model.modules() if isinstance(m, LoRALinear)]
    assert len(trained) == 2 * 4 and all(b.abs().max() > 0 for b in trained)  # (2 layers x q, k, v, fc2)
    [scored] = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=0, prompt_logprobs=0))
    expected = torch.log_softmax(ours[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    served = torch.tensor([entry.logprob for entry in scored.prompt_logprobs[1:]], dtype=torch.float64)
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-4)
