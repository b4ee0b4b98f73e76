"""`paratron evaluate` on a LLaVA-format file with real image files reports the loss transformers computes for the
same samples with its own processor (LlavaProcessor: the tokenizer's chat template, CLIP's image processor, the
image token expanded), labels -100 outside the assistant's turns: within 1e-5 relative, packed and unpacked on one
process, and at TP2. The image processor travels from the Hugging Face folder into the converted checkpoint, in
either of the layouts transformers saves it in: preprocessor_config.json (the image processor's settings alone) and
processor_config.json (the whole processor, the image settings under "image_processor"; the newest releases write
no preprocessor_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the reference; installed with the test extras
from PIL import Image
from test_finetune_cli import CHATML_WITH_GENERATION
from tokenizers import AddedToken

from paratron.cli import main
from paratron.data.tokenizer import train_byte_level_bpe

from tiny import WORDS, save_random_hf_model, write_processor_config

COLOURS = [(220, 40, 40), (40, 200, 60), (50, 60, 230), (240, 220, 30)]
SAMPLES = [
    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nmu"}, {"from": "gpt", "value": "gamma"}]},
    {"conversations": [{"from": "human", "value": "epsilon"}, {"from": "gpt", "value": "zeta eta theta"}]},
    {
        "image": "b.png",
        "conversations": [
            {"from": "human", "value": "iota <image>"},
            {"from": "gpt", "value": "kappa"},
            {"from": "human", "value": "mu nu"},
            {"from": "gpt", "value": "xi omicron pi"},
        ],
    },
    {
        "image": ["c.png", "d.png"],
        "conversations": [{"from": "human", "value": "<image> <image>\nrho"}, {"from": "gpt", "value": "sigma"}],
    },
]  # fmt: skip
ROLES = {"human": "user", "gpt": "assistant"}


NEWEST_STATISTICS = dict(image_mean=[0.3, 0.6, 0.2], image_std=[0.2, 0.25, 0.4])
"""The image statistics of the folder in the newest layout: not CLIP's defaults, so that defaults in their place
would change the loss."""


def llava_folder(folder: Path, newest_layout: bool = False) -> Path:
    """A random LLaVA (CLIP encoder, Llama with grouped-query attention) with a ChatML tokenizer holding <image>,
    and CLIP's image processor at 16 pixels, as transformers saves them; `newest_layout`: the processor written
    as the newest transformers writes it (processor_config.json, no preprocessor_config.json), with
    `NEWEST_STATISTICS`."""
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 20), 200)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>", "<image>")])
    folder.mkdir(parents=True)
    tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML_WITH_GENERATION, "eos_token": "<|im_end|>"}), encoding="utf-8"
    )
    vision = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, patch_size=8)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision, image_size=16),
        text_config=transformers.LlamaConfig(
            **text, vocab_size=tokenizer.vocab_size, num_key_value_heads=2, max_position_embeddings=256
        ),
        image_token_id=tokenizer.hf.token_to_id("<image>"),
    )
    save_random_hf_model(transformers.LlavaForConditionalGeneration, config, folder)
    if not newest_layout:
        transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16).save_pretrained(folder)
        return folder
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16, **NEWEST_STATISTICS)
    write_processor_config(folder, json.loads(image_processor.to_json_string()))
    assert not (folder / "preprocessor_config.json").exists()
    return folder


def transformers_loss(folder: Path, images: Path) -> tuple[float, int]:
    """Per-token mean over the samples, as transformers computes it with its processor."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    image_processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    total, count = 0.0, 0
    for sample in SAMPLES:
        messages = [{"role": ROLES[turn["from"]], "content": turn["value"]} for turn in sample["conversations"]]
        paths = sample.get("image", [])
        pictures = [Image.open(images / p).convert("RGB") for p in ([paths] if isinstance(paths, str) else paths)]
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        inputs = processor(text=text, images=pictures or None, return_tensors="pt")
        ids = inputs["input_ids"][0]
        # transformers' assistant mask over the unexpanded ids, each image token repeated as the processor did
        repeats = torch.tensor(
            [(ids == image_id).sum() // max(len(pictures), 1) if t == image_id else 1 for t in marked["input_ids"]]
        )
        mask = torch.tensor(marked["assistant_masks"]).bool().repeat_interleave(repeats)
        labels = torch.where(mask, ids, -100)
        with torch.no_grad():
            logits = model(input_ids=ids[None], pixel_values=inputs.get("pixel_values")).logits[0]
        total += torch.nn.functional.cross_entropy(logits[:-1].double(), labels[1:], reduction="sum").item()
        count += int((labels[1:] != -100).sum())
    return total / count, count


def _prepare(root: Path, newest_layout: bool) -> tuple[Path, Path, float, int]:
    folder = llava_folder(root / "hf", newest_layout)
    for name, colour, size in zip("abcd", COLOURS, [(20, 24), (40, 16), (16, 16), (30, 50)]):
        Image.new("RGB", size, colour).save(root / f"{name}.png")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES), encoding="utf-8")
    assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(root / "ckpt")]) == 0
    return root, data, *transformers_loss(folder, root)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path, float, int]:
    return _prepare(tmp_path_factory.mktemp("llava"), newest_layout=False)


def _evaluate(root: Path, data: Path, *flags: str) -> dict:
    output = root / f"eval{'-'.join(flags)}.json"
    common = ["--load", str(root / "ckpt"), "--sft", "--data-path", str(data), "--seq-length", "96"]
    assert main(["evaluate", *common, "--micro-batch-size", "2", *flags, "--output", str(output)]) == 0
    return json.loads(output.read_text())


@pytest.mark.parametrize("packing", ["--sft-pack", "--no-sft-pack"])
def test_evaluate_equals_transformers_on_images(prepared, packing):
    root, data, expected, tokens = prepared
    assert (root / "ckpt").is_dir() and any((root / "ckpt").rglob("preprocessor_config.json"))
    result = _evaluate(root, data, packing)
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


def test_evaluate_equals_transformers_with_the_newest_processor_layout(tmp_path):
    """The processor settings transformers' newest releases write (processor_config.json alone) are read, carried
    into the converted checkpoint and used: the loss is transformers' (CLIP's default statistics in their place
    would change it)."""
    root, data, expected, tokens = _prepare(tmp_path, newest_layout=True)
    carried = list((root / "ckpt").rglob("processor_config.json"))
    assert carried and json.loads(carried[0].read_text())["image_processor"]["image_mean"] == [0.3, 0.6, 0.2]
    result = _evaluate(root, data, "--sft-pack")
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.spawns
def test_evaluate_at_tp2_equals_transformers_on_images(prepared):
    root, data, expected, tokens = prepared
    result = _evaluate(root, data, "--nproc", "2", "--tensor-model-parallel-size", "2")
    assert result["tokens"] == tokens and result["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_missing_image_is_one_line_naming_file_and_line(prepared, tmp_path, capsys):
    root, _, _, _ = prepared
    bad = tmp_path / "bad.jsonl"
    lines = [SAMPLES[1], {"image": "gone.png", "conversations": SAMPLES[0]["conversations"]}]
    bad.write_text("".join(json.dumps(s) + "\n" for s in lines), encoding="utf-8")
    capsys.readouterr()
    code = main(
        ["evaluate", "--load", str(root / "ckpt"), "--sft", "--data-path", str(bad), "--image-folder", str(root)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{bad}:2" in err and "gone.png" in err, err
