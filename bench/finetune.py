"""Fine-tuning throughput: paratron's `train --sft` against TRL's SFTTrainer, one process.

Both fine-tune the same Llama-shaped model (a random Hugging Face Llama, converted for
paratron, so both start from the same weights) on the same conversations: "write the function
whose docstring is ..." -> the function's source, from the Python standard library (a real
spread of lengths), rendered with ChatML, loss on the answers only, conversations packed
(TRL: packing=True, its best-fit-decreasing strategy; paratron: --sft-pack), fp32, AdamW,
the same batch of rows x sequence length per step. Throughput counts trained (unmasked)
tokens per second of steady-state steps (the first `--warmup` steps are not timed).

Also measured with paratron alone: packing against one conversation per row (padded), and
LoRA (rank 16 on qkv,proj,fc1,fc2) against full fine-tuning: step time and the training state
(parameters, gradients, optimizer state) from --log-memory.

    pip install trl==1.16.0   # the peer (not a dependency of paratron)
    python bench/finetune.py --output bench/results/finetune.json
    python bench/finetune.py --smoke  # tiny, two steps a side (TRL's only where it is installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import AddedToken

from common import NO_DROPOUT, add_smoke_argument, apply_smoke
from llama_common import save_random_llama
from paratron.checkpoint.formats import hf_to_paratron
from paratron.config import build_config
from paratron.data.corpus import docstring_instructions, stdlib_files
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.training.run import run_training

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def pairs(limit: int, max_source: int) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for path in sorted(stdlib_files()):
        out += docstring_instructions(path, max_source, max_source)
        if len(out) >= limit:
            break
    return out[:limit]


def prepare(folder: Path, args: argparse.Namespace) -> list[dict[str, str]]:
    """Conversations (jsonl), a ChatML tokenizer, a random HF Llama and its paratron conversion."""
    data = pairs(args.conversations, args.max_source)
    with open(folder / "pairs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in data)
    tokenizer = train_byte_level_bpe(iter(p["prompt"] + p["completion"] for p in data), args.vocab)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    hf = folder / "hf"
    hf.mkdir()
    tokenizer.save(hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    save_random_llama(hf, args, tokenizer.vocab_size, args.seq_length, args.kv_heads)
    hf_to_paratron(hf, folder / "paratron")
    return data


def paratron_side(folder: Path, args: argparse.Namespace, name: str, **extra: Any) -> dict[str, Any]:
    run = folder / f"run-{name}"
    settings = dict(
        sft=True,
        data_path=[str(folder / "pairs.jsonl")],
        chat_template="tokenizer",
        load=str(folder / "paratron"),
        finetune=True,
        seq_length=args.seq_length,
        micro_batch_size=args.rows,
        train_iters=args.warmup + args.steps,
        lr=args.lr,
        lr_decay_style="constant",
        weight_decay=0.0,
        clip_grad=1.0,
        eval_iters=0,
        split="100,0,0",
        run_dir=str(run),
        log_interval=1,
        log_memory=True,
        progress_bar=False,
        tensorboard=False,
        data_cache_path=str(folder / "cache"),
        **NO_DROPOUT,
    )
    settings.update(extra)
    config = build_config(settings, recipe=str(folder / "paratron" / "model.yaml"))
    run_training(config)
    records = [json.loads(line) for line in open(run / "metrics.jsonl")][args.warmup :]
    memory = json.loads((run / "memory.json").read_text())["ranks"][0]
    return {
        "trained_tokens_per_s": statistics.median(r["trained_tokens_per_s"] for r in records),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "step_s": statistics.median(args.rows * args.seq_length / r["tokens_per_s"] for r in records),
        "losses": [r["loss"] for r in records],
        "training_state_mib": {k: (memory.get(k) or 0) / 2**20 for k in ("parameters", "gradients", "optimizer_state")},
    }


def trl_side(folder: Path, args: argparse.Namespace, data: list[dict[str, str]]) -> dict[str, Any]:
    import datasets
    from trl import SFTConfig, SFTTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf", attn_implementation="sdpa")
    rows = [
        {
            "prompt": [{"role": "user", "content": p["prompt"]}],
            "completion": [{"role": "assistant", "content": p["completion"]}],
        }
        for p in data
    ]
    trained: list[int] = []
    model.register_forward_pre_hook(
        lambda module, a, kw: trained.append(int((kw["labels"] != -100).sum())), with_kwargs=True
    )
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.start)

    config = SFTConfig(
        output_dir=str(folder / "trl"),
        max_length=args.seq_length,
        packing=True,
        per_device_train_batch_size=args.rows,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    steady = slice(args.warmup, None)
    seconds, tokens = times[steady], trained[steady]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h][steady]
    return {
        "trained_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
        "step_s": statistics.median(seconds),
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=1500)
    parser.add_argument("--max-source", type=int, default=1500, help="Longest function source, in characters.")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--ffn-hidden-size", type=int, default=704)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4, help="Sequences per step.")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(conversations=40, max_source=400, vocab=300, hidden_size=64, ffn_hidden_size=128, num_layers=2)
    apply_smoke(args, parser, **tiny, heads=4, kv_heads=2, seq_length=128, rows=2, warmup=1, steps=1)
    peer = not args.smoke or importlib.util.find_spec("trl") is not None
    if not peer:
        print("--smoke: TRL is not installed (pip install trl), so its side is left out", flush=True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = prepare(folder, args)
        result: dict[str, Any] = {"settings": vars(args) | {"output": str(args.output)}}
        result["paratron"] = paratron_side(folder, args, "packed")
        if peer:
            result["trl"] = trl_side(folder, args, data)
        result["paratron_padded"] = paratron_side(folder, args, "padded", sft_pack=False)
        result["paratron_lora"] = paratron_side(folder, args, "lora", lora_rank=16, lora_alpha=32.0, lr=1e-3)
    ours = result["paratron"]
    if peer:
        result["ratio_vs_trl"] = ours["trained_tokens_per_s"] / result["trl"]["trained_tokens_per_s"]
    result["packing_gain"] = ours["trained_tokens_per_s"] / result["paratron_padded"]["trained_tokens_per_s"]
    result["lora_step_time_ratio"] = result["paratron_lora"]["step_s"] / ours["step_s"]
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k or "gain" in k}, indent=1))
    for name in ("paratron", "trl", "paratron_padded", "paratron_lora"):
        if name not in result:
            continue
        side = result[name]
        print(f"{name:16} {side['trained_tokens_per_s']:9,.0f} trained tokens/s  step {side['step_s']:.3f} s")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
