"""The registry of HF architectures the zoo reads and writes, keyed by the class name that
config.json lists under `architectures`. Adding one is one module with the five functions
below, the `READS`/`ONLY` field lists (zoo/pretrained/hf_fields.py), the `HOLDS` Config fields
its layout expresses (zoo/pretrained/field_map.py), `read_tensors` where checkpoints come in
more than one layout, and one entry here."""

import dataclasses
from collections.abc import Callable

from zoo.config import Config
from zoo.pretrained import (
    deepseek,
    deepseek_v2,
    gemma,
    gpt2,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from zoo.pretrained.field_map import held_exactly, off_default
from zoo.pretrained.tensor_map import TensorGroup


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF architecture: its config.json <-> Config, and where each weight lives.

    `prefix` starts the names of the base model's tensors ("transformer." for GPT-2, "model." for
    Llama); files saved from the base model alone lack it. `ignored(config)` lists regular
    expressions of checkpoint tensors that hold no weights of ours (buffers, a repeated tied head);
    any other unknown tensor is an error. `holds` are the Config fields (beyond the sizes) its
    layout expresses; `exports(config)` the values it takes, checked only for a config with no
    other field away from its default (`holds_config`). `tensors(config)` is the layout
    `save_pretrained` writes; `read_tensors(config, names)`, where given, picks the layout of a
    checkpoint holding the tensors `names` (Mixtral's experts stored apart or fused). `reads`
    are the config.json fields `config_from_hf` maps, `only` those it implements at one value
    alone (`hf_fields.check_fields` refuses anything else).
    """

    name: str
    prefix: str
    config_from_hf: Callable[[dict], Config]
    config_to_hf: Callable[[Config], dict]
    exports: Callable[[Config], bool]
    tensors: Callable[[Config], list[TensorGroup]]
    ignored: Callable[[Config], tuple[str, ...]]
    reads: frozenset[str] = frozenset()
    only: dict = dataclasses.field(default_factory=dict)
    holds: frozenset[str] = frozenset()
    read_tensors: Callable[[Config, set[str]], list[TensorGroup]] | None = None

    def holds_config(self, config: Config) -> bool:
        """Whether this layout holds `config` exactly: no Config field it has no place for is
        away from its default, and `exports` takes the values of those it has."""
        return held_exactly(config, self.holds) and self.exports(config)

    def tensors_in(self, config: Config, names: set[str]) -> list[TensorGroup]:
        """The groups to read from a checkpoint whose tensors are called `names`."""
        if self.read_tensors is None:
            return self.tensors(config)
        return self.read_tensors(config, names)


def _from_module(name: str, prefix: str, module) -> Architecture:
    return Architecture(
        name=name,
        prefix=prefix,
        config_from_hf=module.config_from_hf,
        config_to_hf=module.config_to_hf,
        exports=module.exports,
        tensors=module.tensors,
        ignored=module.ignored,
        reads=frozenset(module.READS),
        only=dict(getattr(module, "ONLY", {})),
        holds=frozenset(module.HOLDS),
        read_tensors=getattr(module, "read_tensors", None),
    )


ARCHITECTURES: dict[str, Architecture] = {
    "GPT2LMHeadModel": _from_module("GPT2LMHeadModel", "transformer.", gpt2),
    "LlamaForCausalLM": _from_module("LlamaForCausalLM", "model.", llama),
    "MixtralForCausalLM": _from_module("MixtralForCausalLM", "model.", mixtral),
    "Qwen2ForCausalLM": _from_module("Qwen2ForCausalLM", "model.", qwen2),
    "Qwen3ForCausalLM": _from_module("Qwen3ForCausalLM", "model.", qwen3),
    "Qwen3MoeForCausalLM": _from_module("Qwen3MoeForCausalLM", "model.", qwen3_moe),
    "MistralForCausalLM": _from_module("MistralForCausalLM", "model.", mistral),
    "Phi3ForCausalLM": _from_module("Phi3ForCausalLM", "model.", phi3),
    "DeepseekV3ForCausalLM": _from_module("DeepseekV3ForCausalLM", "model.", deepseek),
    "DeepseekV2ForCausalLM": _from_module("DeepseekV2ForCausalLM", "model.", deepseek_v2),
    "Gemma2ForCausalLM": _from_module("Gemma2ForCausalLM", "model.", gemma.GEMMA2),
    "Gemma3ForCausalLM": _from_module("Gemma3ForCausalLM", "model.", gemma.GEMMA3),
}


def architecture(name: str) -> Architecture:
    """The architecture called `name` (an HF class name); unknown names list the known ones."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {name!r} is not supported by the zoo; known: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def architecture_for(config: Config, name: str | None = None) -> Architecture:
    """The architecture whose HF layout holds `config` exactly (for save_pretrained): the one
    called `name`, or else the first in `ARCHITECTURES` that does (a Phi-3 is written as a Llama
    or Mistral, which compute the same, unless asked for by name)."""
    if name is not None:
        arch = architecture(name)
        if not arch.holds_config(config):
            unheld = off_default(config, arch.holds)
            why = f" (it has no place for {unheld})" if unheld else ""
            raise ValueError(
                f"{name}'s HF layout cannot hold this Config{why}; architectures that can: "
                f"{[a.name for a in ARCHITECTURES.values() if a.holds_config(config)]}"
            )
        return arch
    for arch in ARCHITECTURES.values():
        if arch.holds_config(config):
            return arch
    held_nowhere = [
        f for f in off_default(config, frozenset())
        if all(f not in a.holds for a in ARCHITECTURES.values())
    ]  # fmt: skip
    why = f" (no layout holds the Config fields {held_nowhere})" if held_nowhere else ""
    raise ValueError(
        f"no HF architecture holds this Config{why}: e.g. a LayerNorm with rotary positions, "
        "shared experts or interleaved dense/MoE layers, or a mix of GPT-2 and Llama features; "
        f"known: {', '.join(ARCHITECTURES)}"
    )
