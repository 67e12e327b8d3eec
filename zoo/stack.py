"""The layer stack: the one module that holds and runs a model's blocks.

A `Stack` is `repeats` repetitions of a period of blocks: a dense model is one stack of period
(dense block,), or of its attention pattern's period (Gemma: `segments`); Mixtral one of (MoE
block,); a model whose MoE layers alternate with dense ones a
stack of period (dense, ..., MoE); DeepSeek-MoE's leading dense layers a stack of their own. Every
setting of the policy (remat, scan, kernel, dispatch) applies to every stack alike.

Storage: `stacked` (each leaf of a period block carries a leading `[repeats]` axis, built with
`eqx.filter_vmap`, run by `lax.scan` so compile time does not grow with depth, or by a Python loop
over the same weights) or unrolled (one block per layer, run by a Python loop, each layer a
call of a program JAX traces once per distinct block: `_unrolled_layer`), as the model's
`Policy.storage` says: stacked for training, and for decode where the kernels read a layer of a
stacked weight in place (a cached call's loop gets the stacks whole: `_read_layer`; one CPU
device in float32, `zoo.policy.decode_storage`), so a step program holds one layer's body;
unrolled where a stacked weight's slice would be copied inside each step (bf16, a mesh, a GPU;
bench/decode_layout.py measures it). `Transformer.with_policy` converts between them once;
nothing converts per call.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from layers.kernels import AttentionMask
from layers.kernels.flash.attention import RESIDUAL_NAMES as FLASH_RESIDUALS
from layers.linear import Linear
from layers.moe import MoEStats
from layers.quantized import QuantizedLinear
from shard.rules import active
from zoo.block import Block, Rope
from zoo.config import Config
from zoo.pattern import LayerPattern
from zoo.policy import Policy

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the weight matmuls' outputs and flash attention's output and log-sum-exp (so backward
    # does not re-run the forward kernel; JAX >= 0.12: 0.11 hides names inside a custom_vjp from
    # the policy); recompute attention scores and elementwise ops.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*FLASH_RESIDUALS),
    ),
}


def _stack_stats(stats: list[MoEStats]) -> MoEStats | None:
    return jax.tree.map(lambda *s: jnp.stack(s), *stats) if stats else None


class Stack(eqx.Module):
    """`repeats` x `period` blocks in layer order: layer `r * period + j` is repeat r of block j.

    `blocks`: stacked storage, the period's blocks with `[repeats, ...]` leaves; unrolled, every
    layer's block in order."""

    blocks: tuple[Block, ...]
    repeats: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    stacked: bool = eqx.field(static=True)

    @property
    def n_layers(self) -> int:
        return self.repeats * self.period

    def layer(self, i: int) -> Block:
        """Layer i's block (for a stacked stack, slices of its weights: a copy)."""
        if not self.stacked:
            return self.blocks[i]
        r, j = divmod(i, self.period)
        dynamic, static = eqx.partition(self.blocks[j], eqx.is_array)
        return eqx.combine(jax.tree.map(lambda w: w[r], dynamic), static)

    def unstacked(self) -> "Stack":
        """The same layers, one block each (a copy of the weights; drop the stacked model)."""
        if not self.stacked:
            return self
        layers = tuple(self.layer(i) for i in range(self.n_layers))
        return Stack(layers, self.repeats, self.period, stacked=False)

    @property
    def stackable(self) -> bool:
        """Whether `restacked` can stack these layers: each block of the period has the same
        structure, shapes and dtypes in every repeat (a GGUF may store each layer's projections
        in its own block type)."""

        def signature(block: Block):
            leaves = [(a.shape, a.dtype) for a in jax.tree.leaves(block) if eqx.is_array(a)]
            return jax.tree.structure(eqx.filter(block, eqx.is_array)), leaves

        return self.stacked or all(
            all(signature(b) == signature(self.blocks[j]) for b in self.blocks[j :: self.period])
            for j in range(self.period)
        )

    def restacked(self, *, consume: bool = False) -> "Stack":
        """The inverse of `unstacked`: each block of the period with its repeats' weights
        stacked on a leading axis (a copy of the weights). `consume`: each layer's arrays are
        deleted once stacked, so the copy never holds more than one weight twice (for a caller
        that owns them: `load_pretrained` stacking what it just read); this stack is then
        unusable."""
        if self.stacked:
            return self

        def stack(*layers):
            stacked = jnp.stack(layers)
            for array in {id(a): a for a in layers}.values() if consume else ():
                array.delete()
            return stacked

        blocks = []
        for j in range(self.period):
            layers = self.blocks[j :: self.period]
            dynamic, static = eqx.partition(layers, eqx.is_array)
            blocks.append(eqx.combine(jax.tree.map(stack, *dynamic), static[0]))
        return Stack(tuple(blocks), self.repeats, self.period, stacked=True)

    def cache_like(self, make: Callable[..., PyTree], windows: tuple[int | None, ...]) -> tuple:
        """A cache's layer arrays shaped like the storage: `make(layers=(repeats,), window=w)`
        per period block (stacked), or `make(layers=(), window=w)` per layer (unrolled). `w` is
        the layer's sliding window from `windows` (this stack's layers in order), for a period
        block the window its repeats share (None where they differ or have none): `make` may
        give a windowed layer a window-sized ring (layers/window_cache.py)."""
        if not self.stacked:
            return tuple(make(layers=(), window=w) for w in windows)
        shared = [set(windows[j :: self.period]) for j in range(self.period)]
        return tuple(
            make(layers=(self.repeats,), window=next(iter(w)) if len(w) == 1 else None)
            for w in shared
        )

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: Rope | None,
        *,
        policy: Policy,
        cache: tuple[PyTree, ...] | None = None,
        view: Callable | None = None,
        pattern: LayerPattern | None = None,
        local_rope: Rope | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None, tuple[PyTree, ...] | None]:
        """Every layer in order. Returns the output, the MoE layers' router statistics stacked on
        a leading axis in layer order (None without MoE layers) and the cache's layer arrays
        (`cache`, shaped by `cache_like`) with this call's keys and values written through
        `view(layer_arrays, layer_index)` (None without a cache). Remat applies when there is
        no cache (training); a cached call is inference. `pattern` (`[repeats, period]`, this
        stack's layers of `LayerPattern`) gives each layer its window and rotary table (the
        global `rope` or `local_rope`) as data: scanned like the weights."""
        remat = policy.remat != "none" and cache is None
        context = dict(mask=mask, rope=rope, local_rope=local_rope, policy=policy, view=view)

        if not self.stacked:
            stats = []
            for i, block in enumerate(self.blocks):
                kv = None if cache is None else (cache[i],)
                r, j = divmod(i, self.period)
                # One block per call: its pattern entry as a period of one.
                row = None if pattern is None else pattern.at(r, slice(j, j + 1))
                x, kv, layer_stats = _unrolled_layer(
                    block, x, kv, row, **context, remat=remat, sharding=active()
                )
                cache = cache if kv is None else (*cache[:i], kv[0], *cache[i + 1 :])
                stats += layer_stats
            return x, _stack_stats(stats), cache

        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        run = _period_runner(static, **context, remat=remat)
        # A cached call (inference) passes the weights to each layer whole: its projections
        # read their layer where it lies (`_read_layer`), where a slice would copy every weight
        # every step.
        in_place = cache is not None and policy.scan_layers

        def repeat(carry, xs):
            x, kv = carry
            weights, index, row = xs
            runner = run
            if in_place:
                layer = _read_layer(self.blocks, index)
                weights, layer_static = eqx.partition(layer, eqx.is_array)
                runner = _period_runner(layer_static, **context, remat=remat)
            x, kv, stats = runner(x, weights, kv, index, row)
            return (x, kv), tuple(stats)

        indices = jnp.arange(self.repeats)
        if policy.scan_layers:
            xs = (None if in_place else dynamic, indices, pattern)
            (x, cache), stats = jax.lax.scan(repeat, (x, cache), xs)
        else:
            outs = []
            for r in range(self.repeats):
                weights, row = jax.tree.map(lambda w, r=r: w[r], (dynamic, pattern))
                (x, cache), repeat_stats = repeat((x, cache), (weights, indices[r], row))
                outs.append(repeat_stats)
            stats = jax.tree.map(lambda *s: jnp.stack(s), *outs)
        if not stats:
            return x, None, cache
        # [repeats] per MoE block of the period -> [repeats * n_moe] in layer order.
        stats = jax.tree.map(lambda *s: jnp.stack(s, axis=1), *stats)
        return x, jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stats), cache


