"""A tiny sharded AdamW run that checkpoints with training/run_dir.py's `Checkpointer`, run by
tests/shard/test_multihost_checkpoint.py as two processes (4 CPU devices each, joined by
`jax.distributed.initialize`) or as one process with 8 devices (NUM_PROCESSES 1).

    python tests/shard/checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT RUN_DIR MODE OUT.json

MODE `kill`: a fresh run of STEPS steps on fsdp=4 x tensor=2, checkpoints at steps 2 and 4 (the
save of 4 waits for 2 to be finalized); process 0 writes every step's loss to OUT.json, then
every process SIGKILLs itself right after handing step 4 to the background writer. MODE
`resume`: the run's newest finalized checkpoint restored onto fsdp=8 in this process layout,
trained on to STEPS; process 0 writes the losses of the steps it ran to OUT.json. Step s always
trains on the same batch, wherever it runs.
"""

import json
import os
import signal
import sys

import jax
import numpy as np

STEPS = 4


def batch_of(step: int, vocab: int) -> dict:
    from data.packing import to_batch

    tokens = np.random.default_rng(step).integers(0, vocab, (8, 9)).astype(np.int32)
    return to_batch(tokens, np.ones_like(tokens))


def main(run_dir: str, mode: str, out: str) -> None:
    import shard
    import zoo
    from training import run_dir as runs
    from training.optimizer import adamw
    from training.step import compile_steps, split_model

    config = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)
    policy = zoo.Policy()
    optimizer = adamw(lambda _: 1e-2)
    if mode == "kill":
        mesh, rules = shard.mesh(fsdp=4, tensor=2), "fsdp_tp"
    else:
        mesh, rules = shard.mesh(fsdp=8), "fsdp"
    placement = shard.Placement(mesh, shard.ShardingRules.preset(rules))
    if mode == "kill":
        model = placement.init(lambda k: zoo.Transformer(config, key=k), jax.random.key(0))
        params, static = split_model(model)
        opt_state, start = placement.init_opt_state(optimizer, params), 0
    else:
        model = runs.abstract_model(config, policy)
        restored = runs.restore(run_dir, model=model, optimizer=optimizer, placement=placement)
        params, opt_state, start = restored.params, restored.opt_state, restored.step
        static = split_model(model)[1]
    step_fn, _ = compile_steps(static, optimizer, placement=placement, model=model)
    checkpointer = runs.Checkpointer(run_dir, config=config, policy=policy)
    losses = {}
    for step in range(start + 1, STEPS + 1):
        batch = placement.batch(batch_of(step, config.vocab_size))
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        losses[step] = float(metrics.loss)
        if jax.process_index() == 0:
            with open(out, "w") as f:
                json.dump(losses, f)
        if mode == "kill" and step % 2 == 0:
            checkpointer.save(
                params=params, opt_state=opt_state, step=step, data_position=step,
                rng=jax.random.key(0),
            )  # fmt: skip
            if step == STEPS:
                os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()


if __name__ == "__main__":
    process_id, num_processes, port, run_dir, mode, out = sys.argv[1:]
    distributed = int(num_processes) > 1
    if distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=int(num_processes),
            process_id=int(process_id),
        )
    main(run_dir, mode, out)
    if distributed:
        jax.distributed.shutdown()
