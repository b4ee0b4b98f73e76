"""`paratron convert`: weights between Hugging Face, Megatron-LM and paratron checkpoints, LoRA adapters as peft's,
a vision encoder put before a language model. The flags are checked together before anything is read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratron.checkpoint.converted import ConvertOptions
from paratron.checkpoint.formats import UNSUPPORTED, convert, converts
from paratron.checkpoint.hf import FAMILY_NAMES
from paratron.config.arguments import ArgumentParser
from paratron.errors import UserError


def parser() -> argparse.ArgumentParser:
    """The formats and folders (--from, --to), what the conversion keeps or lays out, the vision encoder's."""
    parser = ArgumentParser(
        prog="paratron convert",
        allow_abbrev=False,
        usage="paratron convert --from hf SRC --to paratron DST  |  --from paratron SRC --to hf DST [--merge-lora]"
        "  |  --from paratron SRC --to peft DST  |  --from megatron SRC --to paratron|hf DST [--finetune]"
        "  |  --from paratron SRC --to megatron DST [--target-tensor-parallel-size N]"
        " [--target-pipeline-parallel-size M]"
        "  |  --from hf LM --vision-model-path VIT --to paratron DST [--vision-feature-layer N ...]",
        description=f"Convert {', '.join(list(FAMILY_NAMES.values())[:-1])} and {list(FAMILY_NAMES.values())[-1]} "
        "weights between a Hugging Face directory (config.json + safetensors: model.safetensors or the shards its "
        "model.safetensors.index.json names; a field config.json leaves out takes transformers' default for "
        "the model type) and a paratron checkpoint (weights only, for --load); write a LoRA "
        "checkpoint's adapters as a peft adapter (Llama family), or merged into the base weights; read "
        "Megatron-LM GPT checkpoints (torch and torch_dist formats, any TP/PP) and write its torch format "
        "(docs/megatron-checkpoints.md); put a CLIP or SigLIP vision encoder before a language model "
        "(docs/multimodal.md).",
    )
    parser.add_argument(
        "--from",
        dest="source",
        nargs=2,
        metavar=("FORMAT", "SRC"),
        required=True,
        help="hf, megatron or paratron, and the directory to read.",
    )
    parser.add_argument(
        "--to",
        dest="target",
        nargs=2,
        metavar=("FORMAT", "DST"),
        required=True,
        help="paratron, hf, peft or megatron, and a new directory to write.",
    )
    _add_conversion_arguments(parser)
    _add_vision_arguments(parser)
    return parser


def _add_conversion_arguments(parser: argparse.ArgumentParser) -> None:
    """What a conversion keeps (--merge-lora, --finetune) and the layout Megatron-LM's checkpoint is written at."""
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="With --to hf: fold a LoRA checkpoint's adapters into the base weights, W + (alpha/rank) B A.",
    )
    parser.add_argument(
        "--finetune",
        action="store_true",
        help="With --from megatron: weights only (iteration 0, no optimizer state), for fine-tuning.",
    )
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="With --to megatron: the tensor-parallel size of the written checkpoint (default 1).",
    )
    parser.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="With --to megatron: the pipeline-parallel size of the written checkpoint (default 1).",
    )


def _add_vision_arguments(parser: argparse.ArgumentParser) -> None:
    """The vision encoder put before the language model (with --from hf SRC --to paratron DST)."""
    vision = parser.add_argument_group("vision encoder (with --from hf SRC --to paratron DST)")
    vision.add_argument(
        "--vision-model-path",
        type=Path,
        metavar="DIR",
        help="A Hugging Face CLIP or SigLIP vision encoder (CLIPVisionModel, SiglipVisionModel, or a CLIPModel or "
        "SiglipModel, whose vision half is taken) to put before the language model SRC, with a new projector.",
    )
    vision.add_argument(
        "--vision-feature-layer", type=int, metavar="N", help="Its layer that feeds the projector (default -2)."
    )
    vision.add_argument(
        "--vision-feature-select",
        choices=("default", "full"),
        help="default: drop CLIP's class token, full: keep every feature (default: default for CLIP, full for SigLIP).",
    )
    vision.add_argument("--vision-projection", choices=("mlp", "affine"), help="The new projector (default mlp).")


def run(argv: list[str]) -> int:
    """`paratron convert ARGV`: the flags checked, then the conversion's one-line summary printed."""
    args = parser().parse_args(argv)
    _check(args)
    formats = (args.source[0], args.target[0])
    source, target = Path(args.source[1]), Path(args.target[1])
    layout = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    options = ConvertOptions(
        args.merge_lora,
        args.finetune,
        *layout,
        vision_model_path=args.vision_model_path,
        vision_feature_layer=args.vision_feature_layer,
        vision_feature_select=args.vision_feature_select,
        vision_projection=args.vision_projection,
    )
    print(convert(formats[0], source, formats[1], target, options)[1])
    return 0


def _check(args: argparse.Namespace) -> None:
    """Each flag applies to some formats only; the source must exist and the pair of formats convert."""
    formats, source = (args.source[0], args.target[0]), Path(args.source[1])
    vision_flags = (args.vision_feature_layer, args.vision_feature_select, args.vision_projection)
    if args.vision_model_path is None and any(flag is not None for flag in vision_flags):
        raise UserError(
            "--vision-feature-layer/--vision-feature-select/--vision-projection apply with --vision-model-path only"
        )
    if args.vision_model_path is not None and formats != ("hf", "paratron"):
        raise UserError("--vision-model-path applies to --from hf SRC --to paratron DST only")
    if args.vision_model_path is not None and not args.vision_model_path.is_dir():
        raise UserError(f"--vision-model-path {args.vision_model_path}: no such directory")
    if args.merge_lora and formats != ("paratron", "hf"):
        raise UserError("--merge-lora applies to --from paratron SRC --to hf DST only")
    if args.finetune and formats[0] != "megatron":
        raise UserError("--finetune applies to --from megatron SRC only")
    layout = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if layout != (1, 1) and formats[1] != "megatron":
        raise UserError("--target-tensor-parallel-size/--target-pipeline-parallel-size apply to --to megatron only")
    if not source.exists():
        raise UserError(f"--from {args.source[0]} {source}: no such directory")
    if not converts(*formats):
        raise UserError(f"--from {formats[0]} --to {formats[1]}: {UNSUPPORTED}")
