"""Kernels declare what they support, and the declaration is the truth: a feature a kernel says
it lacks is refused by the kernel itself, one it claims runs and equals naive; a model refuses an
unfit kernel when it is built or its policy changes; the default kernel serves every model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from layers.kernels import KERNELS, Flash, Naive, Xla, causal_mask, naive_attention
from layers.kernels.kernel import DEFAULT_PREFERENCE
from layers.kernels.support import Needs, default_kernel, refusal

HEAD_DIM = 16
CAP = 2.0
LLAMA = zoo.preset("tiny-llama")
GEMMA2 = zoo.preset(
    "gemma2-2b", n_layers=2, layer_types=("sliding", "full"), sliding_window=4, d_model=64,
    n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, d_ff=128, vocab_size=256, max_seq_len=64,
)  # fmt: skip


def inputs(t=16, head_dim=HEAD_DIM):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    shape = (1, t, 2, head_dim)
    q, k, v = (jax.random.normal(key, shape) for key in (kq, kk, kv))
    return q, k, v, causal_mask(jnp.arange(t)[None])


# Each declared feature, as the call that exercises it.
FEATURES = {
    "softcap": lambda kernel, q, k, v, mask: kernel(q, k, v, mask, softcap=CAP),
    "per_layer_window": lambda kernel, q, k, v, mask: jax.lax.scan(
        lambda _, w: (None, kernel(q, k, v, mask.with_window(w))), None, jnp.array([3, 5])
    )[1][-1],
}
TRUTH = {
    "softcap": lambda q, k, v, mask: naive_attention(q, k, v, mask, softcap=CAP),
    "per_layer_window": lambda q, k, v, mask: naive_attention(q, k, v, mask.with_window(5)),
}


def runs_here(kernel) -> bool:
    """Whether `kernel` runs on this backend; one that does not refuses every call, saying so
    (cudnn off an NVIDIA GPU), so its other declarations are checked where it runs."""
    if kernel.supports.runs_on(jax.default_backend()):
        return True
    q, k, v, mask = inputs()
    with pytest.raises(ValueError, match=f"runs only on .*{jax.default_backend()!r}"):
        kernel(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask)
    return False


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_declared_features_are_what_the_kernel_does(name, feature):
    kernel = KERNELS[name]
    q, k, v, mask = inputs()
    if not runs_here(kernel):
        return
    if getattr(kernel.supports, feature):
        got = FEATURES[feature](kernel, q, k, v, mask)
        np.testing.assert_allclose(got, TRUTH[feature](q, k, v, mask), rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(ValueError):
            FEATURES[feature](kernel, q, k, v, mask)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_declared_head_dims_are_what_the_kernel_takes(name):
    kernel = KERNELS[name]
    q, k, v, mask = inputs(head_dim=24)
    if not runs_here(kernel):
        return
    if kernel.supports.head_dims is None or 24 in kernel.supports.head_dims:
        np.testing.assert_allclose(
            kernel(q, k, v, mask), naive_attention(q, k, v, mask), rtol=1e-5, atol=1e-5
        )
    else:
        with pytest.raises(ValueError, match="head_dim=24"):
            kernel(q, k, v, mask)


def test_refusal_names_the_kernel_the_feature_and_the_kernels_that_can():
    needs = Needs(softcap=50.0, head_dim=24)
    why = refusal(Xla(), needs, candidates=list(KERNELS.values()))
    assert why == (
        "attention kernel 'xla' cannot compute soft-capping of attention scores (softcap=50.0); "
        "kernels that can: naive"  # flash takes no head_dim 24, ring and allgather no softcap
    )
    assert refusal(Naive(), needs) is None


@pytest.mark.parametrize(
    ("needs", "backend", "expected"),
    [
        (Needs(head_dim=64), "cpu", Xla()),
        (Needs(head_dim=64), "gpu", Xla()),
        (Needs(softcap=50.0, head_dim=256), "cpu", Naive()),  # flash would run interpreted
        (Needs(softcap=50.0, head_dim=256), "gpu", Flash()),
        (Needs(softcap=50.0, head_dim=24), "gpu", Naive()),
    ],
)
def test_the_default_kernel_serves_the_model_and_compiles_here(needs, backend, expected):
    assert default_kernel(needs, DEFAULT_PREFERENCE, backend) == expected


def test_a_model_refuses_an_unfit_kernel_when_built_or_when_its_policy_changes():
    message = r"Policy\.attention: attention kernel 'xla' cannot compute soft-capping"
    with pytest.raises(ValueError, match=message):
        zoo.Transformer(GEMMA2, policy=zoo.Policy(attention="xla"), key=jax.random.key(0))
    model = zoo.Transformer(GEMMA2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        model.with_policy(attention="xla")
    with pytest.raises(ValueError, match="kernel 'ring' cannot compute soft-capping"):
        model.with_policy(attention="ring")
    llama = zoo.Transformer(
        dataclasses.replace(LLAMA, head_dim=24, d_model=96), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"kernel 'flash' cannot compute head_dim=24"):
        llama.with_policy(attention="flash")
    with pytest.raises(ValueError, match=r"'cudnn' cannot compute in float32 \(it computes in bf"):
        llama.with_policy(attention="cudnn")  # the default compute dtype
    assert llama.with_policy(attention="cudnn", compute_dtype="bfloat16").policy.kernel_name == (
        "cudnn"
    )  # built anywhere (a plan for a GPU is made on a CPU); it runs on an NVIDIA GPU


def test_the_default_policy_runs_a_gemma2_and_equals_flash_on_any_length():
    """Nothing chosen: the kernel that serves Gemma 2 here (naive on a CPU); flash on a length
    that is no multiple of its tiles (23 tokens) gives the same logits."""
    model = zoo.Transformer(GEMMA2, key=jax.random.key(0))
    assert model.policy.attention == (Naive() if jax.default_backend() == "cpu" else Flash())
    tokens = jnp.arange(23)[None] % GEMMA2.vocab_size
    np.testing.assert_allclose(
        model.with_policy(attention="flash")(tokens), model(tokens), rtol=1e-5, atol=1e-5
    )
