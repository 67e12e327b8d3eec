"""LoRA adapters per request: a model with two banked adapters (different targets and ranks)
serves requests for either adapter and for the base in one batch, each getting the greedy tokens
of its own model alone (the adapted model itself, and the base, by full forwards: `alone`, the
engine tests' specification); a prompt's pages are shared only within an adapter."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from infer.engine import Engine
from layers.lora_bank import LoRABank, adapters_in, with_adapter_rows
from tests.infer.test_engine import alone
from zoo.adapter import is_lora

LLAMA = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256)


def adapted(model, targets, rank, alpha, seed):
    """`model` plus a LoRA adapter whose B is random (a fresh one's is zero: no effect)."""
    model = zoo.add_lora(model, targets, rank, alpha, key=jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def randomize(node):
        if not is_lora(node):
            return node
        b = 0.5 * rng.standard_normal(node.lora_b.shape).astype(np.float32)
        return eqx.tree_at(lambda n: n.lora_b, node, b)

    return jax.tree.map(randomize, model, is_leaf=is_lora)


def greedy(model, prompts, n, adapters=None):
    # warm_up=False: only the step shapes these requests use compile.
    engine = Engine(model, max_batch=4, max_len=64, page_size=8, chunk=16, warm_up=False)
    adapters = adapters or [-1] * len(prompts)
    requests = [engine.submit(p, max_new_tokens=n, adapter=a)
                for p, a in zip(prompts, adapters, strict=True)]  # fmt: skip
    engine.run()
    return [r.tokens for r in requests]


@pytest.mark.parametrize("storage", ["unrolled", "stacked"])
def test_requests_for_two_adapters_and_the_base_share_a_batch(storage):
    base = zoo.Transformer(LLAMA, policy=zoo.Policy(storage=storage), key=jax.random.key(0))
    first = adapted(base, ["q_proj", "v_proj"], rank=4, alpha=8, seed=1)
    second = adapted(base, ["o_proj", "up_proj", "down_proj"], rank=2, alpha=2, seed=2)
    banked = zoo.bank_adapters(base, [first, second])
    assert adapters_in(banked) == 2
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5], [30, 40]]
    which = [0, 1, -1, 1]
    together = greedy(banked, prompts, 8, which)
    for prompt, adapter, tokens in zip(prompts, which, together, strict=True):
        model = {0: first, 1: second, -1: base}[adapter]
        assert tokens == alone(model, prompt, 8), adapter
    assert together[0] != together[2]  # the adapter changes what is generated


def test_a_prefix_is_shared_only_within_an_adapter():
    """Keys and values depend on the adapter: a prompt prefilled for one adapter is reused by
    the next request for that adapter, never by one for another."""
    base = zoo.Transformer(LLAMA, policy=zoo.Policy(storage="unrolled"), key=jax.random.key(0))
    first = adapted(base, ["k_proj", "v_proj"], rank=4, alpha=8, seed=1)
    banked = zoo.bank_adapters(base, [first])
    engine = Engine(banked, max_batch=2, max_len=64, page_size=8, chunk=16, warm_up=False)
    prompt = list(range(1, 21))  # two full pages
    runs = []
    for adapter in (0, -1, 0):
        runs.append(engine.submit(prompt, max_new_tokens=6, adapter=adapter))
        engine.run()
    assert [r.reused_tokens for r in runs] == [0, 0, 16]
    assert runs[1].tokens == alone(base, prompt, 6)
    assert runs[2].tokens == runs[0].tokens == alone(first, prompt, 6)


def test_bad_adapter_choices(tmp_path):
    base = zoo.Transformer(LLAMA, policy=zoo.Policy(storage="unrolled"), key=jax.random.key(0))
    one = adapted(base, ["q_proj"], rank=2, alpha=2, seed=3)
    with pytest.raises(ValueError, match="needs the base model without adapters"):
        zoo.bank_adapters(one, [one])
    with pytest.raises(ValueError, match="adapted model 0 holds no LoRA adapter"):
        zoo.bank_adapters(base, [base])
    banked = zoo.bank_adapters(base, [one])
    engine = Engine(banked, max_batch=1, max_len=32, chunk=16, warm_up=False)
    with pytest.raises(ValueError, match="one of the model's 1 banked adapters, got 1"):
        engine.submit([1], max_new_tokens=1, adapter=1)
    bank = next(n for n in jax.tree.leaves(banked, is_leaf=lambda n: isinstance(n, LoRABank))
                if isinstance(n, LoRABank))  # fmt: skip
    with pytest.raises(ValueError, match="choose each row's adapter first"):
        bank(jnp.ones((2, 1, LLAMA.d_model)))
    assert with_adapter_rows(bank, jnp.array([0, -1])).rows.shape[-1] == 2
