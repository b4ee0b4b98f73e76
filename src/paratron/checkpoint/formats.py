"""The table of converters: every format paratron converts has a reader (folder -> `Converted`: the
configuration and tensors under paratron's single-device names) and a writer (`Converted` -> folder),
and `paratron convert --from X SRC --to Y DST` is "read with X, write with Y".

    format     reads                                   writes
    paratron   any checkpoint                          a weights (+ optimizer) checkpoint, model.yaml
    hf         config.json + safetensors (`hf`)        config.json + safetensors + tokenizer.json
               (+ a vision encoder folder, combined)
    megatron   torch and torch_dist, any TP/PP         torch (legacy) at a chosen TP/PP
    peft       -                                       a LoRA checkpoint's adapters

A new format is one `Format` row and one module with its reader and writer; a new Hugging Face family
is one row of `hf.families.FAMILIES`. `load_pretrained` and `train --load` of a foreign checkpoint read
through the same readers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paratron.checkpoint.converted import Converted, ConvertOptions, refuse_existing
from paratron.checkpoint.hf import read_hf_folder, write_hf
from paratron.checkpoint.megatron import read_megatron, write_megatron
from paratron.checkpoint.native import read_paratron, write_paratron
from paratron.checkpoint.peft import write_peft
from paratron.checkpoint.save import CONVERT_FIX


def _trainable(written: Path, destination: Path, model: Converted) -> str:
    how = "--finetune" if model.weights_only else "(its step; --finetune starts at step 0)"
    return f"wrote {written}; train from it with: paratron train --load {destination} {how} ..."


def _plain(written: Path, destination: Path, model: Converted) -> str:
    return f"wrote {written}"


def _adapters(written: Path, destination: Path, model: Converted) -> str:
    return f"wrote {written}; load it with peft.PeftModel.from_pretrained(base, DIR)"


@dataclass(frozen=True)
class Format:
    """One format's reader and writer (None where it has none), and the formats its writer takes."""

    read: Callable[[Path, ConvertOptions], Converted] | None
    write: Callable[[Converted, Path, ConvertOptions], Path] | None
    written_from: tuple[str, ...]
    """The formats whose readers this writer is fed by `paratron convert`."""
    report: Callable[[Path, Path, Converted], str]
    """The line `paratron convert` prints once it has written (folder written, destination, model)."""
    training_state: bool = False
    """The writer keeps a source's iteration and optimizer state (else its reader reads the weights alone)."""


FORMATS: dict[str, Format] = {
    "paratron": Format(read_paratron, write_paratron, ("hf", "megatron"), _trainable, training_state=True),
    "hf": Format(read_hf_folder, write_hf, ("paratron", "megatron"), _plain),
    "megatron": Format(read_megatron, write_megatron, ("paratron",), _plain),
    "peft": Format(None, write_peft, ("paratron",), _adapters),
}

UNSUPPORTED = (
    "convert hf to paratron, or paratron to hf or peft; or megatron to paratron or hf, or paratron to megatron"
)
"""What `paratron convert` says of a pair of formats the table does not join."""


def converts(source_format: str, target_format: str) -> bool:
    """Whether the table converts `source_format` into `target_format`."""
    target = FORMATS.get(target_format)
    return target is not None and source_format in target.written_from


def convert(
    source_format: str,
    source: Path,
    target_format: str,
    destination: Path,
    options: ConvertOptions | None = None,
) -> tuple[Path, str]:
    """Read `source` with its format's reader and write `destination` with the target's writer (a folder
    that already holds files is refused first); the folder written, and the line that says so."""
    if not converts(source_format, target_format):
        raise ValueError(f"--from {source_format} --to {target_format}: {UNSUPPORTED}")
    options = options or ConvertOptions()
    reader, writer = FORMATS[source_format], FORMATS[target_format]
    if not writer.training_state:
        options = dataclasses.replace(options, weights_only=True)
    assert reader.read is not None and writer.write is not None
    refuse_existing(destination)
    model = reader.read(source, options)
    written = writer.write(model, destination, options)
    return written, writer.report(written, destination, model)


# ---------------------------------------------------------------- each conversion by name


def hf_to_paratron(source: Path, destination: Path) -> Path:
    """Write a weights-only paratron checkpoint (iteration 0) of a Hugging Face model directory."""
    return convert("hf", source, "paratron", destination)[0]


def paratron_to_hf(source: Path, destination: Path, merge_lora: bool = False) -> Path:
    """Write a Hugging Face directory of a paratron checkpoint's weights (LoRA adapters merged when
    `merge_lora` is set; without it such a checkpoint is refused)."""
    return convert("paratron", source, "hf", destination, ConvertOptions(merge_lora=merge_lora))[0]


def paratron_to_peft(source: Path, destination: Path) -> Path:
    """Write the LoRA adapters of paratron checkpoint `source` as a PEFT adapter folder."""
    return convert("paratron", source, "peft", destination)[0]


def megatron_to_paratron(source: Path, destination: Path, finetune: bool = False, fix: str = CONVERT_FIX) -> Path:
    """Write a paratron checkpoint of a Megatron-LM one: its weights, and (unless `finetune`) its
    iteration, consumed samples and optimizer state. Returns the folder. `fix` ends the line of a
    full disk (what to do about it where the caller chose `destination`)."""
    return convert("megatron", source, "paratron", destination, ConvertOptions(weights_only=finetune, fix=fix))[0]


def paratron_to_megatron(source: Path, destination: Path, tp: int = 1, pp: int = 1) -> Path:
    """Write a Megatron-LM legacy checkpoint of a paratron checkpoint's weights at tensor-parallel
    size `tp` and pipeline-parallel size `pp`. Returns the iteration folder."""
    options = ConvertOptions(tensor_parallel=tp, pipeline_parallel=pp)
    return convert("paratron", source, "megatron", destination, options)[0]
