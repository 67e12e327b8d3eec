"""Inference: the KV cache, jitted prefill and decode steps, the on-device generate loop and
samplers."""

from infer.cache import KVCache, init_cache
from infer.generation import generate
from infer.sampling import Greedy, MinP, Sampler, Temperature, TopK, TopP
from infer.step import decode_step, prefill

__all__ = [
    "Greedy",
    "KVCache",
    "MinP",
    "Sampler",
    "Temperature",
    "TopK",
    "TopP",
    "decode_step",
    "generate",
    "init_cache",
    "prefill",
]
