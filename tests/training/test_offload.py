"""--offload-opt-state: the optimizer state lives in pinned host memory between steps and the
training is unchanged; a backend without pinned host memory is refused before any work."""

import json
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

import shard
import train
import zoo
from data.packing import to_batch
from tests.training.conftest import stopped_copy
from training import offload
from training.step import compile_steps, split_model


def _losses(run_dir) -> dict[int, float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_offloaded_resume_trains_as_the_plain_run(tmp_path, tiny_argv, full_run):
    # The plain run's step-3 checkpoint resumed with the state read into host memory and kept
    # there: the same arithmetic on the same device, the state only parked elsewhere, so the
    # losses are those of the plain run bit for bit.
    run = stopped_copy(full_run[0], tmp_path / "run", step=3)
    train.main([*tiny_argv(tmp_path / "x", "--steps", "6"), "--resume", str(run),
                "--offload-opt-state"])  # fmt: skip
    assert _losses(run) == _losses(full_run[0])


def test_sharded_state_stays_in_pinned_host_memory():
    config = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)
    placement = shard.Placement(shard.mesh(fsdp=8), shard.ShardingRules.preset("fsdp"))
    model = placement.init(lambda k: zoo.Transformer(config, key=k), jax.random.key(0))
    params, static = split_model(model)
    optimizer = optax.adam(1e-2)
    memory = offload.state_shardings(placement, optimizer, params)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 9)).astype(np.int32)
    batch = placement.batch(to_batch(tokens, np.ones_like(tokens)))
    losses = {}
    for kind, memory_arg in (("device", None), ("host", memory)):
        step, _ = compile_steps(
            static, optimizer, placement=placement, model=model, opt_state_memory=memory_arg
        )
        p, state = jax.tree.map(lambda x: x.copy(), params), optimizer.init(params)
        state = jax.device_put(state, memory[0] if memory_arg is None else memory[1])
        losses[kind] = []
        for _ in range(2):
            p, state, metrics = step(p, state, batch)
            losses[kind].append(float(metrics.loss))
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)}
        assert kinds == {offload.HOST if memory_arg else "device"}
    assert losses["host"] == losses["device"]


def test_a_backend_without_pinned_host_memory_is_refused():
    device = SimpleNamespace(
        platform="tpu", id=3, addressable_memories=lambda: [SimpleNamespace(kind="device")]
    )
    with pytest.raises(ValueError, match=r"tpu device 3 has no pinned_host memory .*device\)"):
        offload.check_supported([device])
    offload.check_supported(jax.devices())  # this backend (CPU) has it