def _read_layer(blocks: PyTree, index: Int[Array, ""]) -> PyTree:
    """Stacked blocks (`[repeats, ...]` arrays) as repeat `index`: each projection
    (`Linear`, `QuantizedLinear`) keeps its stacked weight and reads `index` of it in its
    kernel (`at_layer`), every other array (norms, biases, experts, adapters) is sliced."""
    projection = lambda node: isinstance(node, Linear | QuantizedLinear)  # noqa: E731

    def take(node):
        if projection(node):
            return node.at_layer(index)
        return node[index] if eqx.is_array(node) else node

    return jax.tree.map(take, blocks, is_leaf=projection)


def _period_runner(static, *, mask, rope, local_rope, policy, view, remat) -> Callable:
    """(x, weights, cache, layer index, pattern row or None) -> (x, cache, stats) for the
    period's blocks `static` (their weights come as `weights`), as `Stack.__call__` runs them;
    under `jax.checkpoint` with the policy's remat when `remat`."""

    def run(x, weights, kv, index, row):
        new_kv, stats = [], []
        for j, block in enumerate(eqx.combine(weights, static)):
            layer_view = None if kv is None else view(kv[j], index)
            layer_mask, layer_rope = mask, rope
            if row is not None:
                layer_mask, layer_rope = row.at(j).apply(mask, rope, local_rope)
            x, layer_stats, layer_view = block(
                x, layer_mask, layer_rope, policy=policy, cache=layer_view
            )
            new_kv.append(None if layer_view is None else layer_view.arrays)
            stats += [] if layer_stats is None else [layer_stats]
        return x, (None if kv is None else tuple(new_kv)), stats

    return jax.checkpoint(run, policy=REMAT_POLICIES[policy.remat]) if remat else run


