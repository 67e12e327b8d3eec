"""The one config every model in the zoo is built from: a frozen, hashable dataclass (so it can be
static under jit), with derived sizes as properties and every check in `__post_init__`."""

import dataclasses
import typing
from typing import Literal, get_args

import jax.numpy as jnp

from layers.rotary import RopeScaling

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rope"]
MlpKind = Literal["gelu", "swiglu"]
AttentionKernel = Literal["naive", "xla", "flash"]
DType = Literal["float32", "bfloat16", "float16"]
Remat = Literal["none", "full", "dots"]
MoeDispatch = Literal["dropless", "capacity"]
RouterScoring = Literal["softmax", "sigmoid"]


# Runtime type checking is off for the config on purpose: `__post_init__` gives every bad field a
# ValueError naming it and listing the choices, which is kinder than a generic type error.
@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Hyperparameters of a decoder-only transformer.

    `n_kv_heads` defaults to `n_heads` (MHA); fewer gives GQA, 1 gives MQA. `head_dim` defaults to
    `d_model // n_heads`. `dtype` is the compute dtype; `param_dtype` the stored weights' dtype.

    Mixture of experts (`n_experts > 0`): after `first_dense_layers` dense layers, every
    `moe_every`-th layer's MLP is an MoE layer of `n_experts` SwiGLU experts of width `moe_d_ff`
    (default `d_ff`), `n_experts_per_token` of them per token, plus `n_shared_experts` always-on
    ones; the other layers stay dense with width `d_ff`. The `moe_*_weight`s scale the router's
    auxiliary losses in the training loss (`zoo.moe_aux_loss`).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int
    max_seq_len: int
    norm: Norm = "rmsnorm"
    norm_eps: float = 1e-5
    position: Position = "rope"
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    mlp: MlpKind = "swiglu"
    attention: AttentionKernel = "xla"
    tie_embeddings: bool = False
    bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    remat: Remat = "none"
    scan_layers: bool = True
    n_experts: int = 0
    n_experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_d_ff: int | None = None
    moe_dispatch: MoeDispatch = "dropless"
    capacity_factor: float = 1.25
    moe_every: int = 1
    first_dense_layers: int = 0
    router_scoring: RouterScoring = "softmax"
    router_normalize: bool = True
    moe_load_balancing_weight: float = 0.01
    moe_z_loss_weight: float = 0.001

    def __post_init__(self):
        for name, kind in [
            ("norm", Norm),
            ("position", Position),
            ("mlp", MlpKind),
            ("attention", AttentionKernel),
            ("dtype", DType),
            ("param_dtype", DType),
            ("remat", Remat),
            ("moe_dispatch", MoeDispatch),
            ("router_scoring", RouterScoring),
        ]:
            value, allowed = getattr(self, name), get_args(kind)
            if value not in allowed:
                raise ValueError(f"Config.{name}={value!r} is unknown; choose one of {allowed}")
        for name in ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"]:
            if getattr(self, name) < 1:
                raise ValueError(f"Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"Config.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(each K/V head serves an equal group of query heads)"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(
                    f"Config.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly or change d_model"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.position == "learned" and self.n_heads * self.head_dim != self.d_model:
            raise ValueError(
                f"Config.d_model={self.d_model} must equal n_heads x head_dim = "
                f"{self.n_heads} x {self.head_dim} for GPT-2 style (learned-position) models"
            )
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"Config.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.norm_eps <= 0:
            raise ValueError(f"Config.norm_eps must be > 0, got {self.norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"Config.sliding_window must be >= 1 or None, got {self.sliding_window}"
            )
        self._check_moe()

    def _check_moe(self):
        if self.n_experts < 0:
            raise ValueError(f"Config.n_experts must be >= 0 (0 = dense), got {self.n_experts}")
        if not self.capacity_factor > 0:
            raise ValueError(f"Config.capacity_factor must be > 0, got {self.capacity_factor}")
        for name in ["moe_load_balancing_weight", "moe_z_loss_weight"]:
            if getattr(self, name) < 0:
                raise ValueError(f"Config.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_experts == 0:
            return
        if not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ValueError(
                f"Config.n_experts_per_token={self.n_experts_per_token} must be between 1 and "
                f"n_experts={self.n_experts}"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"Config.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.moe_d_ff is not None and self.moe_d_ff < 1:
            raise ValueError(f"Config.moe_d_ff must be >= 1 or None, got {self.moe_d_ff}")
        if self.mlp != "swiglu" or self.bias:
            raise ValueError(
                f"Config.mlp={self.mlp!r}, bias={self.bias}: MoE experts are SwiGLU without "
                "biases; use mlp='swiglu' and bias=False with n_experts > 0"
            )
        if not 0 <= self.first_dense_layers < self.n_layers:
            raise ValueError(
                f"Config.first_dense_layers={self.first_dense_layers} must be in "
                f"[0, n_layers={self.n_layers}) so that some layer is an MoE layer"
            )
        if self.moe_every < 1 or (self.n_layers - self.first_dense_layers) % self.moe_every:
            raise ValueError(
                f"Config.moe_every={self.moe_every} must be >= 1 and divide the "
                f"{self.n_layers - self.first_dense_layers} layers after first_dense_layers "
                "(each group of moe_every layers ends with one MoE layer)"
            )

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (n_heads x head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together (n_kv_heads x head_dim)."""
        return self.n_kv_heads * self.head_dim

    @property
    def expert_d_ff(self) -> int:
        """Width of one routed (or shared) expert."""
        return self.moe_d_ff if self.moe_d_ff is not None else self.d_ff

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers (empty for a dense model): the last of each group of
        `moe_every` layers after the `first_dense_layers`."""
        if self.n_experts == 0:
            return ()
        start = self.first_dense_layers + self.moe_every - 1
        return tuple(range(start, self.n_layers, self.moe_every))

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (and re-checked). A `head_dim` or `n_kv_heads` that was
        derived (d_model // n_heads, or plain MHA) is derived again from the new sizes."""
        resized = "d_model" in changes or "n_heads" in changes
        if resized and "head_dim" not in changes and self.head_dim * self.n_heads == self.d_model:
            changes["head_dim"] = None
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        return dataclasses.replace(self, **changes)
