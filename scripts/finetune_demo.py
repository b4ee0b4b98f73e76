"""`make finetune-demo`: instruction-tune the demo's model on pairs built from the embedded corpus.

1. pairs "write the function whose docstring is ..." -> the function's source, from the Python
   standard library's own modules (one file in twenty held out for evaluation);
2. the demo's checkpoint (runs/demo/checkpoints), or, when there is none, a small model pretrained
   here on the same corpus for 300 steps;
3. `paratron evaluate` of that model on the held-out pairs, `paratron train --config
   finetune-demo` (2 processes, loss on the answers only, conversations packed), the evaluation
   again, and the fine-tuned model's answer to a held-out instruction: the first one that leaves room in the model's
   context for NEW_TOKENS of answer (the instructions are this Python's own docstrings, which differ between versions),
   else the one that leaves the most, answered in what it leaves.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.data.corpus import docstring_instructions, stdlib_files
from paratron.data.sft import tokenizer_chat_template

RUN = Path("runs/finetune-demo")
DATA = RUN / "data"
MAX_DOCSTRING, MAX_SOURCE = 160, 320  # characters: a pair fits in 128 tokens of the demo's tokenizer
NEW_TOKENS = 100  # of the closing answer, when the context has room for them


def write_pairs() -> tuple[int, int]:
    DATA.mkdir(parents=True, exist_ok=True)
    train, heldout = [], []
    for path in sorted(stdlib_files()):
        held = int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 20 == 0
        (heldout if held else train).extend(docstring_instructions(path, MAX_DOCSTRING, MAX_SOURCE))
    for name, pairs in (("train", train), ("heldout", heldout)):
        with open(DATA / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(pair) + "\n" for pair in pairs)
    return len(train), len(heldout)


def paratron(*args: str) -> None:
    print("$ paratron " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "paratron", *args], check=True)


def held_out_loss(checkpoint: str, name: str) -> float:
    output = RUN / f"{name}.json"
    paratron(
        "evaluate", "--load", checkpoint, "--sft", "--data-path", str(DATA / "heldout.jsonl"),
        "--chat-template", "chatml", "--seq-length", "128", "--micro-batch-size", "16", "--output", str(output),
    )  # fmt: skip
    return json.loads(output.read_text())["loss"]


def closing_prompt(
    pairs: list[dict[str, str]], prompt_tokens: Callable[[str], int], context: int, wanted: int = NEW_TOKENS
) -> tuple[dict[str, str], int]:
    """The held-out pair whose instruction the fine-tuned model answers, and how many tokens it may write: the first
    pair whose prompt (`prompt_tokens` counts it as generate renders it) leaves `wanted` tokens of the `context`, else
    the one that leaves the most room, with that room."""
    rooms = [context - prompt_tokens(pair["prompt"]) for pair in pairs]
    for pair, room in zip(pairs, rooms, strict=True):
        if room >= wanted:
            return pair, wanted
    best = max(range(len(pairs)), key=rooms.__getitem__)
    if rooms[best] < 1:
        raise SystemExit(f"no held-out instruction leaves room for an answer in the model's context of {context}")
    return pairs[best], rooms[best]


def chat_prompt_tokens(checkpoint: Path) -> tuple[Callable[[str], int], int]:
    """How many tokens an instruction is as `paratron generate --chat-template chatml` gives it to the checkpoint's
    model, and that model's context."""
    info = read_checkpoint(checkpoint)
    tokenizer = tokenizer_from_checkpoint(info)
    assert tokenizer is not None, f"{checkpoint} holds the demo's tokenizer"
    template = tokenizer_chat_template("chatml", tokenizer)

    def count(text: str) -> int:
        return len(tokenizer.encode(template.render([{"role": "user", "content": text}], add_generation_prompt=True)))

    return count, info.config.model.max_position_embeddings


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # (our lines and the commands' stay in order)
    train, heldout = write_pairs()
    print(f"{train:,} training pairs and {heldout:,} held-out pairs in {DATA}")
    base = "runs/demo/checkpoints"
    overrides: list[str] = []
    if not (Path(base) / "latest_checkpointed_iteration.txt").is_file():
        base = str(RUN / "base")
        print("no demo checkpoint (make demo): pretraining a small model on the standard library first")
        paratron("train", "--config", "demo", "--train-iters", "300", "--save", base, "--run-dir", f"{RUN}/pretrain")
        overrides = ["--load", base]
    before = held_out_loss(base, "before")
    paratron("train", "--config", "finetune-demo", *overrides)
    after = held_out_loss(str(RUN / "checkpoints"), "after")
    pairs = [json.loads(line) for line in (DATA / "heldout.jsonl").read_text(encoding="utf-8").splitlines()]
    example, new_tokens = closing_prompt(pairs, *chat_prompt_tokens(RUN / "checkpoints"))
    print(f"\nheld-out loss on the answers: {before:.3f} before fine-tuning, {after:.3f} after")
    print(f"\na held-out instruction:\n{example['prompt']}\n\nthe fine-tuned model's answer (sampled):")
    paratron(
        "generate", "--load", str(RUN / "checkpoints"), "--chat-template", "chatml", "--prompt", example["prompt"],
        "--max-new-tokens", str(new_tokens), "--temperature", "0.7", "--top-k", "40",
    )  # fmt: skip
    print(f"\nthe function in the library:\n{example['completion']}")


if __name__ == "__main__":
    main()
