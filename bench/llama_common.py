"""The random Hugging Face Llama the inference and fine-tuning benchmarks compare on: both sides read the same
weights (transformers from the folder, paratron after converting it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import transformers


def save_random_llama(
    folder: Path,
    args: argparse.Namespace,
    vocab: int,
    positions: int,
    kv_heads: int,
    seed: int = 0,
    **settings: Any,
) -> transformers.LlamaForCausalLM:
    """A random, untied Llama of the benchmark's shape flags (--hidden-size, --ffn-hidden-size, --num-layers,
    --heads), with `vocab` tokens, `positions` positions, `kv_heads` key/value heads and any other config.json
    `settings`, its weights drawn after `torch.manual_seed(seed)`, saved into `folder`; the model."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        **settings,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model
