"""The device mesh: named axes (data, fsdp, tensor, expert, context), built over
`jax.make_mesh`.

Every mesh has all the axes (size 1 where unused), so any preset's rules fit any mesh.
"""

import math

import jax
from jax.sharding import AxisType, Mesh

from shard.rules import MESH_AXES


def mesh(
    *,
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    expert: int = 1,
    context: int = 1,
    devices: list | None = None,
    **unknown: int,
) -> Mesh:
    """A mesh of shape (data, fsdp, tensor, expert, context) over `devices` (default: every
    device of every process). The product of the sizes must equal the number of devices."""
    if unknown:
        raise ValueError(f"unknown mesh axis {sorted(unknown)}; mesh axes are {MESH_AXES}")
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert, "context": context}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {size!r}")
    devices = jax.devices() if devices is None else devices
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(
            f"mesh {sizes} holds {math.prod(sizes.values())} devices but there are "
            f"{len(devices)}; make the sizes multiply to {len(devices)}"
        )
    return jax.make_mesh(
        tuple(sizes.values()),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def parse_mesh(text: str) -> dict[str, int]:
    """ "fsdp=4,tensor=2" -> {"fsdp": 4, "tensor": 2} (for command lines such as train.py's
    --mesh); unknown axis names and malformed sizes are refused."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"bad mesh entry {part!r} in {text!r}; write e.g. fsdp=4,tensor=2")
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; mesh axes are {MESH_AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        sizes[name] = int(value)
    return sizes
