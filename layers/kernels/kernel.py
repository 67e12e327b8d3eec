"""Attention kernels as objects: what a model's run-time policy holds and every attention call
receives. Each is a frozen (hashable, so static under jit) callable with the one contract of
`naive_attention`; a kernel carries its own settings (flash its tile sizes), so a policy can say
exactly which kernel runs and how, and a kernel that cannot handle an input raises instead of
falling back to another."""

import dataclasses
from typing import ClassVar, Protocol, runtime_checkable

from jaxtyping import Array, Float

from layers.kernels.context import AllGatherKV, Ring
from layers.kernels.cudnn import cudnn_attention
from layers.kernels.flash import DEFAULT_BLOCK_SIZES, BlockSizes, flash_attention
from layers.kernels.mask import AttentionMask
from layers.kernels.naive import naive_attention
from layers.kernels.xla import xla_attention


@runtime_checkable
class AttentionKernel(Protocol):
    """`kernel(q [batch, seq, heads, head_dim], k, v [batch, kv_seq, kv_heads, head_dim], mask,
    *, softcap=None) -> [batch, seq, heads, head_dim]`; hashable (a frozen dataclass), `name` for
    logs and CLIs. A kernel that cannot soft-cap raises on a `softcap`."""

    name: str

    def __call__(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch kv_seq kv_heads head_dim"],
        v: Float[Array, "batch kv_seq kv_heads head_dim"],
        mask: AttentionMask,
        *,
        softcap: float | None = None,
    ) -> Float[Array, "batch seq heads head_dim"]: ...


@dataclasses.dataclass(frozen=True)
class Naive:
    """The executable specification (`naive_attention`): the full score matrix in float32."""

    name: ClassVar[str] = "naive"

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return naive_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True)
class Xla:
    """`jax.nn.dot_product_attention(implementation="xla")` (`xla_attention`)."""

    name: ClassVar[str] = "xla"

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return xla_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True)
class Cudnn:
    """cuDNN's flash attention on NVIDIA GPUs (`cudnn_attention`): causal self-attention,
    bfloat16/float16; what it cannot serve is refused."""

    name: ClassVar[str] = "cudnn"

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return cudnn_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flash:
    """The Pallas flash kernel (`flash_attention`) with its tiles and launch settings;
    `interpret=None` interprets on CPU and compiles elsewhere."""

    name: ClassVar[str] = "flash"
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES
    interpret: bool | None = None

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return flash_attention(
            q, k, v, mask, softcap=softcap, block_sizes=self.block_sizes, interpret=self.interpret
        )


KERNELS: dict[str, AttentionKernel] = {
    "naive": Naive(),
    "xla": Xla(),
    "flash": Flash(),
    "cudnn": Cudnn(),
    "ring": Ring(),
    "allgather": AllGatherKV(),
}


def kernel_named(name: str) -> AttentionKernel:
    """The kernel a name stands for, with its default settings (for command lines and
    configs); an unknown name is an error that lists the known ones."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    return KERNELS[name]
