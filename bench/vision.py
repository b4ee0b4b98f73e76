"""Vision-language training: paratron's LLaVA-style model against transformers' `LlavaForConditionalGeneration`,
its image pipeline against transformers' CLIP and SigLIP image processors, and memory per pipeline stage.

1. step: one process, fp32. Both sides hold the same random weights (paratron's, copied into transformers' model by
   name) and train on the same batch (rows of text with one image each, its placeholders expanded); the two losses
   are checked to agree at every step. Forward, backward and an AdamW step are timed in alternating rounds, in
   wall-clock and in this process's CPU time; the median step of each side is reported with the ratio
   paratron / transformers.
2. pixels: images per second of `paratron.data.vision.ImageProcessor` and of transformers' processors (the Pillow
   backend) with CLIP's 336-pixel and SigLIP's 384-pixel settings, on the same JPEG and PNG files of mixed sizes,
   in this process and through a torch DataLoader with two workers; their pixel values are checked to agree.
3. memory: every pipeline stage's memory at PP2 (the encoder on the first stage), as `paratron train --dry-run`
   builds it, as the planner predicts it, and as `--log-memory` measures it in a two-process run, for the even
   split of the language model's layers and for the split the planner picks.

    python bench/vision.py                 # all three, results in bench/results/vision.json
    python bench/vision.py step            # one part
    python bench/vision.py --smoke         # tiny: does it still run?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from common import LLAMA_STYLE, NO_DROPOUT, PRECISION, RESULTS, SEED, add_smoke_argument, apply_smoke
from paratron.checkpoint.hf.weights import weights_to_hf
from paratron.config import build_config
from paratron.config.schema import ModelConfig
from paratron.config.validation import validate
from paratron.data.vision import ImageProcessor
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.model.gpt import GPT, build_model
from paratron.planning.candidates import balanced_ends, output_ratio, vision_ratio
from paratron.planning.dry_run import dry_run, kernels_for
from paratron.planning.memory_prediction import predict_memory
from paratron.training.run import run_training

PARTS = ("step", "pixels", "memory")

# ---------------------------------------------------------------- the model, on both sides


def model_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A CLIP-style encoder (LLaVA reads its second-to-last layer, class token dropped) and an MLP projector in front
    of a Llama-style language model, as flat settings."""
    return dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        num_query_groups=args.hidden // 128,
        ffn_hidden_size=3 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        **LLAMA_STYLE,
        untie_embeddings_and_output_weights=True,
        **NO_DROPOUT,
        vision_type="clip",
        img_h=args.image,
        img_w=args.image,
        patch_dim=args.patch,
        vision_num_layers=args.vision_layers,
        vision_hidden_size=args.vision_hidden,
        vision_num_attention_heads=args.vision_hidden // 64,
        vision_feature_layer=-2,
    )


_VISION_NAMES = {
    "class_embedding": "embeddings.class_embedding",
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "position_embedding.weight": "embeddings.position_embedding.weight",
    "pre_norm": "pre_layrnorm",
    "post_norm": "post_layernorm",
    "attention_norm": "layer_norm1",
    "mlp_norm": "layer_norm2",
    "attention.in_proj.q": "self_attn.q_proj",
    "attention.in_proj.k": "self_attn.k_proj",
    "attention.in_proj.v": "self_attn.v_proj",
    "attention.out_proj": "self_attn.out_proj",
    "mlp.in_proj.up": "mlp.fc1",
    "mlp.out_proj": "mlp.fc2",
}
"""paratron's encoder names -> transformers' CLIPVisionTransformer names (pieces of a dotted name)."""


def llava_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' LlavaForConditionalGeneration tensors from paratron's vision-language model's `state`: the
    language model through paratron's Llama converter, the encoder and projector by `_VISION_NAMES`."""
    text = {k: v for k, v in state.items() if not k.startswith("vision.")}
    out = {}
    for name, tensor in weights_to_hf(text, "llama").items():
        out[name.replace("model.", "model.language_model.", 1)] = tensor
    for name, tensor in state.items():
        if name.startswith("vision.projector."):
            out[name.replace("vision.projector.", "model.multi_modal_projector.")] = tensor
        elif name.startswith("vision.encoder."):
            hf = name.removeprefix("vision.encoder.").replace("layers.", "encoder.layers.")
            for ours, theirs in _VISION_NAMES.items():
                hf = hf.replace(ours, theirs)
            out["model.vision_tower." + hf] = tensor
    return out


