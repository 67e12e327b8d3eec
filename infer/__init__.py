"""Inference: the serving engine (continuous batching over a paged KV cache, chunked prefill),
`generate` on it, jitted prefill and decode steps over the paged cache, and samplers."""

from infer.engine import Engine, Request
from infer.generation import generate
from infer.sampling import (
    Greedy,
    MinP,
    Sampler,
    SamplingParams,
    Temperature,
    TopK,
    TopP,
    sample,
    stack_samplers,
)
from infer.step import decode_step, prefill

__all__ = [
    "Engine",
    "Greedy",
    "MinP",
    "Request",
    "Sampler",
    "SamplingParams",
    "Temperature",
    "TopK",
    "TopP",
    "decode_step",
    "generate",
    "prefill",
    "sample",
    "stack_samplers",
]
