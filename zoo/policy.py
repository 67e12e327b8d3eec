"""How a model runs, apart from what it is: the run-time policy.

A `Config` is the architecture (what a checkpoint determines: sizes, norms, positions); a
`Policy` is everything that can change on the same weights: the compute and parameter dtypes,
the remat policy of each block, the attention kernel (an object carrying its own settings, e.g.
flash's tile sizes) and the paged kernel of cached decode, how the layers are stored (stacked
for `lax.scan`, or one array per layer) and run, whether q/k/v and gate/up are fused into one
projection each, and how MoE layers dispatch tokens. A model holds one policy;
`Transformer.with_policy` swaps it, touching the weights only where the storage, the fusion or the
parameter dtype changes (a one-time conversion).

Two starting points: `Policy()` trains (stacked layers under `lax.scan`: compile time does not
grow with depth); `Policy.inference(dtype)` is what `load_pretrained` gives and decodes fastest
in the storage `decode_storage` picks: stacked where the CPU kernels read each layer's
projections in place (`Linear.layer`), so a step program holds one layer's body and compiles
about twice as fast; elsewhere one array per layer, because a step that slices a stacked
weight for XLA's product copies it (XLA:CPU measured 2x slower per token; bench/RESULTS.md).
"""

import dataclasses
import typing
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from layers.kernels import AttentionKernel, kernel_named
from layers.kernels.kernel import DEFAULT_PREFERENCE, KERNELS
from layers.kernels.paged import CpuDecodeKernel, PagedKernel, PallasDecodeKernel, XlaPagedKernel
from layers.kernels.support import Needs, default_kernel, refusal
from layers.moe import Capacity, Dispatch, Dropless
from shard.pipeline import SCHEDULES, Schedule
from zoo.config import Config

DType = Literal["float32", "bfloat16", "float16"]
Remat = Literal["none", "full", "dots"]
Storage = Literal["stacked", "unrolled"]
MOE_DISPATCH = ("dropless", "capacity")


