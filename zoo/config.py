"""The architecture every model in the zoo is built from: a frozen, hashable dataclass (so it can be
static under jit), with derived sizes as properties and every check in `__post_init__`. It holds
what a checkpoint determines; how the model runs (dtypes, remat, kernel, MoE dispatch) is the
`Policy` (zoo/policy.py). `to_dict`/`from_dict` are its JSON form, type-checked field by field."""

import dataclasses
import json
import types
import typing
from typing import Any, Literal, get_args

from layers.rotary import RopeScaling

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rope"]
MlpKind = Literal["gelu", "swiglu", "geglu"]
LayerType = Literal["full", "sliding"]
RouterScoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["top2", "max"]


# Runtime type checking is off for the config on purpose: `__post_init__` gives every bad field a
# ValueError naming it and listing the choices, which is kinder than a generic type error.
@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Hyperparameters of a decoder-only transformer.

    `n_kv_heads` defaults to `n_heads` (MHA); fewer gives GQA, 1 gives MQA. `head_dim` defaults to
    `d_model // n_heads`.

    Mixture of experts (`n_experts > 0`): after `first_dense_layers` dense layers, every
    `moe_every`-th layer's MLP is an MoE layer of `n_experts` SwiGLU experts of width `moe_d_ff`
    (default `d_ff`), `n_experts_per_token` of them per token, plus `n_shared_experts` always-on
    ones; the other layers stay dense with width `d_ff`. Routing is `router_scoring` (softmax or
    sigmoid), top-k renormalised iff `router_normalize`, times `router_scale`; DeepSeek-V3 adds
    `router_bias` (the aux-loss-free balancing bias, used to choose experts only) and
    group-limited selection (`router_groups` groups, the best `router_topk_groups` kept, a
    group scored by the sum of its two best experts, or by its best one for DeepSeek-V2's
    `router_group_score="max"`).

    Multi-head Latent Attention (DeepSeek-V2/V3, `mla_kv_rank` set; layers/mla.py): keys and
    values come from a per-token latent of `mla_kv_rank` numbers plus one shared rotary key of
    `mla_rope_dim`; queries from a rank-`mla_q_rank` latent (None: a plain projection). Then
    `head_dim` is the query/key width per head, `qk_nope_head_dim + qk_rope_head_dim` in HF's
    terms (its last `mla_rope_dim` dims are rotary, the rest not), the softmax scale is
    `head_dim**-0.5` (times YaRN's mscale^2), values are `mla_v_head_dim` wide (default: the
    non-rotary width), and the KV cache holds `mla_kv_rank + mla_rope_dim` numbers per token and
    layer. `mla_rope_interleave`: the rotary dims come in interleaved pairs (HF's
    `rope_interleave`, DeepSeek's checkpoints), not in halves.

    `bias` puts a bias on every linear layer (GPT-2); `qkv_bias` on the query, key and value
    projections alone (Qwen2). `qk_norm` RMS-normalises each query and key head over head_dim
    before the rotary embedding (Qwen3).

    `max_seq_len` bounds every sequence and KV cache (`check_length`), for learned and rotary
    positions alike: a longer context is asked for by raising it (with `rope_scaling` where the
    family has one).

    Attention pattern (Gemma 2/3): `layer_types` gives each layer "full" (sees every earlier
    token) or "sliding" (the last `sliding_window` tokens); None means every layer uses
    `sliding_window` (None: no window). `local_rope_theta` is the rotary theta of the sliding
    layers (without `rope_scaling`), where the family gives them their own. `attn_softcap` and
    `final_softcap` squash attention scores and logits to cap * tanh(x / cap) (Gemma 2);
    `query_scale` replaces head_dim in the 1/sqrt(head_dim) score scale (Gemma's
    query_pre_attn_scalar). `sandwich_norm` adds a norm on the attention and MLP outputs before
    each residual add; `embed_scale` multiplies the embeddings by sqrt(d_model); `norm_plus_one`
    makes every RMSNorm scale by (1 + scale), the checkpoints storing the offset from 1 (Gemma).
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
    tie_embeddings: bool = False
    bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    n_experts: int = 0
    n_experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_d_ff: int | None = None
    moe_every: int = 1
    first_dense_layers: int = 0
    router_scoring: RouterScoring = "softmax"
    router_normalize: bool = True
    router_scale: float = 1.0
    router_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: GroupScore = "top2"
    mla_kv_rank: int | None = None
    mla_q_rank: int | None = None
    mla_rope_dim: int = 64
    mla_v_head_dim: int | None = None
    mla_rope_interleave: bool = True
    sandwich_norm: bool = False
    embed_scale: bool = False
    norm_plus_one: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    layer_types: tuple[LayerType, ...] | None = None
    local_rope_theta: float | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), _FIELD_TYPES[field.name])
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
        if self.mla:
            self._check_mla()
        if self.position == "rope" and self.rotary_dim % 2 != 0:
            name = "mla_rope_dim" if self.mla else "head_dim"
            raise ValueError(f"Config.{name}={self.rotary_dim} must be even for rotary embeddings")
        if self.norm_eps <= 0:
            raise ValueError(f"Config.norm_eps must be > 0, got {self.norm_eps}")
        if self.bias and self.qkv_bias:
            raise ValueError(
                "Config.qkv_bias=True is implied by bias=True (a bias on every linear layer); "
                "set bias alone, or qkv_bias alone for biases on q, k and v only (Qwen2)"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"Config.sliding_window must be >= 1 or None, got {self.sliding_window}"
            )
        self._check_moe()
        self._check_pattern()

    def _check_pattern(self):
        for name in ["attn_softcap", "final_softcap", "query_scale", "local_rope_theta"]:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"Config.{name} must be > 0 or None, got {value}")
        if self.norm_plus_one and self.norm != "rmsnorm":
            raise ValueError(
                f"Config.norm_plus_one applies to RMSNorm only, but norm={self.norm!r}"
            )
        if self.layer_types is None:
            if self.local_rope_theta is not None:
                raise ValueError(
                    "Config.local_rope_theta is the theta of the sliding layers: set layer_types "
                    "too, or drop it"
                )
            return
        if len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"Config.layer_types has {len(self.layer_types)} entries but n_layers="
                f"{self.n_layers}: give one 'full' or 'sliding' per layer"
            )
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "Config.layer_types has 'sliding' layers but sliding_window is None: set the "
                "window those layers use"
            )
        if self.local_rope_theta is not None and self.position != "rope":
            raise ValueError("Config.local_rope_theta needs position='rope'")

    def _check_mla(self):
        why = "multi-head latent attention (mla_kv_rank set)"
        if self.mla_kv_rank < 1 or (self.mla_q_rank is not None and self.mla_q_rank < 1):
            raise ValueError(
                f"Config.mla_kv_rank={self.mla_kv_rank} must be >= 1 and mla_q_rank="
                f"{self.mla_q_rank} >= 1 or None"
            )
        if not 0 < self.mla_rope_dim < self.head_dim:
            raise ValueError(
                f"Config.mla_rope_dim={self.mla_rope_dim} must be in (0, head_dim={self.head_dim}) "
                "for MLA: head_dim is the query/key width, its last mla_rope_dim dims rotary"
            )
        if self.mla_v_head_dim is None:
            object.__setattr__(self, "mla_v_head_dim", self.head_dim - self.mla_rope_dim)
        if self.mla_v_head_dim < 1:
            raise ValueError(f"Config.mla_v_head_dim must be >= 1, got {self.mla_v_head_dim}")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"Config.n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads} with "
                f"{why}: every head's keys and values come from the one shared latent"
            )
        if self.position != "rope" or self.qk_norm or self.bias:
            raise ValueError(
                f"Config.position={self.position!r}, qk_norm={self.qk_norm}, bias={self.bias}: "
                f"{why} needs position='rope', qk_norm=False and bias=False"
            )
        gemma = [
            n for n in ("norm_plus_one", "attn_softcap", "query_scale", "local_rope_theta")
            if getattr(self, n) not in (None, False)
        ]  # fmt: skip
        if gemma:
            raise ValueError(
                f"Config.{', '.join(gemma)} with {why}: MLA has its own norms, scale and one "
                "rotary table; unset them"
            )

    def _check_moe(self):
        if self.n_experts < 0:
            raise ValueError(f"Config.n_experts must be >= 0 (0 = dense), got {self.n_experts}")
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
        if not self.router_scale > 0:
            raise ValueError(f"Config.router_scale must be > 0, got {self.router_scale}")
        if self.router_bias and self.router_scoring != "sigmoid":
            raise ValueError(
                "Config.router_bias (DeepSeek-V3's balancing bias) needs router_scoring='sigmoid'"
            )
        groups, topk = self.router_groups, self.router_topk_groups
        if groups < 1 or self.n_experts % groups or not 1 <= topk <= groups:
            raise ValueError(
                f"Config.router_groups={groups} must divide n_experts={self.n_experts} and "
                f"router_topk_groups={topk} be in [1, router_groups]"
            )
        per_group = self.n_experts // groups
        if groups > 1 and per_group < 2 and self.router_group_score == "top2":
            raise ValueError(
                f"Config.router_groups={groups} leaves {per_group} expert per group; a group's "
                "score is the sum of its two best experts, so each group needs >= 2"
            )
        if self.n_experts_per_token > topk * per_group:
            raise ValueError(
                f"Config.n_experts_per_token={self.n_experts_per_token} exceeds the "
                f"{topk * per_group} experts of the router_topk_groups={topk} groups kept"
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
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (layers/mla.py)."""
        return self.mla_kv_rank is not None

    @property
    def rotary_dim(self) -> int:
        """Dims of each query/key head that rotary embeddings turn: all of `head_dim`, or MLA's
        decoupled `mla_rope_dim`."""
        return self.mla_rope_dim if self.mla else self.head_dim

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

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: the layer sees every earlier token)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_layers
        return tuple(self.sliding_window if t == "sliding" else None for t in self.layer_types)

    @property
    def has_layer_pattern(self) -> bool:
        """Whether layers differ in window or rotary theta (so each layer gets its own as data
        under `lax.scan`: zoo/pattern.py)."""
        return len(set(self.layer_windows)) > 1 or self.local_rope_theta is not None

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (and re-checked). A `head_dim` or `n_kv_heads` that was
        derived (d_model // n_heads, or plain MHA) is derived again from the new sizes."""
        resized = "d_model" in changes or "n_heads" in changes
        if resized and "head_dim" not in changes and self.head_dim * self.n_heads == self.d_model:
            changes["head_dim"] = None
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        return dataclasses.replace(self, **changes)

    def check_length(self, length: int, what: str) -> None:
        """Refuse a sequence (or KV cache) longer than `max_seq_len`, for every position kind:
        learned positions have no row past it, and rotary ones were not trained past it."""
        if length > self.max_seq_len:
            fix = (
                "the learned position table has no row past it"
                if self.position == "learned"
                else "raise max_seq_len explicitly (with rope_scaling where the family has it) "
                "for a longer context"
            )
            raise ValueError(
                f"{what} ({length} tokens) exceeds Config.max_seq_len={self.max_seq_len}: {fix}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (`from_dict` reads them back)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @staticmethod
    def from_dict(fields: dict[str, Any], *, source: str = "config") -> "Config":
        """A Config from `to_dict`'s form (e.g. a checkpoint's JSON); unknown fields and values of
        the wrong type are errors naming the field and `source`."""
        if not isinstance(fields, dict):
            raise ValueError(f"{source}: a model config must be a JSON object, got {fields!r}")
        unknown = sorted(set(fields) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(
                f"{source}: unknown Config fields {unknown}; known: {list(_FIELD_TYPES)}"
            )
        fields = dict(fields)
        if isinstance(fields.get("layer_types"), list):
            fields["layer_types"] = tuple(fields["layer_types"])
        if isinstance(fields.get("rope_scaling"), dict):
            try:
                fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
            except TypeError as error:
                raise ValueError(f"{source}: bad Config.rope_scaling: {error}") from error
        try:
            return Config(**fields)
        except TypeError as error:
            raise ValueError(f"{source}: {error}") from error
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from error


_FIELD_TYPES = {field.name: field.type for field in dataclasses.fields(Config)}


def _check_type(name: str, value: Any, kind: Any) -> None:
    """A ValueError naming the field when `value` is not of the declared type (a JSON config or
    an --override can carry any value; bools are not ints here)."""
    origin, args = typing.get_origin(kind), get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        (kind,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(kind), get_args(kind)
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ValueError(f"Config.{name} must be a tuple, got {value!r}")
        for item in value:
            _check_type(name, item, args[0])
        return
    if origin is Literal:
        if value not in args:
            raise ValueError(f"Config.{name}={value!r} is unknown; choose one of {args}")
        return
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(
            f"Config.{name} must be {getattr(kind, '__name__', kind)}, got {value!r} "
            f"({type(value).__name__})"
        )
