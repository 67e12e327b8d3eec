"""Inference: jitted prefill and decode steps over the model's own forward with a KV cache, the
on-device generate loop and samplers."""

from infer.generation import generate
from infer.sampling import Greedy, MinP, Sampler, Temperature, TopK, TopP
from infer.step import decode_step, prefill

__all__ = [
    "Greedy",
    "MinP",
    "Sampler",
    "Temperature",
    "TopK",
    "TopP",
    "decode_step",
    "generate",
    "prefill",
]
