"""A few sharded Adam steps of a tiny model by train.py's step (training/step.py), run by
tests/shard/test_multihost.py in each of two processes (4 CPU devices each, joined by
`jax.distributed.initialize`) and, for reference, in one process with 8 devices (NUM_PROCESSES 1:
no distributed runtime).

    python tests/shard/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz
"""

import sys

import jax
import numpy as np

STEPS = 3


def train() -> tuple[list[float], list[np.ndarray]]:
    """Losses of each step and the final parameters (whole, on the host) on a fsdp=4 x tensor=2
    mesh over every device of every process."""
    import optax
    from jax.experimental import multihost_utils

    import shard
    import zoo
    from data.packing import to_batch
    from training.step import compile_steps, split_model

    config = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)
    rules = shard.ShardingRules.preset("fsdp_tp")
    placement = shard.Placement(shard.mesh(fsdp=4, tensor=2), rules)
    model = placement.init(lambda key: zoo.Transformer(config, key=key), jax.random.key(0))
    optimizer = optax.adam(1e-2)
    params, static = split_model(model)
    state = placement.init_opt_state(optimizer, params)
    step, _ = compile_steps(static, optimizer, placement=placement, model=model)
    # One batch, seen every step, so the loss must fall.
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 9)).astype(np.int32)
    batch = placement.batch(to_batch(tokens, np.ones_like(tokens)))
    losses = []
    for _ in range(STEPS):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics.loss))
    params = multihost_utils.process_allgather(params, tiled=True)
    return losses, [np.asarray(p) for p in jax.tree.leaves(params)]


if __name__ == "__main__":
    process_id, num_processes, port, out = sys.argv[1:]
    distributed = int(num_processes) > 1
    if distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=int(num_processes),
            process_id=int(process_id),
        )
    losses, params = train()
    if jax.process_index() == 0:
        np.savez(out, *params, losses=np.array(losses))
    if distributed:
        jax.distributed.shutdown()
