"""GRPO: group-relative policy optimisation (Shao et al. 2024, "DeepSeekMath", section 4.1)
with rollouts from the serving engine on the current policy weights.

Each step samples P prompts, and G completions of each from the policy (one `infer.Engine`,
made once; before each rollout its `model` is set to the policy being trained: the same device
arrays, so nothing is copied through the host and nothing recompiles; a LoRA run swaps only its
adapters). Reward functions are plain Python callables, `reward(completion, row) -> float`,
summed. Within each group of G, the advantage of completion i is

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)          (std over the group, unbiased, as TRL)

and every token of completion i carries A_i. The objective (DeepSeekMath eq. 3, maximised; we
minimise its negative) averages over the tokens of each completion, then over completions:

    J = mean_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
                               - beta KL_it ],
    rho_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),
    KL_it  = pi_ref / pi - log(pi_ref / pi) - 1          (the unbiased k3 estimator, eq. 4)

pi_old is the policy that sampled the rollout: with one update per rollout (`updates_per_rollout`
= 1, the default) rho is 1 in value and its gradient is the policy gradient; with more, the
sampling policy's log-probs are computed once and rho moves away from 1 (then clipping acts).
pi_ref is the starting model: a LoRA policy's reference is the same weights with the adapters
off (no copy); a full fine-tune keeps the starting weights as a second copy (they move).

A group whose reward function raises or returns a non-finite value is skipped (its rows count
for nothing in the update) and counted; the run goes on. Every shape is fixed (prompts padded to
`max_prompt_len`, completions to `max_new_tokens`), so the update compiles once.
"""

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

import infer
from shard.axes import is_array_like
from training.evaluate import completion_text
from training.optimizer import adamw
from training.preference import without_adapters
from training.step import split_model
from zoo import Transformer
from zoo.adapter import has_lora

