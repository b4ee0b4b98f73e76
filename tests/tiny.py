"""Small configs shared by tests."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from paratron.config import Config, build_config
from paratron.data.tokenizer import train_byte_level_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def tiny_config(run_dir: Path, **overrides: Any) -> Config:
    """The debug recipe, quiet: no progress bar, no TensorBoard, metrics every step."""
    values: dict[str, Any] = dict(
        run_dir=str(run_dir), progress_bar=False, tensorboard=False, log_interval=1, eval_iters=0
    )
    values.update(overrides)
    return build_config(values, recipe="debug")


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