# Runtime type checking is off for the policy on purpose: `__post_init__` gives every bad field
# a ValueError naming it and listing the choices.
@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """`compute_dtype`: activations and matmuls (norms, softmax and the loss upcast to float32
    anyway); `param_dtype`: the stored weights (and so the optimizer state); `remat`: what each
    block keeps for the backward ("none", "dots": matmul outputs, "full": nothing);
    `attention`: a kernel object (`layers.kernels.Xla()`, `Naive()`, `Flash(block_sizes=...)`)
    or its name, or None: the default for the model, the first of xla, flash, naive that
    serves it and compiles on the backend (`for_model`; a Gemma 2 gets naive on a CPU, flash
    on a GPU, since xla cannot soft-cap); `scan_layers`: run stacked layers with `lax.scan`
    (False: a Python loop over the same weights, compile time growing with depth); `storage`:
    "stacked" (a leading `[repeats]` axis per weight, what `lax.scan` and pipelines need) or
    "unrolled" (one block per layer; `decode_storage` says which decodes faster); `fused`:
    q/k/v and gate/up as one projection each (fewer kernels per decode step; training,
    adapters, quantization and export need them separate); `decode_kernel`: the paged
    attention kernel of cached one-token steps (`XlaPagedKernel()`, `PallasDecodeKernel()`,
    `CpuDecodeKernel()`, or None: the backend's default, the Pallas kernel on a GPU and the C++
    one on a CPU where they serve the model, the XLA path elsewhere); `moe_dispatch`:
    `Dropless()`, `Capacity(factor)` or "dropless"/"capacity" (factor 1.25). On a mesh with a
    `pipeline` axis (zoo/pipeline.py; unused elsewhere): `microbatches`, how many micro-batches
    stream through the stages per forward; `pipeline_schedule`, "gpipe", "1f1b" or
    "interleaved" (shard/pipeline.py); `virtual_stages`, the interleaved schedule's layer chunks
    per device."""

    compute_dtype: DType = "float32"
    param_dtype: DType = "float32"
    remat: Remat = "none"
    attention: AttentionKernel | str | None = None
    scan_layers: bool = True
    storage: Storage = "stacked"
    fused: bool = False
    decode_kernel: PagedKernel | None = None
    moe_dispatch: Dispatch | str = "dropless"
    microbatches: int = 1
    pipeline_schedule: Schedule = "gpipe"
    virtual_stages: int = 2

    def __post_init__(self):
        for name, kind in [("compute_dtype", DType), ("param_dtype", DType), ("remat", Remat),
                           ("storage", Storage)]:  # fmt: skip
            value, allowed = getattr(self, name), get_args(kind)
            if value not in allowed:
                raise ValueError(f"Policy.{name}={value!r} is unknown; choose one of {allowed}")
        if isinstance(self.attention, str):
            object.__setattr__(self, "attention", kernel_named(self.attention))
        elif self.attention is not None and not isinstance(self.attention, AttentionKernel):
            raise ValueError(
                f"Policy.attention={self.attention!r} is not an attention kernel; give "
                "layers.kernels.Xla(), Naive(), Flash(...) or one of their names"
            )
        if isinstance(self.moe_dispatch, str):
            if self.moe_dispatch not in MOE_DISPATCH:
                raise ValueError(
                    f"Policy.moe_dispatch={self.moe_dispatch!r} is unknown; choose one of "
                    f"{MOE_DISPATCH} or give layers.moe.Dropless() / Capacity(factor)"
                )
            dispatch = Dropless() if self.moe_dispatch == "dropless" else Capacity(1.25)
            object.__setattr__(self, "moe_dispatch", dispatch)
        elif not isinstance(self.moe_dispatch, Dropless | Capacity):
            raise ValueError(
                f"Policy.moe_dispatch={self.moe_dispatch!r} is not a dispatch; give "
                "layers.moe.Dropless(), Capacity(factor), 'dropless' or 'capacity'"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"Policy.microbatches must be an int >= 1, got {self.microbatches!r}")
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"Policy.pipeline_schedule={self.pipeline_schedule!r} is unknown; choose one of "
                f"{SCHEDULES}"
            )
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(
                f"Policy.virtual_stages must be an int >= 1, got {self.virtual_stages!r}"
            )
        for name in ("scan_layers", "fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Policy.{name} must be a bool, got {getattr(self, name)!r}")
        kernels = XlaPagedKernel | PallasDecodeKernel | CpuDecodeKernel | None
        if not isinstance(self.decode_kernel, kernels):
            raise ValueError(
                f"Policy.decode_kernel={self.decode_kernel!r} is not a paged attention kernel; "
                "give layers.kernels.paged.XlaPagedKernel(), PallasDecodeKernel(), "
                "CpuDecodeKernel() or None (the backend's default)"
            )

    @property
    def compute(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def params(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def kernel_name(self) -> str:
        return "default" if self.attention is None else self.attention.name

    def for_model(self, config: Config) -> "Policy":
        """This policy for a model of `config`: the default kernel (None) resolved, and a kernel
        that cannot compute the model (soft-capping, per-layer windows, its head width) refused
        with an error naming the kernel, the feature and the kernels that can."""
        needs = attention_needs(config, self.compute_dtype)
        if self.attention is None:
            return self.replace(attention=default_kernel(needs, DEFAULT_PREFERENCE))
        why = refusal(self.attention, needs, candidates=list(KERNELS.values()))
        if why is not None:
            raise ValueError(f"Policy.attention: {why}")
        return self

    def replace(self, **changes) -> "Policy":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def of_dtype(dtype: str) -> "Policy":
        """Compute and store in `dtype` (what a checkpoint declares), everything else default."""
        return Policy(compute_dtype=dtype, param_dtype=dtype)

    @staticmethod
    def inference(
        dtype: str = "float32", *, sharded: bool = False, experts: bool = False
    ) -> "Policy":
        """Compute and store in `dtype`, layers stored as `decode_storage(dtype, sharded=,
        experts=)` says: the fastest decode measured (bench/RESULTS.md); what `load_pretrained`
        gives unless told otherwise."""
        storage = decode_storage(dtype, sharded=sharded, experts=experts)
        return Policy(compute_dtype=dtype, param_dtype=dtype, storage=storage)


def decode_storage(*dtypes: str, sharded: bool = False, experts: bool = False) -> Storage:
    """The layer storage that decodes fastest for a model computing and stored in `dtypes`
    (`experts`: with MoE layers): "stacked" on one CPU device in float32 without experts, where
    every projection's kernel (dense.cc, or the packed weights' matmul.cc) reads its layer of
    the stack in place, so decode costs what unrolled layers cost and its step programs compile
    about twice as fast (one layer's body in a loop, not 30 inlined copies: bench/RESULTS.md,
    "Stacked layers read in place"); "unrolled" elsewhere (other dtypes, a mesh, a GPU, MoE
    experts), where a stacked weight's slice is copied every step."""
    float32 = all(dtype == "float32" for dtype in dtypes or ("float32",))
    in_place = jax.default_backend() == "cpu" and not sharded and not experts and float32
    return "stacked" if in_place else "unrolled"


def attention_needs(config: Config, dtype: str | None = None) -> Needs:
    """What a model of `config` computing in `dtype` asks of its attention kernel. MLA's
    expanded attention pads queries, keys and values to one width, max(head_dim, v_head_dim)
    (layers/mla.py)."""
    width = max(config.head_dim, config.mla_v_head_dim) if config.mla else config.head_dim
    return Needs(
        softcap=config.attn_softcap,
        window=any(w is not None for w in config.layer_windows),
        per_layer_window=config.has_layer_pattern,
        head_dim=width,
        dtype=dtype,
    )
