"""`paratron plan`: choose the parallel layout of a model for a cluster before running anything.

    paratron plan --model llama3-70b --global-batch-size 1536 --seq-length 2048 \\
        --hardware h100-80g --nodes 512 --output plans.json

takes train's flags that a plan depends on (the model, the batch, precision; the data and
tokenizer flags, passed on to the printed command) and the machine (a --hardware preset, --nodes x
--gpus-per-node devices, and any of the preset's numbers overridden), prints the best plans as a
table with the `paratron train` command of the best (it runs as printed: without data flags it
trains on --mock-data, and says so; across nodes it is torchrun's line for each node, with the
rendezvous to fill in, and the srun line that starts every node under Slurm), and with --output
writes plans.json and a PNG of the best plans' time and memory (--plot PATH to put it elsewhere).
GPU presets plan bf16 unless --precision is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratron.config.arguments import (
    ArgumentParser,
    Takes,
    add_config_arguments,
    given_settings,
    parse_config_arguments,
)
from paratron.config.fields import flag
from paratron.config.loading import override, resolve_settings
from paratron.config.schema import LAUNCH_FIELDS, MODEL_ARCHITECTURE, Config
from paratron.errors import ConfigError
from paratron.planning.calibration import calibrate, read_calibration
from paratron.planning.hardware import CPU, Hardware, hardware_from
from paratron.planning.launch_line import fill_in
from paratron.planning.report import plot, table, write_json
from paratron.planning.search import LAYOUT_FIELDS, WITHIN, Plan, search

PLAN_TAKES = (
    MODEL_ARCHITECTURE,  # (the weights' shapes and the work: the plan builds the model on the meta device)
    ("model_name", "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by"),  # (memory)
    ("lora_rank", "lora_alpha", "lora_targets"),
    ("vision_model", "freeze_vision_model", "freeze_language_model", "plan_images_per_sample"),
    ("global_batch_size", "precision", "optimizer", "sgd_momentum", "expert_tensor_parallel_size", "cp_comm_type"),
    ("data_path", "train_data_path", "valid_data_path", "corpus", "mock_data", "seq_length"),
    ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"),
    ("sft", "chat_template"),
    ("cross_entropy_loss_fusion",),  # (the last stage's logits memory and the loss's time)
    ("world_size", "hardware", "device_memory_gb", "peak_tflops", "calibration"),
)
"""The settings a plan depends on (train's flags): the model's architecture and what sizes its memory (dropout
masks, vocabulary padding, adapters, a vision encoder, what trains and the images a sample brings, the fused loss),
the batch, precision and the optimizer's state, the data (passed on to the printed command) and the machine; the
layout is what the plans choose."""


def parser() -> argparse.ArgumentParser:
    """train's flags that a plan depends on, and the cluster's and the report's."""
    parser = ArgumentParser(
        prog="paratron plan",
        usage="paratron plan --model NAME --global-batch-size B --seq-length S [--hardware PRESET] [--nodes N] "
        "[--output plans.json] [flags]",
        description="Rank the parallel layouts of a model on a cluster (tensor, context, expert, data and pipeline "
        "parallelism, virtual stages, micro-batch size, recomputation, ZeRO stage, schedule) by predicted "
        "throughput, among those that fit each device's memory as `paratron train --dry-run` predicts it. Takes "
        "train's flags for the model's shape, the batch and the data (passed on to the printed command).",
        allow_abbrev=False,
    )
    layout = "paratron plan chooses the layout itself (each plan sets it); drop it"
    processes = "paratron plan counts the devices from --nodes and --gpus-per-node; drop it"
    takes = Takes(
        "paratron plan",
        fields=sum(PLAN_TAKES, ()),
        why=(*((name, layout) for name in LAYOUT_FIELDS), *((name, processes) for name in LAUNCH_FIELDS)),
        otherwise="the plan does not depend on it; add it to the printed paratron train command instead",
    )
    add_config_arguments(parser, takes)
    group = parser.add_argument_group("the cluster (defaults: the --hardware preset's)")
    group.add_argument("--nodes", type=int, default=None, metavar="N", help="Machines (default: 1, or --world-size's).")
    group.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="Devices per machine.")
    for name, unit, text in (
        ("intra-node-gbps", "GB/S", "Per-device bandwidth inside a node, one direction, GB/s."),
        ("inter-node-gbps", "GB/S", "Per-device bandwidth between nodes (its network card), one direction, GB/s."),
        ("intra-node-latency-us", "US", "Latency of one message step inside a node, microseconds."),
        ("inter-node-latency-us", "US", "Latency of one message step between nodes, microseconds."),
        ("matmul-efficiency", "FRACTION", "Share of the peak the model's work runs at (calibrated per preset)."),
    ):
        group.add_argument(f"--{name}", type=float, default=None, metavar=unit, help=text)
    report = parser.add_argument_group("the report")
    report.add_argument("--top", type=int, default=10, metavar="N", help="Plans to print (default: 10).")
    report.add_argument(
        "--within",
        type=float,
        default=WITHIN,
        metavar="FACTOR",
        help=f"Keep plans predicted up to FACTOR x the fastest's step time (default: {WITHIN}; inf keeps every one).",
    )
    report.add_argument("--output", type=Path, metavar="FILE.json", help="Write every kept plan here.")
    report.add_argument("--plot", type=Path, metavar="PATH", help="PNG of the best plans (default: beside --output).")
    return parser


