"""`make finetune-demo`: instruction-tune the demo's model on pairs built from the embedded corpus.

1. pairs "write the function whose docstring is ..." -> the function's source, from the Python
   standard library's own modules (one file in twenty held out for evaluation);
2. the demo's checkpoint (runs/demo/checkpoints), or, when there is none, a small model pretrained
   here on the same corpus for 300 steps;
3. `paratron evaluate` of that model on the held-out pairs, `paratron train --config
   finetune-demo` (2 processes, loss on the answers only, conversations packed), the evaluation
   again, and the fine-tuned model's answer to a held-out instruction.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from paratron.data.corpus import docstring_instructions, stdlib_files

RUN = Path("runs/finetune-demo")
DATA = RUN / "data"
MAX_DOCSTRING, MAX_SOURCE = 160, 320  # characters: a pair fits in 128 tokens of the demo's tokenizer


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
    example = json.loads((DATA / "heldout.jsonl").read_text(encoding="utf-8").splitlines()[0])
    print(f"\nheld-out loss on the answers: {before:.3f} before fine-tuning, {after:.3f} after")
    print(f"\na held-out instruction:\n{example['prompt']}\n\nthe fine-tuned model's answer (sampled):")
    paratron(
        "generate", "--load", str(RUN / "checkpoints"), "--chat-template", "chatml", "--prompt", example["prompt"],
        "--max-new-tokens", "100", "--temperature", "0.7", "--top-k", "40",
    )  # fmt: skip
    print(f"\nthe function in the library:\n{example['completion']}")


if __name__ == "__main__":
    main()
