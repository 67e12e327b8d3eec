"""`Policy.fused`: q/k/v as one projection and gate/up as another compute what the separate
projections compute, in fewer matmuls per decode step; `with_policy(fused=False)` splits them back
exactly; whatever needs the separate projections (training adapters, quantization, export)
refuses a fused model."""

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from layers.kernels.cpu import DENSE_TARGET
from tests.zoo.random_model import random_model

# GQA with q/k/v biases (Qwen2), and Gemma's q/k norms, GeGLU and a head_dim of its own;
# GPT-2's MLP has no gate (only its attention fuses).
CONFIGS = {
    "qwen2-like": zoo.preset("tiny-llama", n_layers=2, qkv_bias=True),
    "gemma-like": zoo.preset(
        "tiny-llama", n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, qk_norm=True, mlp="geglu"
    ),
    "gpt2": zoo.preset("tiny-gpt2", n_layers=2),
}
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def _matmuls(jaxpr: jax.extend.core.Jaxpr) -> int:
    """XLA's products and the calls of the CPU kernel (`layers.kernels.cpu.dense`) that a few
    float32 rows take, in `jaxpr` and the programs it calls (an unrolled layer is a program of
    its own, called once per layer: counted per call)."""
    return sum(
        (eqn.primitive.name == "dot_general")
        + (eqn.primitive.name == "ffi_call" and eqn.params.get("target_name") == DENSE_TARGET)
        + sum(map(_matmuls, jax.extend.core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def _dots(model, batch: int = 2) -> int:
    """Matmuls in one decode step's program (one token per row over a cache)."""
    step = lambda m, t, cache: m.forward(t, cache=cache).logits  # noqa: E731
    tokens = jnp.zeros((batch, 1), jnp.int32)
    jaxpr, *_ = eqx.filter_make_jaxpr(step)(model, tokens, model.init_cache(batch, 16))
    return _matmuls(jaxpr.jaxpr)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_projections_compute_the_same_logits_in_fewer_matmuls(name):
    config = CONFIGS[name]
    model = random_model(config, 3)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
    for storage in (model, model.with_policy(storage="unrolled")):
        fused = storage.with_policy(fused=True)
        assert fused.is_fused and not storage.is_fused
        # The same products over the same embed-wide sums, in one matmul instead of several: any
        # difference is float32 reordering of sums of 64 terms (a few ulps of logits below 10).
        np.testing.assert_allclose(forward(fused, tokens), forward(storage, tokens), atol=2e-5)
    gated = config.mlp != "gelu"
    # Per layer: q, k, v -> 1 matmul (2 fewer), gate, up -> 1 (1 fewer).
    unrolled = model.with_policy(storage="unrolled")
    fused = unrolled.with_policy(fused=True)
    assert _dots(unrolled) - _dots(fused) == config.n_layers * (2 + gated)
    # Split back: exactly the weights it was fused from.
    back = fused.with_policy(fused=False)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)


def test_what_needs_separate_projections_refuses_a_fused_model(tmp_path):
    model = random_model(CONFIGS["qwen2-like"], 4).with_policy(fused=True)
    for call, what in [
        (lambda: zoo.add_lora(model, ["q_proj"], 2, 4, key=jax.random.key(0)), "add_lora"),
        (lambda: zoo.quantize_base(model, "int8"), "quantize_base"),
        (lambda: zoo.save_pretrained(model, tmp_path / "out"), "save_pretrained"),
    ]:
        with pytest.raises(ValueError, match=f"{what} needs the model's separate q/k/v"):
            call()
    assert not (tmp_path / "out").exists()
    adapted = zoo.add_lora(
        random_model(CONFIGS["qwen2-like"], 4), ["q_proj"], 2, 4, key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match="merge LoRA adapters"):
        adapted.with_policy(fused=True)
