"""A tiny Llama with a tokenizer that adds a beginning-of-text token, and three local lm-evaluation-harness tasks
over jsonl files: multiple choice (loglikelihood), whole texts (loglikelihood_rolling, longer than the model's
context) and short answers (generate_until)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import AddedToken, processors

from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf
from paratron.data.tokenizer import EOD_TOKEN, train_byte_level_bpe

from tiny import WORDS

CONTEXT = 48
"""The model's context in tokens: the texts of the rolling task are longer, so they take several windows."""

TASKS = ("tiny_choice", "tiny_rolling", "tiny_answer")

CHOICE_YAML = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
ROLLING_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""
ANSWER_YAML = """task: tiny_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tasks(folder: Path, docs: int = 12) -> Path:
    """The three tasks' YAML files and their jsonl data in `folder` (the --include-path)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "choice": [
            {"question": words(rng, 4), "choices": [words(rng, rng.randint(1, 3)) for _ in range(4)], "label": i % 4}
            for i in range(docs)
        ],
        "rolling": [{"text": words(rng, rng.randint(30, 70)) + "."} for _ in range(docs // 2)],
        "answer": [{"question": words(rng, 3), "answer": words(rng, 1)} for _ in range(docs // 2)],
    }
    for name, yaml in (("choice", CHOICE_YAML), ("rolling", ROLLING_YAML), ("answer", ANSWER_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]), encoding="utf-8")
        (folder / f"tiny_{name}.yaml").write_text(yaml.format(data=data), encoding="utf-8")
    return folder


def write_llama(folder: Path) -> Path:
    """A random Hugging Face Llama whose tokenizer adds <s> before every text (as Llama's does)."""
    import transformers  # (the model's maker; spawned ranks that only read the checkpoint need not load it)

    rng = random.Random(1)
    tokenizer = train_byte_level_bpe(iter([words(rng, 40) for _ in range(50)]), 300)
    tokenizer.hf.add_special_tokens([AddedToken("<s>", special=True)])
    bos = tokenizer.hf.token_to_id("<s>")
    tokenizer.hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    folder.mkdir(parents=True)
    tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": EOD_TOKEN, "tokenizer_class": "PreTrainedTokenizerFast"}),
        encoding="utf-8",
    )
    settings = dict(
        vocab_size=tokenizer.hf.get_vocab_size(with_added_tokens=True),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=tokenizer.hf.token_to_id(EOD_TOKEN),
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).save_pretrained(folder)
    return folder


def checkpoints(root: Path) -> tuple[Path, Path]:
    """A paratron checkpoint of the tiny Llama, and the Hugging Face folder `paratron convert --to hf` writes
    from it (the harness' `hf` model reads that one)."""
    checkpoint = hf_to_paratron(write_llama(root / "made"), root / "paratron")
    return checkpoint, paratron_to_hf(checkpoint, root / "hf")