def run(argv: Sequence[str]) -> int:
    """`paratron plan ARGV`; user mistakes raise ConfigError (one line, exit 2)."""
    recipe, overrides, args = parse_config_arguments(parser(), list(argv))
    _check_report_flags(args)
    config, no_data = _plan_settings(overrides, recipe, args)
    hardware, measured = _hardware(config, args)
    world = _world(config.planning.world_size, args.nodes, hardware.gpus_per_node)
    hardware = dataclasses.replace(hardware, nodes=max(1, world // hardware.gpus_per_node))
    start = time.perf_counter()
    plans, others = search(config, world, hardware, within=args.within)
    seconds = time.perf_counter() - start
    name = config.model.model_name or f"{config.model.num_layers}-layer model"
    print(
        f"{name} on {world} x {hardware.name} ({hardware.device_memory_gb:g} GB, {hardware.peak_tflops:g} TFLOP/s "
        f"x {hardware.matmul_efficiency:g}), {flag.global_batch_size} {config.training.global_batch_size} x "
        f"{flag.seq_length} {config.data.seq_length}: {len(plans)} plans within {args.within:g}x of the fastest, "
        f"{len(others)} other layouts considered ({seconds:.1f}s)"
    )
    if measured:
        print("\n".join(measured))
    _print_best(plans, args.top, world, no_data)
    if args.output is not None:
        request = {"argv": list(argv), "world_size": world, "within": args.within, "search_seconds": seconds}
        if measured:
            request["calibration"] = measured
        write_json(args.output, plans, hardware, request, others)
        print(f"plans: {args.output}")
    picture = args.plot or (args.output.with_suffix(".png") if args.output is not None else None)
    if picture is not None:
        print(f"plot: {plot(plans, picture)}")
    return 0


def _check_report_flags(args: argparse.Namespace) -> None:
    """The cluster's sizes and the report's counts: one line for a value that cannot be."""
    for name in ("nodes", "gpus_per_node", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.within < 1:
        raise ConfigError(f"--within {args.within:g}: must be at least 1 (a factor of the fastest step time)")


def _plan_settings(overrides: dict[str, Any], recipe: str | None, args: argparse.Namespace) -> tuple[Config, bool]:
    """The settings as train builds them, in bf16 on a GPU preset unless --precision says, and whether no data was
    given (the printed command must run: it then trains on synthetic tokens, and says so)."""
    config = resolve_settings(overrides, recipe, given=given_settings(overrides, args)).config
    if "precision" not in overrides and (config.planning.hardware or "h100-80g") != CPU:
        config = override(config, precision="bf16")
    no_data = not (config.data.blend_flags() or config.data.corpus or config.data.mock_data or config.data.sft)
    if no_data:
        config = override(config, mock_data=True)
    return config, no_data


def _hardware(config: Config, args: argparse.Namespace) -> tuple[Hardware, list[str]]:
    """The machine: the --hardware preset with the numbers the flags give, then a --calibration report's measured
    figures in place of the preset's (not of those given); the lines that say which were measured."""
    given = dict(
        gpus_per_node=args.gpus_per_node,
        peak_tflops=config.logging.peak_tflops,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        intra_node_latency_us=args.intra_node_latency_us,
        inter_node_latency_us=args.inter_node_latency_us,
        matmul_efficiency=args.matmul_efficiency,
    )
    hardware = hardware_from(config.planning, **given)
    measured: list[str] = []
    if config.planning.calibration is not None:
        keep = {name for name, value in given.items() if value is not None}
        keep |= {"device_memory_gb"} if config.planning.device_memory_gb is not None else set()
        calibration = read_calibration(config.planning.calibration)
        hardware, measured = calibrate(hardware, calibration, keep, config.training.precision)
    return hardware, measured


def _print_best(plans: Sequence[Plan], top: int, world: int, no_data: bool) -> None:
    """The table of the best `top` plans and the command lines that run the best."""
    print(table(plans, top))
    print(f"\nbest: {plans[0].command()}")
    across = fill_in(world, plans[0].gpus_per_node)
    if across is not None:  # (each node starts its own launcher, and they must meet)
        print(f"({across})\nslurm: {plans[0].slurm_command()}")
    if no_data:
        print(
            f"(no data was given, so it trains on {flag.mock_data}: replace that with {flag.data_path} PREFIX "
            "and the tokenizer's flags to train on yours)"
        )


def _world(world_size: int | None, nodes: int | None, gpus_per_node: int) -> int:
    """Devices to plan for: --nodes x --gpus-per-node, or --world-size (which must agree)."""
    if world_size is None:
        return (nodes or 1) * gpus_per_node
    if nodes is not None and nodes * gpus_per_node != world_size:
        raise ConfigError(
            f"{flag.world_size} {world_size} disagrees with --nodes {nodes} x --gpus-per-node {gpus_per_node}; "
            "give one of them"
        )
    return world_size
