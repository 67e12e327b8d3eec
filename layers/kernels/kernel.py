"""Attention kernels as objects: what a model's run-time policy holds and every attention call
receives. Each is a frozen (hashable, so static under jit) callable with the one contract of
`naive_attention`; a kernel carries its own settings (flash its tile sizes), so a policy can say
exactly which kernel runs and how, and a kernel that cannot handle an input raises instead of
falling back to another. Each declares what it supports (`supports`, layers/kernels/support.py),
so a model refuses a kernel that cannot serve it when it is built."""

import dataclasses
from typing import ClassVar, Protocol, runtime_checkable

from jaxtyping import Array, Float

from layers.kernels.context import AllGatherKV, Ring
from layers.kernels.cudnn import DTYPES as CUDNN_DTYPES
from layers.kernels.cudnn import HEAD_DIMS as CUDNN_HEAD_DIMS
from layers.kernels.cudnn import cudnn_attention
from layers.kernels.flash import DEFAULT_BLOCK_SIZES, BlockSizes, flash_attention
from layers.kernels.flash.config import SUPPORTED_HEAD_DIMS
from layers.kernels.mask import AttentionMask
from layers.kernels.naive import naive_attention
from layers.kernels.support import Supports
from layers.kernels.xla import xla_attention


@runtime_checkable
class AttentionKernel(Protocol):
    """`kernel(q [batch, seq, heads, head_dim], k, v [batch, kv_seq, kv_heads, head_dim], mask,
    *, softcap=None) -> [batch, seq, heads, head_dim]`; hashable (a frozen dataclass), `name` for
    logs and CLIs, `supports` what it can compute. A kernel that cannot soft-cap raises on a
    `softcap`."""

    name: str
    supports: Supports

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
    supports: ClassVar[Supports] = Supports()

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return naive_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True)
class Xla:
    """`jax.nn.dot_product_attention(implementation="xla")` (`xla_attention`)."""

    name: ClassVar[str] = "xla"
    supports: ClassVar[Supports] = Supports(softcap=False)

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return xla_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True)
class Cudnn:
    """cuDNN's flash attention on NVIDIA GPUs (`cudnn_attention`): causal self-attention,
    bfloat16/float16; what it cannot serve is refused."""

    name: ClassVar[str] = "cudnn"
    supports: ClassVar[Supports] = Supports(
        softcap=False,
        per_layer_window=False,
        head_dims=CUDNN_HEAD_DIMS,
        dtypes=CUDNN_DTYPES,
        compiles_on=("gpu",),
    )

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return cudnn_attention(q, k, v, mask, softcap=softcap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flash:
    """The Pallas flash kernel (`flash_attention`) with its tiles and launch settings;
    `interpret=None` interprets on CPU and compiles elsewhere (Triton, on a GPU). Any sequence
    length: a length that is not a multiple of the tiles is padded inside the kernel."""

    name: ClassVar[str] = "flash"
    supports: ClassVar[Supports] = Supports(
        head_dims=SUPPORTED_HEAD_DIMS, compiles_on=("gpu",), interprets_on=("cpu",)
    )
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES
    interpret: bool | None = None

    def __call__(self, q, k, v, mask: AttentionMask, *, softcap: float | None = None):
        return flash_attention(
            q, k, v, mask, softcap=softcap, block_sizes=self.block_sizes, interpret=self.interpret
        )


# The order the default policy tries kernels in (`support.default_kernel`): the first that
# serves the model and compiles on the backend.
DEFAULT_PREFERENCE = (Xla(), Flash(), Naive())
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
