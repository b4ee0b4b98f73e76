"""What paratron knows of one Hugging Face model family, as data: its names on the Hub, where its
weights go and how they are laid out, and how its config.json maps to paratron's settings both ways.

A new family is one `Family` row in `families.FAMILIES`. A vision-language family (LLaVA's
LlavaForConditionalGeneration) fits the same shape: its `text_families` read and write the nested
`text_config`, its `read_settings` and `write_config` the vision tower's and projector's entries, and
its `weight_names` add the vision tower's and projector's tensors beside the language model's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paratron.config.schema import ModelConfig

Settings = dict[str, Any]
HFConfig = dict[str, Any]


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family: the facts that reading and writing its folders need."""

    model_type: str
    """config.json's `model_type` (and the key of `hf_defaults.DEFAULTS`)."""
    architecture: str
    """config.json's `architectures` entry (transformers' class)."""
    name: str
    """How the documents and `paratron convert --help` name it."""
    weight_names: dict[str, str]
    """paratron name -> Hugging Face name (layer index {i}, projection {p}, weight or bias {w})."""
    read_settings: Callable[[HFConfig, Family, str], Settings]
    """paratron model settings of a config.json (with transformers' defaults filled in), or a one-line refusal."""
    write_config: Callable[[ModelConfig, Family], HFConfig]
    """The family's own entries of a config.json for a paratron model."""
    read_windows: Callable[[HFConfig], tuple[int | None, list[str], bool]] | None = None
    """Which layers slide a window, as transformers reads the family: (window, each layer's attention type,
    whether full attention on the first layer means no window at all)."""
    write_windows: Callable[[int | None, int], HFConfig] | None = None
    """config.json's window entries for (window or None, layers); None: the family has no sliding window."""
    read_experts: Callable[[HFConfig, Family], Settings] | None = None
    """A mixture of experts' settings (None: a dense family)."""
    write_experts: Callable[[ModelConfig, Family], HFConfig] | None = None
    expert_names: tuple[str, str, str] | None = None
    """The Hub names of one expert's (gate, up, down) weights (layer {i}, expert {e}); paratron stacks them."""
    experts_field: str = "num_local_experts"
    """config.json's count of experts."""
    shared_expert: bool = False
    """A shared expert with a sigmoid gate beside the routed ones (Qwen2-MoE)."""
    qkv_bias: bool | str = False
    """Biases on the query, key and value projections: always, never, or as this config.json field says."""
    qk_norm: bool = False
    """A norm on each head's queries and keys."""
    fixed_config: HFConfig = field(default_factory=dict)
    """Entries every config.json of the family carries as written (biases paratron's layers do not have)."""
    fused_qkv: str | None = None
    """The Hub name (layer {i}, weight or bias {w}) of one fused, transposed q/k/v (GPT-2's c_attn); None: apart."""
    transposed: re.Pattern[str] | None = None
    """Hub weights stored [in, out] (GPT-2's Conv1D layers); paratron's are [out, in]."""
    peft: bool = False
    """Its layers map one to one onto PEFT's LoRA target modules (adapters are exported)."""
    text_families: tuple[str, ...] = ()
    """A vision-language family: the model types its `text_config` may have (the first when it names none), whose
    rows read and write the language model's settings; empty for a text family."""
    hub_layouts: tuple[tuple[str, str], ...] = ()
    """Other layouts of the family's weight names in released files, as (regex, replacement) into the names
    `weight_names` writes; the first that matches a name renames it."""
