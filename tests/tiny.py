"""Small configs shared by tests."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from paratron.config import Config, build_config
from paratron.config.inference import InferenceConfig
from paratron.config.schema import ModelConfig
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.inference.loading import engine_for_model
from paratron.inference.params import SamplingParams
from paratron.training import run as training_run
from paratron.training.run import run_training

GPT_FLAVOUR = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=97,
    max_position_embeddings=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA_STYLE = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
"""What makes a model Llama-like (the sizes aside), as config fields."""
LLAMA_FLAVOUR = dataclasses.replace(GPT_FLAVOUR, **LLAMA_STYLE, num_query_groups=2, ffn_hidden_size=80)
FLAVOURS = {"gpt": GPT_FLAVOUR, "llama": LLAMA_FLAVOUR}
"""Two tiny shapes of the model family: GPT-2-like and Llama-like."""

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


MODERN = dict(hidden_dropout=0.0, attention_dropout=0.0, adam_beta2=0.95, lr_decay_style="cosine")
"""The values the recipes set where paratron's defaults are Megatron-LM's (dropout 0.1, Adam beta2 0.999, linear
decay)."""

QUIET = dict(MODERN, progress_bar=False, tensorboard=False, log_interval=1, eval_iters=0)
"""A test run's logging (no progress bar, no TensorBoard, metrics every step, no evaluation) and the recipes' modern
training values."""

PARITY_RUN = dict(QUIET, train_iters=20, lr=3e-3, lr_warmup_iters=2, seed=5)
"""A parity test's 20-step run (its model, data and layout aside)."""


def tiny_config(run_dir: Path, **overrides: Any) -> Config:
    """The debug recipe, quiet: no progress bar, no TensorBoard, metrics every step."""
    values: dict[str, Any] = dict(QUIET, run_dir=str(run_dir))
    values.update(overrides)
    return build_config(values, recipe="debug")


def training_records(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Train with `settings` (field names and values, `run_dir` among them) and return the records of
    its metrics.jsonl (none on ranks that write no metrics)."""
    run_training(build_config(settings))
    path = Path(settings["run_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


@contextmanager
def no_loss_plot() -> Iterator[None]:
    """Runs in this block draw no loss.png (their losses and metrics.jsonl unchanged): matplotlib's drawing costs a
    tiny run about as much CPU as a step, and its import a second in each fresh rank. For tests that compare numbers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training_run, "plot_loss_curve", lambda run_dir, title="": Path(run_dir) / "loss.png")
        yield


def write_conversations(folder: Path, chats: int = 40, pairs: int = 30) -> None:
    """A byte-level BPE tokenizer.json (with ChatML's special tokens) and two fine-tuning tasks:
    chat.jsonl (multi-turn, with a system turn; every other one with a second assistant turn) and
    qa.jsonl (prompt/completion)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_byte_level_bpe(iter([text(30) for _ in range(100)]), 400)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(folder / "tokenizer.json")
    with open(folder / "chat.jsonl", "w") as f:
        for i in range(chats):
            turns = [
                {"role": "system", "content": text(2)},
                {"role": "user", "content": text(rng.randint(1, 4))},
                {"role": "assistant", "content": text(rng.randint(1, 6))},
            ]
            if i % 2:
                turns += [{"role": "user", "content": text(2)}, {"role": "assistant", "content": text(3)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    with open(folder / "qa.jsonl", "w") as f:
        for _ in range(pairs):
            f.write(json.dumps({"prompt": text(rng.randint(1, 3)), "completion": text(rng.randint(1, 5))}) + "\n")


def save_random_hf_model(model_class: type, config: Any, directory: Path) -> torch.nn.Module:
    """A Hugging Face model with random weights (norms and biases moved off 1 and 0, so that they
    count), saved as safetensors into `directory`; returned in eval mode."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_processor_config(folder: Path, image_processor: dict[str, Any]) -> None:
    """A folder in the layout of transformers' newest releases: the whole processor in processor_config.json,
    the image processor's settings under "image_processor", and no preprocessor_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    whole = {"image_processor": image_processor, "processor_class": "LlavaProcessor", "patch_size": 8}
    (folder / "processor_config.json").write_text(json.dumps(whole), encoding="utf-8")


def decoding_error(model: torch.nn.Module, prompt: list[int], new_tokens: int, chunk: int) -> float:
    """Worst difference between the log-probabilities of the inference engine (the prompt run through its paged
    KV cache in pieces of `chunk` tokens, then `new_tokens` decoded one at a time, greedily) and those of one
    forward pass over the whole sequence; asserts that the greedy tokens are that forward's argmax."""
    settings = InferenceConfig(kv_cache_tokens=256, kv_block_size=4, max_batch_tokens=chunk)
    engine = engine_for_model(model, None, settings)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    output = engine.generate([prompt], params)[0]
    tokens = output.completions[0].token_ids
    with torch.no_grad():
        whole = torch.log_softmax(model(torch.tensor([prompt + tokens]))[0].float(), dim=-1)
    assert tokens == whole[len(prompt) - 1 : -1].argmax(-1).tolist()
    scored = [(entry.logprob, whole[i, prompt[i + 1]]) for i, entry in enumerate(output.prompt_logprobs[1:])]
    scored += [
        (entry.logprob, whole[len(prompt) - 1 + i, t])
        for i, (entry, t) in enumerate(zip(output.completions[0].logprobs, tokens))
    ]
    return max(abs(ours - float(theirs)) for ours, theirs in scored)
