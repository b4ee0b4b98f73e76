"""A tiny random Hugging Face Llama for the server's tests, and an engine over it in this process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import AddedToken

from paratron.config import build_config
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.inference.loading import open_engine

from tiny import WORDS, save_random_hf_model

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_llama_folder(folder: Path, context: int = 128, hidden: int = 32, layers: int = 2) -> Path:
    """A random Llama (fp32) with a byte-level BPE tokenizer that ends text with <|endoftext|> and a ChatML
    template whose turns end with <|im_end|>."""
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 20), 300)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(folder / "tokenizer.json")
    declared = {"chat_template": CHATML, "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(declared), encoding="utf-8")
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        torch_dtype=torch.float32,
        bos_token_id=None,
        eos_token_id=tokenizer.eod_id,
        pad_token_id=None,
    )
    save_random_hf_model(transformers.LlamaForCausalLM, config, folder)
    return folder


def engine_of(folder: Path, **inference: Any) -> Any:
    """The engine of the model in `folder`, in this process, with these inference settings."""
    config = build_config({"load": str(folder)})
    settings = dataclasses.replace(config.inference, **inference)
    return open_engine(dataclasses.replace(config, inference=settings), log=lambda *a, **k: None)