Reward = Callable[[str, Mapping[str, Any]], float]
TRACES = collections.Counter()


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """`group_size` G completions per prompt and `prompts_per_step` P per step, `steps` steps of
    `updates_per_rollout` AdamW updates at `lr` each; `kl_beta` and `clip_eps` the objective's
    beta and epsilon; completions of `max_new_tokens` at most, sampled at `temperature`, after
    prompts of `max_prompt_len` at most. Each is checked here: a ValueError naming it."""

    group_size: int = 8
    prompts_per_step: int = 4
    steps: int = 50
    lr: float = 1e-3
    kl_beta: float = 0.04  # DeepSeekMath's beta
    clip_eps: float = 0.2  # PPO's epsilon
    updates_per_rollout: int = 1
    max_new_tokens: int = 16
    max_prompt_len: int = 64
    temperature: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 1

    def __post_init__(self):
        counts = ("prompts_per_step", "steps", "updates_per_rollout", "max_new_tokens",
                  "max_prompt_len", "log_every")  # fmt: skip
        for name in counts:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GRPO {name} must be a positive integer, got {value!r}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(
                f"GRPO group_size must be an integer >= 2, got {self.group_size!r}: the "
                "advantages compare the completions of one prompt with each other, so a group "
                "needs at least two"
            )
        for name, low, high in (("kl_beta", 0.0, math.inf), ("clip_eps", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and low <= value
                    and value < high and (name != "clip_eps" or value > 0)):  # fmt: skip
                bound = "finite and >= 0" if name == "kl_beta" else "in (0, 1)"
                raise ValueError(f"GRPO {name} must be {bound}, got {value!r}")
        for name in ("lr", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GRPO {name} must be a positive finite number, got {value!r}")

    @property
    def rows(self) -> int:
        return self.group_size * self.prompts_per_step

    @property
    def seq_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """`[groups, G]` rewards -> advantages (module docstring); a group of equal rewards gets 0."""
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return (rewards - mean) / (std + 1e-4)


class Objective(eqx.Module):
    """The negative GRPO objective and what it is made of, each a scalar: `kl` the mean per-token
    k3 estimate, `clipped` the share of tokens whose ratio was clipped."""

    loss: Float[Array, ""]
    kl: Float[Array, ""]
    clipped: Float[Array, ""]


def grpo_objective(
    logp: Float[Array, "rows seq"],
    old_logp: Float[Array, "rows seq"],
    ref_logp: Float[Array, "rows seq"],
    advantages: Float[Array, " rows"],
    mask: Float[Array, "rows seq"],
    *,
    clip_eps: float,
    kl_beta: float,
) -> Objective:
    """-J of the module docstring from per-token log-probs of the completions' tokens (`mask`
    marks them); a row with no token counts for nothing."""
    ratio = jnp.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    log_ref_ratio = ref_logp - logp
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1
    per_token = surrogate - kl_beta * kl
    lengths = jnp.sum(mask, axis=1)
    rows = jnp.maximum(jnp.sum(lengths > 0), 1)
    per_row = jnp.sum(per_token * mask, axis=1) / jnp.maximum(lengths, 1)
    tokens = jnp.maximum(jnp.sum(mask), 1)
    outside = (ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)
    return Objective(
        loss=-jnp.sum(per_row) / rows,
        kl=jnp.sum(kl * mask) / tokens,
        clipped=jnp.sum(outside * mask) / tokens,
    )


def token_logps(
    model: Transformer, tokens: Int[Array, "rows seq"], segments: Int[Array, "rows seq"]
) -> Float[Array, "rows seq"]:
    """log p(tokens[:, t] | tokens[:, <t]) at every t >= 1 (0 at t = 0), float32."""
    logits = model(tokens[:, :-1], segment_ids=segments[:, :-1]).astype(jnp.float32)
    picked = -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.pad(picked, ((0, 0), (1, 0)))


@dataclasses.dataclass
class GRPOResult:
    """The trained model; per step the mean reward (of the groups not skipped), the rollout and
    update seconds and token counts; the groups skipped and why."""

    model: Transformer
    rewards: list[float]
    rollout_s: list[float]
    update_s: list[float]
    rollout_tokens: list[int]
    update_tokens: list[int]
    skipped_groups: int = 0
    skip_reasons: list[str] = dataclasses.field(default_factory=list)


def _prompt_ids(tokenizer, row: Mapping[str, Any]) -> list[int]:
    """A prompt row's ids: its `prompt` string (or `messages`) through the chat template when
    the tokenizer has one, else `<|endoftext|>` + the text."""
    if getattr(tokenizer, "chat_template", None):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    encoding = getattr(tokenizer, "encoding", tokenizer)
    return [encoding.eot_token, *encoding.encode_ordinary(row["prompt"])]


def _rewards(
    rewards: Sequence[Reward], completions: Sequence[str], row: Mapping[str, Any]
) -> tuple[np.ndarray | None, str | None]:
    """(the group's summed rewards, None) or (None, why the group is skipped)."""
    totals = np.zeros(len(completions))
    for fn in rewards:
        name = getattr(fn, "__name__", repr(fn))
        for i, completion in enumerate(completions):
            try:
                value = float(fn(completion, row))
            except Exception as error:
                return None, f"reward {name} raised {error!r} on {completion!r:.60}"
            if not math.isfinite(value):
                return None, f"reward {name} returned {value} on {completion!r:.60}"
            totals[i] += value
    return totals, None


def _update_fn(skeleton, optimizer, settings: GRPOSettings, lora: bool):
    """The jitted update: (params, frozen, reference, opt_state, batch...) -> (params, opt_state,
    Objective). The frozen arrays and the reference weights are arguments, not closed over: jit
    would bake them into the program as constants (a second copy, and a slow compile)."""

    def loss(params, frozen, reference, tokens, segments, mask, advantages, old_logp):
        static = eqx.combine(frozen, skeleton)
        model = eqx.combine(params, static)
        logp = token_logps(model, tokens, segments)
        ref_model = without_adapters(model) if lora else eqx.combine(reference, static)
        ref_logp = jax.lax.stop_gradient(token_logps(ref_model, tokens, segments))
        old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
        out = grpo_objective(logp, old, ref_logp, advantages, mask,
                             clip_eps=settings.clip_eps, kl_beta=settings.kl_beta)  # fmt: skip
        return out.loss, out

    def update(params, frozen, reference, opt_state, tokens, segments, mask, advantages,
               old_logp):  # fmt: skip
        TRACES["update"] += 1
        grads, out = jax.grad(loss, has_aux=True)(
            params, frozen, reference, tokens, segments, mask, advantages, old_logp
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    return jax.jit(update, donate_argnums=(0, 3))


@eqx.filter_jit
def _sampling_logps(model, tokens, segments):
    TRACES["old_logps"] += 1
    return token_logps(model, tokens, segments)


def train(
    model: Transformer,
    tokenizer,
    prompts: Callable[[np.random.Generator, int], Sequence[Mapping[str, Any]]],
    rewards: Sequence[Reward],
    settings: GRPOSettings = GRPOSettings(),
    *,
    log: Callable[[str], None] = print,
) -> GRPOResult:
    """GRPO on `model` (with LoRA adapters: they alone train). `prompts(rng, n)` gives n prompt
    rows (dicts with a `prompt` string or `messages`, plus whatever the rewards read) each step;
    `rewards` are callables `reward(completion_text, row) -> float`, summed. The trainable
    arrays of `model` are donated to the updates (use the returned `GRPOResult.model`)."""
    if not rewards:
        raise ValueError("GRPO needs at least one reward function")
    s = settings
    params, static = split_model(model)
    frozen, skeleton = eqx.partition(static, is_array_like)
    lora = has_lora(model)
    # A full fine-tune's reference is its starting weights, which the updates move (and donate):
    # a second copy. A LoRA policy's is the same weights with the adapters off.
    reference = None if lora else jax.tree.map(jnp.copy, params)
    optimizer = adamw(s.lr, weight_decay=s.weight_decay, clip=1.0)
    opt_state = optimizer.init(params)
    update = _update_fn(skeleton, optimizer, s, lora)
    encoding = getattr(tokenizer, "encoding", tokenizer)
    stops = tuple(getattr(tokenizer, "end_of_turn_ids", ())) or (encoding.eot_token,)
    rng = np.random.default_rng(s.seed)
    engine = infer.Engine(model, max_batch=s.rows, max_len=s.seq_len, key=jax.random.key(s.seed))
    sampler = infer.Temperature(s.temperature)
    result = GRPOResult(model, [], [], [], [], [])
    for step in range(1, s.steps + 1):
        rows = list(prompts(rng, s.prompts_per_step))
        if len(rows) != s.prompts_per_step:
            raise ValueError(
                f"prompts(rng, {s.prompts_per_step}) gave {len(rows)} rows, not "
                f"{s.prompts_per_step}"
            )
        ids = [_prompt_ids(tokenizer, row) for row in rows]
        for row, prompt in zip(rows, ids, strict=True):
            if len(prompt) > s.max_prompt_len:
                raise ValueError(
                    f"a prompt is {len(prompt)} tokens, more than max_prompt_len="
                    f"{s.max_prompt_len}: raise it ({row.get('prompt', row)!r:.60})"
                )
        # Rollout: the engine samples from the policy as it is now (same arrays, no copy).
        t0 = time.perf_counter()
        engine.model = eqx.combine(params, static)
        requests = [
            engine.submit(prompt, max_new_tokens=s.max_new_tokens, sampler=sampler,
                          stop_tokens=stops)
            for prompt in ids
            for _ in range(s.group_size)
        ]  # fmt: skip
        engine.run()
        rollout_s = time.perf_counter() - t0
        completions = [r.tokens for r in requests]
        texts = [completion_text(tokenizer, c, stops) for c in completions]
        # Rewards, per group; a failing group is skipped.
        advantages = np.zeros(s.rows, np.float32)
        keep = np.zeros(s.rows, bool)
        step_rewards = []
        for g, row in enumerate(rows):
            span = slice(g * s.group_size, (g + 1) * s.group_size)
            values, why = _rewards(rewards, texts[span], row)
            if values is None:
                result.skipped_groups += 1
                result.skip_reasons.append(f"step {step}: {why}")
                log(f"step {step}: group {g} skipped: {why}")
                continue
            advantages[span], keep[span] = group_advantages(values[None])[0], True
            step_rewards += list(values)
        # The update batch: prompt + completion per row, the loss on the completion's tokens.
        tokens = np.zeros((s.rows, s.seq_len), np.int32)
        segments = np.full((s.rows, s.seq_len), 2, np.int32)
        mask = np.zeros((s.rows, s.seq_len), np.float32)
        for i, completion in enumerate(completions):
            prompt = ids[i // s.group_size]
            n = len(prompt) + len(completion)
            tokens[i, :n], segments[i, :n] = [*prompt, *completion], 1
            mask[i, len(prompt) : n] = keep[i]
        t1 = time.perf_counter()
        old_logp = None
        if s.updates_per_rollout > 1:
            old_logp = _sampling_logps(eqx.combine(params, static), tokens, segments)
        for _ in range(s.updates_per_rollout):
            params, opt_state, out = update(
                params,
                frozen,
                reference,
                opt_state,
                tokens,
                segments,
                mask,
                advantages,
                old_logp,
            )
        loss = float(out.loss)  # waits for the update
        update_s = time.perf_counter() - t1
        mean_reward = float(np.mean(step_rewards)) if step_rewards else float("nan")
        generated = sum(len(c) for c in completions)
        processed = int(np.sum(segments == 1)) * s.updates_per_rollout
        result.rewards.append(mean_reward)
        result.rollout_s.append(rollout_s)
        result.update_s.append(update_s)
        result.rollout_tokens.append(generated)
        result.update_tokens.append(processed)
        if step % s.log_every == 0 or step == s.steps:
            log(
                f"step {step:4d} | reward {mean_reward:.3f} | loss {loss:+.4f} | kl "
                f"{float(out.kl):.4f} | clipped {float(out.clipped):.1%} | rollout "
                f"{rollout_s:.1f} s ({generated / rollout_s:,.0f} tok/s) | update {update_s:.1f} s "
                f"({processed / update_s:,.0f} tok/s) | skipped groups {result.skipped_groups}"
            )
    result.model = eqx.combine(params, static)
    total_roll, total_update = sum(result.rollout_s), sum(result.update_s)
    log(
        f"time: rollouts {total_roll:.0f} s ({sum(result.rollout_tokens) / total_roll:,.0f} "
        f"tok/s generated), updates {total_update:.0f} s "
        f"({sum(result.update_tokens) / total_update:,.0f} tok/s processed): "
        f"{total_roll / (total_roll + total_update):.0%} of the time in rollouts"
    )
    return result
