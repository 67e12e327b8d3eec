"""The jitted train and eval steps: one implementation, on one device or sharded over a mesh.

`compile_steps(static, optimizer, accum, placement=..., model=...)` jits the same `train_step`
either plainly or, with a mesh, with the parameters', optimizer state's and batch's shardings in
and out and the sharding rules active while it is traced (so `shard.constrain` places the
activations; XLA's SPMD partitioner inserts the all-gathers, reduce-scatters and all-reduces).
`.lower(params, opt_state, batch).compile(options)` gives the per-device program ahead of time
(`.as_text()`: the collectives it runs; tests/shard read it).

Frozen weights (a LoRA run's base, a quantized base) are arguments of the compiled program, bound
once by `Bound`: closed over, jit would bake them into the executable as constants (a second copy
of the base, and a slow compile).

Mixed precision: the model holds `Policy.param_dtype` weights (float32 master weights, so the
AdamW state is float32 too) and computes in `Policy.compute_dtype` (e.g. bfloat16); gradients
arrive in the parameters' dtype. Remat follows `Policy.remat` inside the model's stacks.

Gradient accumulation splits the batch into `accum` micro-batches and sums their gradients in a
`lax.scan`; dividing every micro-batch's loss sum by the whole batch's token count makes the
cross-entropy gradient equal to one step on the whole batch. Micro-batch i takes rows
i, i + accum, ... so that, with the batch split over devices, each micro-batch stays spread over
all of them. The MoE auxiliary loss is averaged over micro-batches (see training/loss.py).
On a mesh with a pipeline axis each of those parts is split again into `Policy.microbatches`
(train.py's `--microbatches`, the same rows i::M of the part) streamed through the stages in one
forward and backward (zoo/pipeline_loss.py); the loss terms' `objective` carries the scales,
since 1F1B computes its gradient while it runs.
"""

import dataclasses
from typing import Any, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from data.packing import Batch
from layers.moe import MoE, MoEStats
from shard import Placement
from shard.axes import is_array_like
from training.loss import DEFAULT_AUX_WEIGHTS, AuxWeights, CrossEntropy, LossTerms
from zoo import Transformer, update_router_bias
from zoo.adapter import split_trainable


class Objective(Protocol):
    """What a step minimises (`CrossEntropy`, training/preference.py's `PreferenceObjective`):
    `terms(model, micro_batch, nll_scale=, aux_scale=)` its loss summed over a micro-batch and
    `objective`, the scaled sum the step differentiates (the scales go in, not on the result:
    a 1F1B pipeline computes the gradient while it runs), `total(batch)` the count the sum is
    divided by over the whole batch, `batch_axes` the batch's logical axes."""

    batch_axes: str

    def total(self, batch) -> Float[Array, ""]: ...

    def terms(
        self,
        model: Transformer,
        batch,
        *,
        nll_scale: Float[Array, ""] | float = 1.0,
        aux_scale: Float[Array, ""] | float = 1.0,
    ) -> LossTerms: ...


class StepMetrics(eqx.Module):
    """What one optimizer step reports. `loss` is the mean cross-entropy (comparable with the
    validation loss); `aux_loss` the weighted MoE terms added to it for the gradient; `moe` the
    router statistics per MoE layer (empty arrays for a dense model), averaged over
    micro-batches: `moe.expert_load` [layers, experts], `moe.dropped_fraction` [layers];
    `stats` the objective's extra metrics (a preference loss's accuracy and margin), averaged
    over its count."""

    loss: Float[Array, ""]
    grad_norm: Float[Array, ""]
    aux_loss: Float[Array, ""]
    moe: MoEStats
    stats: dict[str, Float[Array, ""]] = eqx.field(default_factory=dict)


def split_model(model: Transformer) -> tuple[Any, Any]:
    """(trainable arrays, everything else); the optimizer sees only the first. The one place
    that decides what trains: every float array, or, when the model holds LoRA adapters
    (`zoo.add_lora`), their A and B alone; a quantized base (`zoo.quantize_base`) never
    (`zoo.adapter.split_trainable`). Works on abstract models too (`eqx.filter_eval_shape`)."""
    return split_trainable(model)


def abstract_batch(batch_size: int, seq_len: int, sharding=None) -> Batch:
    """Shapes, dtypes (and sharding) of a training batch, as packing makes it: what the step is
    compiled for before any data arrives."""
    return CrossEntropy().abstract_batch(batch_size, seq_len, sharding)


def micro_batches(batch: Batch, accum: int) -> Batch:
    """[batch, ...] arrays -> [accum, batch / accum, ...], micro-batch i holding rows i::accum."""
    if batch.inputs.shape[0] % accum:
        raise ValueError(
            f"--batch-size {batch.inputs.shape[0]} is not divisible by --grad-accum {accum}"
        )
    return jax.tree.map(lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1), batch)