@eqx.filter_jit
def _unrolled_layer(block, x, kv, row, *, remat, sharding, **context):
    """One unrolled layer as a program of its own inside the caller's: JAX traces it once per
    distinct block structure and input shapes and the caller's lowering calls it per layer (XLA
    inlines the calls), so tracing a 30-layer model costs about one layer, not thirty
    (bench/RESULTS.md, "The first `generate`"). `sharding` (the active rules and mesh, which
    `constrain` reads inside) is part of the cache key, with every setting that is not an array.
    """
    del sharding
    weights, static = eqx.partition((block,), eqx.is_array)
    return _period_runner(static, **context, remat=remat)(x, weights, kv, None, row)


def pattern_period(windows: tuple[int | None, ...]) -> int:
    """The shortest p with windows[i] == windows[i % p] for every layer (Gemma 2: 2, Gemma 3:
    6; 1 where every layer attends alike)."""
    return next(
        p
        for p in range(1, len(windows) + 1)
        if all(w == windows[i % p] for i, w in enumerate(windows))
    )


def segments(config: Config) -> list[tuple[int, tuple[bool, ...], int]]:
    """The stacks a config needs, as (first layer, period as MoE flags, repeats).

    A dense model's period is its attention pattern's (`pattern_period`), so each block of the
    period is always a global or always a sliding layer and its KV cache can be sized to match
    (Gemma 3's 26 layers: 4 repeats of 5 sliding + 1 global, then the 2 layers left over as a
    stack of their own: MaxText scans Gemma 3 the same way)."""
    if config.n_experts == 0:
        period = pattern_period(config.layer_windows)
        repeats, rest = divmod(config.n_layers, period)
        stacks = [(0, (False,) * period, repeats)] if repeats else []
        return stacks + ([(repeats * period, (False,) * rest, 1)] if rest else [])
    first, every = config.first_dense_layers, config.moe_every
    period = (False,) * (every - 1) + (True,)
    leading = [(0, (False,), first)] if first else []
    return [*leading, (first, period, (config.n_layers - first) // every)]


def make_stacks(config: Config, *, dtype: DTypeLike, key: PRNGKeyArray) -> tuple[Stack, ...]:
    """Stacked storage for every segment; layer i is initialised from `split(key, n_layers)[i]`
    whatever stack it lands in."""
    keys = jax.random.split(key, config.n_layers)
    stacks = []
    for start, period, repeats in segments(config):
        blocks = []
        for j, moe in enumerate(period):
            layer_keys = keys[start + j : start + len(period) * repeats : len(period)]
            make = lambda k, moe=moe: Block(config, moe=moe, dtype=dtype, key=k)  # noqa: E731
            blocks.append(eqx.filter_vmap(make)(layer_keys))
        stacks.append(Stack(tuple(blocks), repeats, len(period), stacked=True))
    return tuple(stacks)
