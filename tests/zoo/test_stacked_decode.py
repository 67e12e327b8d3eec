"""Stacked layers decode in place: in a cached (inference) call of a stacked model, each
projection's kernel reads its layer of the stack where it lies (`Linear.layer`,
`QuantizedLinear.layer`), so the layer loop neither takes the projections' weights as sliced
inputs nor slices them, and the step computes the unrolled model's tokens; the decode storage
(`zoo.policy.decode_storage`) is stacked exactly where that holds (one CPU device, float32)."""

import math

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import infer
import zoo
from layers import Linear, QuantizedLinear
from layers.kernels.cpu import DENSE_TARGET, QUANTIZED_TARGET
from tests.zoo.random_model import random_model
from zoo.policy import decode_storage

CONFIG = zoo.preset("tiny-llama", n_layers=3)
MODELS = {
    "float32": lambda: random_model(CONFIG, 0),
    "int8": lambda: zoo.quantize(random_model(CONFIG, 0), "int8"),
}


def _projection_weights(model) -> set[tuple[int, ...]]:
    """The shapes of the stacked projections' weights (every array of a packed one)."""
    projection = lambda n: isinstance(n, Linear | QuantizedLinear)  # noqa: E731
    found = jax.tree.leaves([stack.blocks for stack in model.stacks], is_leaf=projection)
    return {
        a.shape
        for p in found
        if projection(p)
        for a in jax.tree.leaves(p.weight if isinstance(p, Linear) else p.packed)
    }


def _walk(jaxpr: jax.extend.core.Jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _walk(inner)


def _decode_step_jaxpr(model):
    step = lambda m, t, cache: m.forward(t, cache=cache).logits  # noqa: E731
    tokens = jnp.zeros((2, 1), jnp.int32)
    jaxpr, *_ = eqx.filter_make_jaxpr(step)(model, tokens, model.init_cache(2, 16))
    return jaxpr.jaxpr


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_cached_step_hands_its_kernels_the_whole_stacks(kind):
    model = MODELS[kind]()
    assert all(stack.stacked for stack in model.stacks)
    weights = _projection_weights(model)
    shapes = lambda eqn: [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]  # noqa: E731
    scans = [eqn for eqn in _walk(_decode_step_jaxpr(model)) if eqn.primitive.name == "scan"]
    assert len(scans) == 1  # one loop over the layers
    body = scans[0].params["jaxpr"].jaxpr
    # The loop's body gets each stack whole (as sliced inputs, it would see one layer's shapes).
    assert weights <= {tuple(v.aval.shape) for v in body.invars}
    kernel_calls = 0
    for eqn in _walk(body):
        if eqn.primitive.name in ("dynamic_slice", "slice", "gather"):
            assert shapes(eqn)[0] not in weights, f"{eqn.primitive.name} of a projection weight"
        if eqn.params.get("target_name") in (DENSE_TARGET, QUANTIZED_TARGET):
            kernel_calls += 1
            # A stack as it lies, [layers, k, n] (reshaped: the same buffer), not a slice.
            stacks = {(w[0], math.prod(w)) for w in weights}
            given = {(a[0], math.prod(a)) for a in shapes(eqn)[1:] if a}
            assert stacks & given, "a kernel got a slice, not the stack"
    assert kernel_calls == 7  # q, k, v, o, gate, up and down: one kernel call each


@pytest.mark.parametrize("kind", list(MODELS))
def test_stacked_decode_gives_the_unrolled_models_tokens(kind):
    stacked = MODELS[kind]()
    unrolled = stacked.with_policy(storage="unrolled")
    prompts = [[5, 17, 3, 9], [2, 40, 41, 7, 7, 12, 30]]
    greedy = dict(max_new_tokens=6, sampler=infer.Greedy(), key=jax.random.key(0))
    assert infer.generate(stacked, prompts, **greedy) == infer.generate(unrolled, prompts, **greedy)


def test_the_decode_storage_is_stacked_where_the_kernels_read_in_place():
    assert jax.default_backend() == "cpu"
    assert decode_storage("float32") == "stacked"
    assert zoo.Policy.inference().storage == "stacked"
    # bfloat16 takes XLA's products, which would copy each layer's slice; so would a mesh's.
    assert decode_storage("bfloat16") == "unrolled"
    assert decode_storage("float32", sharded=True) == "unrolled"
    assert zoo.Policy.inference("float32", sharded=True).storage == "unrolled"
    # MoE experts are sliced per layer (no kernel reads them in place).
    assert decode_storage("float32", experts=True) == "unrolled"
    moe = random_model(zoo.preset("tiny-moe", n_layers=2), 0)
    assert moe.for_decode().policy.storage == "unrolled"
    assert random_model(CONFIG, 0).with_policy(storage="unrolled").for_decode().stacks[0].stacked


def test_restacking_can_consume_the_layers_it_stacks():
    # What load_pretrained does with a GGUF's packed layers (read one at a time): each layer's
    # arrays are freed once stacked, so the weights are never all held twice.
    stacked = MODELS["int8"]()
    unrolled = stacked.with_policy(storage="unrolled")
    layers = [a for a in jax.tree.leaves(unrolled.stacks) if eqx.is_array(a)]
    again = unrolled.stacks[0].restacked(consume=True)
    assert all(a.is_deleted() for a in layers)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stacked.stacks[0]), strict=True):
        assert jnp.array_equal(a, b)
