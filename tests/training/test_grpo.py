"""GRPO: the group advantages and the clipped objective equal a case computed by hand; the loop
(engine rollouts on the current weights, LoRA or full) raises a graded reward on a tiny model,
compiles its update and the engine's programs once, skips and counts a group whose reward
raises or is not finite, and refuses settings out of range."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from tests.training.conftest import write_checkpoint
from training import evaluate, grpo
from training.grpo import GRPOSettings, group_advantages, grpo_objective


def test_group_advantages_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: all equal, so 0; group 3:
    # mean 0.75, deviations -0.75 x3 and 2.25, std sqrt((3 * 0.5625 + 5.0625) / 3) = 1.5.
    s1 = math.sqrt(1 / 3)
    expected = [
        [0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4)],
        [0.0, 0.0, 0.0, 0.0],
        [-0.75 / 1.5001, -0.75 / 1.5001, -0.75 / 1.5001, 2.25 / 1.5001],
    ]
    np.testing.assert_allclose(group_advantages(rewards), expected, rtol=1e-12)


def test_clipped_objective_by_hand():
    """Two completions of three token slots (the last slot of row 0 is padding), eps = 0.2,
    beta = 0.1. Each token's ratio, clipped surrogate and k3 KL written out."""
    eps, beta = 0.2, 0.1
    ratios = [[1.5, 0.9, 1.0], [0.5, 1.1, 0.7]]  # pi / pi_old
    ref_over_pi = [[0.5, 1.0, 1.0], [2.0, 1.0, 0.8]]  # pi_ref / pi
    advantages = [1.0, -2.0]
    mask = [[1, 1, 0], [1, 1, 1]]
    logp = np.log([[0.3, 0.2, 0.1], [0.25, 0.4, 0.5]])
    old = logp - np.log(ratios)
    ref = logp + np.log(ref_over_pi)
    # Row 0 (A = 1): token 1: min(1.5, clip -> 1.2) = 1.2; token 2: min(0.9, 0.9) = 0.9.
    # KL: 0.5 - log 0.5 - 1 = 0.19315; 1 - 0 - 1 = 0.
    kl_half = 0.5 - math.log(0.5) - 1
    row0 = ((1.2 - beta * kl_half) + (0.9 - beta * 0.0)) / 2
    # Row 1 (A = -2): token 1: min(-1.0, clip 0.8 -> -1.6) = -1.6; token 2: min(-2.2,
    # clip 1.1 -> -2.2) = -2.2; token 3: min(-1.4, clip 0.8 -> -1.6) = -1.6.
    kl_two, kl_08 = 2.0 - math.log(2.0) - 1, 0.8 - math.log(0.8) - 1
    row1 = ((-1.6 - beta * kl_two) + (-2.2 - beta * 0.0) + (-1.6 - beta * kl_08)) / 3
    out = grpo_objective(
        jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
        jnp.asarray(ref, jnp.float32), jnp.asarray(advantages, jnp.float32),
        jnp.asarray(mask, jnp.float32), clip_eps=eps, kl_beta=beta,
    )  # fmt: skip
    # float32 logs and exps of O(1) values: each term to a few eps (1.2e-7); 1e-6 is 8 eps.
    np.testing.assert_allclose(float(out.loss), -(row0 + row1) / 2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(out.kl), (kl_half + kl_two + kl_08) / 5, atol=1e-6)
    assert float(out.clipped) == pytest.approx(3 / 5)  # 1.5, 0.5, 0.7 are outside [0.8, 1.2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_size": 1}, "group_size must be an integer >= 2"),
        ({"kl_beta": -0.1}, "kl_beta must be finite and >= 0"),
        ({"kl_beta": float("nan")}, "kl_beta must be finite and >= 0"),
        ({"clip_eps": 0.0}, r"clip_eps must be in \(0, 1\)"),
        ({"clip_eps": 1.5}, r"clip_eps must be in \(0, 1\)"),
        ({"prompts_per_step": 0}, "prompts_per_step must be a positive integer"),
        ({"temperature": 0.0}, "temperature must be a positive finite number"),
    ],
)
def test_settings_out_of_range(change, message):
    with pytest.raises(ValueError, match=message):
        GRPOSettings(**change)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, corpus):
    config = zoo.preset("tiny-llama", vocab_size=320, n_layers=1)
    return evaluate.load_model(str(write_checkpoint(tmp_path_factory.mktemp("grpo"), corpus,
                                                    config=config)))  # fmt: skip


def vowels(completion: str, row) -> float:
    """A graded reward a random policy already earns sometimes: the share of vowels."""
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


def prompts(rng, n):
    return [{"prompt": f"def f{rng.integers(100)}(x):"} for _ in range(n)]


def test_grpo_raises_the_reward_with_lora_and_compiles_once(tiny):
    model, tokenizer = tiny
    lora = zoo.add_lora(model, ["q_proj", "v_proj", "down_proj"], 8, 16, key=jax.random.key(1))
    settings = GRPOSettings(
        group_size=8, prompts_per_step=4, steps=24, lr=3e-2, max_new_tokens=8, max_prompt_len=16,
        kl_beta=0.01, log_every=8,
    )  # fmt: skip
    before = dict(grpo.TRACES), dict(infer.engine.TRACES)
    result = grpo.train(lora, tokenizer, prompts, [vowels], settings, log=lambda _: None)
    # Learning, not noise: the last 6 steps' rewards above the first 6's by Welch's t > 3.2
    # (one-sided p < 0.005 at ~10 degrees of freedom), whatever the reward's scale.
    first, last = np.asarray(result.rewards[:6]), np.asarray(result.rewards[-6:])
    t = (last.mean() - first.mean()) / np.sqrt(first.var(ddof=1) / 6 + last.var(ddof=1) / 6)
    assert t > 3.2, result.rewards
    assert grpo.TRACES["update"] - before[0].get("update", 0) == 1
    for program in ("prefill", "decode"):  # the engine's programs: once, whatever the weights
        assert infer.engine.TRACES[program] - before[1].get(program, 0) <= 1
    assert all(t > 0 for t in result.rollout_tokens)
    assert result.skipped_groups == 0


def test_a_failing_reward_skips_its_group_and_a_full_model_trains(tiny):
    model, tokenizer = tiny
    model = jax.tree.map(jnp.copy, model)  # the updates donate the weights they train

    def picky(completion, row):
        if row["prompt"].startswith("def f1"):
            raise RuntimeError("cannot score this one")
        return math.nan if row["prompt"].startswith("def f2") else 1.0

    def rows(rng, n):
        return [{"prompt": f"def f{i}(x):"} for i in range(n)]

    settings = GRPOSettings(group_size=2, prompts_per_step=4, steps=2, max_new_tokens=4,
                            max_prompt_len=16, updates_per_rollout=2)  # fmt: skip
    reasons = []
    result = grpo.train(model, tokenizer, rows, [vowels, picky], settings, log=reasons.append)
    assert result.skipped_groups == 4  # two groups of the four per step, two steps
    assert "reward picky raised RuntimeError('cannot score this one')" in result.skip_reasons[0]
    assert "reward picky returned nan" in result.skip_reasons[1]
    assert len(result.rewards) == 2 and all(math.isfinite(r) for r in result.rewards)
    with pytest.raises(ValueError, match="more than max_prompt_len=16"):
        long = lambda rng, n: [{"prompt": "x = 1\n" * 40}] * n  # noqa: E731
        grpo.train(result.model, tokenizer, long, [vowels], settings)