def llava_config(m: ModelConfig) -> transformers.LlavaConfig:
    """transformers' configuration of the same model."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=m.vision_hidden_size,
        intermediate_size=m.vision_ffn_hidden_size,
        num_hidden_layers=m.vision_num_layers,
        num_attention_heads=m.vision_num_attention_heads,
        image_size=m.img_h,
        patch_size=m.patch_dim,
        layer_norm_eps=m.vision_norm_epsilon,
        hidden_act="quick_gelu",
    )
    text = transformers.LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rotary_base,
        tie_word_embeddings=False,
    )
    return transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=m.placeholder_id,
        vision_feature_layer=m.vision_feature_layer,
        vision_feature_select_strategy=m.vision_feature_select,
        projector_hidden_act="gelu",
        multimodal_projector_bias=m.vision_projection_bias,
        tie_word_embeddings=False,
    )


def image_batch(m: ModelConfig, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """`rows` rows of `m.max_position_embeddings` tokens, each with one image's placeholders at a random place, and
    their images; the placeholders are not trained."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.placeholder_id, (rows, m.max_position_embeddings), generator=generator)
    for row in range(rows):
        start = int(torch.randint(0, m.max_position_embeddings - m.image_tokens + 1, (1,), generator=generator))
        tokens[row, start : start + m.image_tokens] = m.placeholder_id
    labels = tokens.masked_fill(tokens == m.placeholder_id, -100)
    pixels = torch.randn((rows, 3, m.img_h, m.img_w), generator=generator)
    return {"input_ids": tokens, "labels": labels, "pixel_values": pixels}