def train_step(
    params,
    opt_state,
    batch: Batch,
    *,
    static,
    optimizer,
    accum: int,
    aux_weights: AuxWeights = DEFAULT_AUX_WEIGHTS,
    objective: Objective | None = None,
) -> tuple[Any, Any, StepMetrics]:
    """One optimizer step on `batch` ([batch, seq] arrays) in `accum` micro-batches. `objective`
    (default `CrossEntropy(aux_weights)`) says what is minimised: its loss summed over each
    micro-batch, divided by its count over the whole batch (`objective.total`)."""
    objective = objective or CrossEntropy(aux_weights)
    micro = micro_batches(batch, accum)
    total = jnp.maximum(objective.total(batch), 1.0)

    def loss(p, mb: Batch):
        terms = objective.terms(
            eqx.combine(p, static), mb, nll_scale=1 / total, aux_scale=1 / accum
        )
        return terms.objective, terms

    def add_micro(carry, mb: Batch):
        (_, terms), g = jax.value_and_grad(loss, has_aux=True)(params, mb)
        return jax.tree.map(jnp.add, carry, g), terms

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, terms = jax.lax.scan(add_micro, zeros, micro)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    moe = jax.tree.map(lambda x: jnp.mean(x, axis=0), terms.moe)
    if aux_weights.bias_rate and _router_bias_trains(params):
        params = update_router_bias(params, moe.expert_load, aux_weights.bias_rate)
    metrics = StepMetrics(
        loss=jnp.sum(terms.nll_sum) / total,
        grad_norm=optax.tree.norm(grads),
        aux_loss=jnp.mean(terms.aux_loss),
        moe=moe,
        stats={name: jnp.sum(value) / total for name, value in (terms.stats or {}).items()},
    )
    return params, opt_state, metrics


def _router_bias_trains(params) -> bool:
    """Whether the trainable arrays hold DeepSeek-V3 router biases (a LoRA run's are frozen)."""
    if not params.config.router_bias:
        return False
    return any(
        isinstance(block.mlp, MoE) and block.mlp.router.bias is not None
        for stack in params.stacks
        for block in stack.blocks
    )


def eval_step(params, batch: Batch, *, static, objective: Objective | None = None):
    """(sum of token losses, token count) on one batch (of `objective`'s loss and count)."""
    terms = (objective or CrossEntropy()).terms(eqx.combine(params, static), batch)
    return terms.nll_sum, terms.tokens


@dataclasses.dataclass(frozen=True)
class Bound:
    """`fn(params, frozen, *rest)` called as `fn(params, *rest)`, with `frozen` (the model's
    arrays that do not train) bound here. `lower(...)` and `.compile()` keep the binding; any
    other attribute (`memory_analysis`, `as_text`) is `fn`'s."""

    fn: Any
    frozen: Any

    def __call__(self, params, *rest):
        return self.fn(params, self.frozen, *rest)

    def lower(self, params, *rest) -> "Bound":
        return Bound(self.fn.lower(params, self.frozen, *rest), self.frozen)

    def compile(self, *args, **kwargs) -> "Bound":
        return Bound(self.fn.compile(*args, **kwargs), self.frozen)

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def compile_steps(
    static,
    optimizer: optax.GradientTransformation,
    accum: int = 1,
    *,
    placement: Placement | None = None,
    model: Transformer | None = None,
    aux_weights: AuxWeights = DEFAULT_AUX_WEIGHTS,
    opt_state_memory: tuple[Any, Any] | None = None,
    objective: Objective | None = None,
) -> tuple[Bound, Bound]:
    """The jitted (train_step(params, opt_state, batch), eval_step(params, batch)), with the
    frozen arrays of `static` bound as arguments (`Bound`). Parameters and optimizer state are
    donated: the step updates them in place instead of holding two copies. With a sharded
    `placement`, `model` (real or abstract) gives the shardings. `opt_state_memory`, the
    optimizer state's (device, host) shardings (training/offload.py), keeps the state in host
    memory between steps: the step copies it in and back out. `objective` (default
    `CrossEntropy(aux_weights)`) is what both steps compute; its `batch_axes` name the batch's
    leading dims for the mesh."""
    placement = placement or Placement()
    objective = objective or CrossEntropy(aux_weights)
    frozen, skeleton = eqx.partition(static, is_array_like)

    def train(params, frozen, opt_state, batch):
        if opt_state_memory is not None:
            opt_state = jax.device_put(opt_state, opt_state_memory[0])
        with placement.context():
            params, opt_state, metrics = train_step(
                params,
                opt_state,
                batch,
                static=eqx.combine(frozen, skeleton),
                optimizer=optimizer,
                accum=accum,
                objective=objective,
            )
        if opt_state_memory is not None:
            opt_state = jax.device_put(opt_state, opt_state_memory[1])
        return params, opt_state, metrics

    def evaluate(params, frozen, batch):
        with placement.context():
            return eval_step(
                params, batch, static=eqx.combine(frozen, skeleton), objective=objective
            )

    if not placement.sharded:
        train_jit = jax.jit(train, donate_argnums=(0, 2))
        if opt_state_memory is not None:  # None: as the argument is placed
            host = opt_state_memory[1]
            train_jit = jax.jit(
                train,
                in_shardings=(None, None, host, None),
                out_shardings=(None, host, None),
                donate_argnums=(0, 2),
            )
        return Bound(train_jit, frozen), Bound(jax.jit(evaluate), frozen)
    if model is None:
        raise ValueError("compile_steps with a mesh needs the model to read its shardings from")
    trainable, frozen_model = split_model(model)
    params_s = placement.param_shardings(trainable)
    frozen_s = placement.param_shardings(eqx.filter(frozen_model, is_array_like))
    state_s = placement.opt_state_shardings(optimizer, trainable)
    if opt_state_memory is not None:
        state_s = opt_state_memory[1]
    batch_s = placement.batch_sharding(objective.batch_axes)
    replicated = placement.replicated()
    train_jit = jax.jit(
        train,
        in_shardings=(params_s, frozen_s, state_s, batch_s),
        out_shardings=(params_s, state_s, replicated),
        donate_argnums=(0, 2),
    )
    eval_jit = jax.jit(
        evaluate, in_shardings=(params_s, frozen_s, batch_s), out_shardings=replicated
    )
    return Bound(train_jit, frozen), Bound(eval_jit, frozen)
