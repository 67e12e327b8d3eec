"""Mistral (`MistralForCausalLM`, Jiang et al. 2023, "Mistral 7B") in HF layout: a Llama with
an optional sliding window on every layer (a key is visible iff q_pos - k_pos < sliding_window,
HF's rule and Config.sliding_window's) and an explicit head_dim; no biases."""

from zoo.config import Config
from zoo.pretrained import llama
from zoo.pretrained.tensor_map import TensorGroup

READS = (*(f for f in llama.READS if f not in ("attention_bias", "mlp_bias")), "sliding_window")
ONLY = llama.ONLY
HOLDS = llama.HOLDS - {"bias"} | {"sliding_window"}


def config_from_hf(hf: dict) -> Config:
    window = hf.get("sliding_window")
    return llama.config_from_hf(hf, "MistralForCausalLM").replace(sliding_window=window)


def config_to_hf(config: Config) -> dict:
    hf = llama.config_to_hf(config)
    for field in ("attention_bias", "mlp_bias"):
        del hf[field]
    return hf | {"model_type": "mistral", "sliding_window": config.sliding_window}


def exports(config: Config) -> bool:
    """Whether Mistral's layout takes the values of the fields it holds: Llama's, window or not
    (a config without one is written as a Llama unless Mistral is asked for by name)."""
    return llama.exports(config)


def tensors(c: Config) -> list[TensorGroup]:
    return llama.tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