def paratron_loss(model: GPT, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], images=batch["pixel_values"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def transformers_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def both_models(m: ModelConfig) -> tuple[GPT, torch.nn.Module]:
    """paratron's model (initialized from SEED) and transformers' with its weights copied in; every tensor of
    transformers' model is given, none is left over."""
    ours = build_model(m, "cpu", seed=SEED)
    theirs = transformers.LlavaForConditionalGeneration(llava_config(m))
    missing, unexpected = theirs.load_state_dict(llava_state(ours.state_dict()), strict=False)
    if missing or unexpected:
        raise AssertionError(f"weights do not map: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ours, theirs


def timed_steps(
    model: torch.nn.Module, loss_of: Any, batch: dict[str, Any], losses: list[float], args: argparse.Namespace
) -> tuple[float, float]:
    """Seconds per training step (forward, backward, AdamW, zeroing) after `args.warmup` untimed ones, of the wall
    clock and of this process's CPU time (the work done, less sensitive to other processes on a shared machine);
    every step's loss goes to `losses`."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.1)

    def step() -> None:
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for _ in range(args.warmup):
        step()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - start) / args.steps, (time.process_time() - cpu) / args.steps


def measure_step(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: alternating timed rounds (each with an AdamW of its own) from the same weights on the same batch; both
    sides take the same steps, so their losses must agree at every step (the first is the same forward)."""
    m = ModelConfig(**model_settings(args))
    batch = image_batch(m, args.rows, seed=SEED)
    ours, theirs = both_models(m)
    sides = {"paratron": (ours, paratron_loss), "transformers": (theirs, transformers_loss)}
    times: dict[str, list[Any]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, (model, loss_of) in sides.items():
            times[side].append(timed_steps(model, loss_of, batch, losses[side], args))
    for mine, peer in zip(losses["paratron"], losses["transformers"]):
        if abs(mine - peer) > 1e-3 * abs(peer):
            raise AssertionError(f"losses differ: {losses}")
    ms = {side: 1000 * statistics.median(wall for wall, _ in t) for side, t in times.items()}
    cpu_ms = {side: 1000 * statistics.median(cpu for _, cpu in t) for side, t in times.items()}
    return {
        "model": {**model_settings(args), "image_tokens": m.image_tokens, "rows": args.rows, "precision": PRECISION},
        "parameters": sum(p.numel() for p in ours.parameters()),
        "losses": losses,
        "ms_per_step": ms,
        "ratio": ms["paratron"] / ms["transformers"],
        "cpu_ms_per_step": cpu_ms,
        "cpu_ratio": cpu_ms["paratron"] / cpu_ms["transformers"],
        "rounds": {side: [[1000 * wall, 1000 * cpu] for wall, cpu in ts] for side, ts in times.items()},
    }


# ---------------------------------------------------------------- pixels


def write_images(folder: Path, count: int, seed: int) -> list[Path]:
    """`count` pictures of mixed sizes (portrait, landscape, square; 200-900 px a side), JPEG and PNG alternately:
    smooth gradients with noise, so that both formats compress as photographs do."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        width, height = (int(v) for v in rng.integers(200, 900, size=2))
        ys, xs = np.mgrid[0:height, 0:width]
        base = np.stack([xs * 255 // width, ys * 255 // height, (xs + ys) * 127 // (width + height)], axis=-1)
        noise = rng.integers(0, 40, size=(height, width, 3))
        picture = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
        path = folder / f"{i:03d}.{'jpg' if i % 2 == 0 else 'png'}"
        picture.save(path, quality=90) if path.suffix == ".jpg" else picture.save(path)
        paths.append(path)
    return paths


def processors(kind: str, size: int) -> tuple[ImageProcessor, Any]:
    """paratron's processor and transformers' (Pillow backend) with the same settings."""
    if kind == "clip":
        square = {"height": size, "width": size}
        return ImageProcessor.clip(size), transformers.CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size=square
        )
    return ImageProcessor.siglip(size), transformers.SiglipImageProcessorPil(size={"height": size, "width": size})


class TheirPixels:
    """transformers' processor as a function of one picture (a class, so that workers can be handed it)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, picture: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.processor(images=picture, return_tensors="np")["pixel_values"][0])


class Pictures(Dataset):
    """Each file opened, decoded and made into pixels by `process` (what a data-loader worker does)."""

    def __init__(self, paths: list[Path], process: Any) -> None:
        self.paths, self.process = paths, process

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with Image.open(self.paths[index]) as picture:
            return self.process(picture)


def images_per_second(dataset: Pictures, workers: int) -> float:
    """Every picture once, in this process (`workers` 0) or through a DataLoader of `workers` processes, which
    have started and made one pass untimed (the steady state of a long run)."""
    if workers == 0:
        start = time.perf_counter()
        for i in range(len(dataset)):
            dataset[i]
        return len(dataset) / (time.perf_counter() - start)
    loader = DataLoader(dataset, batch_size=8, num_workers=workers, collate_fn=torch.stack, persistent_workers=True)
    for _ in loader:
        pass
    start = time.perf_counter()
    for _ in loader:
        pass
    return len(dataset) / (time.perf_counter() - start)


def measure_pixels(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: pixel values compared, then images per second of both sides, alternating, best of the rounds."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_images(Path(folder), args.images, seed=SEED)
        for kind, size in (("clip", args.clip_size), ("siglip", args.siglip_size)):
            mine, peer = processors(kind, size)
            sides = {"paratron": Pictures(paths, mine), "transformers": Pictures(paths, TheirPixels(peer))}
            gap = max(float((sides["paratron"][i] - sides["transformers"][i]).abs().max()) for i in range(len(paths)))
            if gap > 1e-5:
                raise AssertionError(f"{kind}: pixel values differ from transformers' by {gap}")
            row: dict[str, Any] = {"size": size, "largest_pixel_difference": gap}
            for workers in (0, args.workers):
                rates: dict[str, list[float]] = {"paratron": [], "transformers": []}
                for _ in range(args.rounds):
                    for side, dataset in sides.items():
                        rates[side].append(images_per_second(dataset, workers))
                best = {side: max(r) for side, r in rates.items()}
                row[f"workers_{workers}"] = {"images_per_s": best, "ratio": best["paratron"] / best["transformers"]}
            results[kind] = row
    results["images"] = f"{args.images} files, JPEG and PNG alternately, 200-900 px a side"
    return results


# ---------------------------------------------------------------- memory per pipeline stage

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


def run_settings(args: argparse.Namespace, split: tuple[int | None, int | None], run_dir: str) -> dict[str, Any]:
    """A one-step PP2 run of the model on synthetic image-text rows, its memory measured (--log-memory)."""
    first, last = split
    return dict(
        model_settings(args),
        mock_data=True,
        seq_length=args.seq,
        micro_batch_size=args.rows,
        global_batch_size=args.rows * args.micro_batches,
        pipeline_model_parallel_size=2,
        decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last,
        train_iters=1,
        lr=1e-4,
        seed=SEED,
        log_memory=True,
        log_interval=1,
        eval_iters=0,
        progress_bar=False,
        tensorboard=False,
        run_dir=run_dir,
    )


def measured_memory(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank of a two-process run: every rank's `--log-memory` report (bytes), in rank order."""
    initialize("gloo")
    run_training(build_config(settings))
    return json.loads((Path(settings["run_dir"]) / "memory.json").read_text())["ranks"]


def stage_rows(roles: list[Any]) -> list[dict[str, int]]:
    """A planning prediction's bytes per stage, in the categories measured."""
    return [{c: getattr(role, c) for c in CATEGORIES} for role in roles]


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: per-stage memory at PP2, even split and the planner's split: built (dry run), predicted (the
    planner's formulas), measured (two processes, --log-memory)."""
    even = build_config(run_settings(args, (None, None), "unused"))
    planner_split = balanced_ends(args.layers, 2, output_ratio(even, 1, 1), vision_ratio(even, 1, 1))
    splits = {"even": (None, None)}
    if planner_split != (None, None):
        splits["planner"] = planner_split
    kernels = kernels_for("cpu")
    results: dict[str, Any] = {"splits": {}}
    with tempfile.TemporaryDirectory() as root:
        for name, split in splits.items():
            settings = run_settings(args, split, f"{root}/{name}")
            config = build_config(settings)
            layout = validate(config, 2, check_data=False)
            measured = run_ranks(measured_memory, 2, settings, timeout=900.0)[0]
            results["splits"][name] = {
                "layers_per_stage": [len(r) for r in layout.pipeline.ranges],
                "dry_run": stage_rows(dry_run(config, layout, kernels)),
                "planner": stage_rows(predict_memory(config, 2, kernels, layout)),
                "measured": [
                    {**{c: r[c] for c in CATEGORIES[:3]}, "activations": r["activations_peak"]} for r in measured
                ],
            }
    m = even.model
    results["encoder_parameters"] = encoder_parameters(m)
    results["note"] = (
        f"{args.micro_batches} micro-batches of {args.rows} rows x {args.seq} tokens; synthetic rows hold 0 to "
        f"{min(2, (args.seq - 1) // m.image_tokens)} images of {m.image_tokens} tokens; 1F1B, {PRECISION}, AdamW"
    )
    return results


def encoder_parameters(m: ModelConfig) -> dict[str, int]:
    """Elements of the encoder (all; those that run and train) and of the projector."""
    with torch.device("meta"):
        vision = GPT(m).vision
    size = {name: sum(p.numel() for p in part.parameters()) for name, part in vision.named_children()}
    return {**size, "encoder_trained": size["encoder"] - sum(p.numel() for p in vision.encoder.carried())}


# ---------------------------------------------------------------- the command

SETTINGS = """
layers           4    2  language-model layers
hidden         512  128  language-model width (64 per head)
vocab         8192  512  vocabulary size
seq            256   48  tokens per row
rows             4    2  rows per micro-batch, one image each
micro-batches    4    2  micro-batches of the step whose memory is measured
image          224   32  image side in pixels
patch           16    8  patch side in pixels
vision-layers    4    3  encoder layers
vision-hidden  256   64  encoder width (64 per head)
rounds           5    1  alternating rounds of each side
warmup           1    1  untimed steps per round
steps            3    1  timed steps per round
images          64    4  picture files (pixels)
clip-size      336  336  CLIP's image side (pixels)
siglip-size    384  384  SigLIP's image side (pixels)
workers          2    2  DataLoader workers (pixels)
"""
"""Each setting: its flag, the full run's value, --smoke's (a model and a folder of pictures of seconds), its help."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help=f"what to measure: some of {', '.join(PARTS)} (all)")
    smoke = {}
    for line in SETTINGS.strip().splitlines():
        flag, full, tiny, words = line.split(maxsplit=3)
        parser.add_argument(f"--{flag}", type=int, default=int(full), help=words)
        smoke[flag.replace("-", "_")] = int(tiny)
    parser.add_argument("--output", type=Path, default=RESULTS / "vision.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"no part {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    apply_smoke(args, parser, **smoke)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    measures = {"step": measure_step, "pixels": measure_pixels, "memory": measure_memory}
    results: dict[str, Any] = json.loads(args.output.read_text()) if args.output.exists() else {}
    results["machine"] = {
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    for part in args.parts or PARTS:
        started = time.perf_counter()
        load = os.getloadavg()[0]
        results[part] = {**measures[part](args), "load_average_before": load, "seconds": time.perf_counter() - started}
        report(part, results[part])
    args.output.write_text(json.dumps(results, indent=2) + "\n")


def report(part: str, result: dict[str, Any]) -> None:
    """The part's figures on the terminal."""
    if part == "step":
        print(f"step: first and last losses {[(v[0], v[-1]) for v in result['losses'].values()]}")
        print(f"  ms per step {result['ms_per_step']}, ratio {result['ratio']:.3f}")
        print(f"  CPU ms per step {result['cpu_ms_per_step']}, ratio {result['cpu_ratio']:.3f}")
    elif part == "pixels":
        for kind, key in ((k, w) for k in ("clip", "siglip") for w in result[k] if w.startswith("workers_")):
            rates = result[kind][key]
            print(f"pixels {kind} {key}: images per second {rates['images_per_s']}, ratio {rates['ratio']:.3f}")
    else:
        for name, split in result["splits"].items():
            for source in ("dry_run", "planner", "measured"):
                mib = [f"{sum(stage.values()) / 2**20:.1f}" for stage in split[source]]
                print(f"memory {name} split {split['layers_per_stage']} {source}: MiB per stage {', '.join(mib)}")


if __name__ == "__main__":
    sys.exit(main())
