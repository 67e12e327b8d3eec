"""Optimizer-state host offload (`train.py --offload-opt-state`): Adam's moments live in pinned
host memory (JAX memory kinds) between steps, and each step copies them to the device, updates
them and copies them back, so the device holds them only while the update runs. It trades
2 x the state's bytes of host-device traffic per step for that much device memory between steps
(the plan printer, `python -m training.plan --offload-opt-state`, shows both).

Pinned host memory is what the device can copy to and from directly (DMA); a backend whose
devices report no `pinned_host` memory cannot hold the state there, and the flag is refused.
"""

from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.sharding import SingleDeviceSharding
from jaxtyping import PyTree

from shard import Placement

HOST = "pinned_host"


def check_supported(devices: Sequence[jax.Device]) -> None:
    """A ValueError naming the device and the memories it has unless every device of `devices`
    has pinned host memory."""
    for device in devices:
        kinds = sorted(m.kind for m in device.addressable_memories())
        if HOST not in kinds:
            raise ValueError(
                f"--offload-opt-state: {device.platform} device {device.id} has no {HOST} "
                f"memory (its memories: {', '.join(kinds)}), so the optimizer state cannot be "
                "held on the host; drop the flag (or shard the state over more devices with "
                "--mesh fsdp=N)"
            )


def state_shardings(
    placement: Placement, optimizer: optax.GradientTransformation, params: PyTree
) -> tuple[Any, Any]:
    """(device, host) shardings of `optimizer.init(params)`: the placement's (the default
    device without a mesh), and the same in pinned host memory."""
    devices = placement.mesh.devices.flat if placement.sharded else jax.devices()[:1]
    check_supported(list(devices))
    device = placement.opt_state_shardings(optimizer, params)
    if device is None:
        one = SingleDeviceSharding(jax.devices()[0])
        device = jax.tree.map(lambda _: one, jax.eval_shape(optimizer.init, params))
    return device, jax.tree.map(lambda s: s.with_memory_kind(HOST), device)
