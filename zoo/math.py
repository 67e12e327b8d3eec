"""Transformer math, the "predict" step: parameters, FLOPs, bytes, memory and rooflines.

Conventions (Kaplan et al. 2020; Chinchilla, Hoffmann et al. 2022; PaLM appendix B):
- a matmul with an [m, k] x [k, n] shape costs 2mkn FLOPs; backward costs twice the forward, so
  training costs 3x forward = 6 x (matmul parameters) per token, plus attention's score and
  value products, 4 x layers x seq x q_dim per token forward (half of that when causal
  masking skips the upper triangle; a sliding window of w < seq keys attends to w - w^2 / 2seq
  keys per token on average), plus 3 FLOPs per score for soft-capping (divide, tanh,
  multiply: Gemma 2);
- embedding lookups cost no FLOPs, the LM head is a matmul (tied or not);
- multi-head latent attention (DeepSeek-V2/V3) counts its low-rank projections, its latent norms
  and, in FLOPs, the expanded form (per-head keys of head_dim, values of mla_v_head_dim); its KV
  cache holds the latent (mla_kv_rank + mla_rope_dim numbers per token and layer), which
  `per_head_kv_cache_bytes_per_token` compares with per-head keys and values of the same heads;
- a sliding-window layer's KV cache holds its window, not the context (`kv_cache_bytes`);
- an int8 KV cache (`kv_dtype="int8"`, layers/kernels/paged/int8.py) holds one byte per number
  plus a bfloat16 scale per token and K/V head (MLA: per token); sliding layers' rings stay in
  the compute dtype;
- an MoE layer (Shazeer et al. 2017) holds all its experts' parameters but each token only
  multiplies by the router, its k routed experts and the shared ones: `param_count` counts all,
  `active_param_count` and the FLOPs count what one token uses. Capacity dispatch spends more
  (padding slots and one-hot einsums): `capacity_dispatch_flops_per_token`.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from layers.kernels.paged.int8 import SCALE_DTYPE as INT8_SCALE_DTYPE
from layers.moe import expert_capacity
from layers.quantized import Kind, check_cols, group_size
from zoo.config import Config
from zoo.policy import Policy

DEFAULT_POLICY = Policy()


def _norm_params(config: Config) -> int:
    return config.d_model * (2 if config.norm == "layernorm" and config.bias else 1)


def _mla_projection_params(config: Config) -> int:
    """MLA's weight matrices: q (low-rank or plain), kv_a (latent + rotary key), kv_b (per-head
    non-rotary keys and values), o."""
    c = config
    d, q_out, nope = c.d_model, c.q_dim, c.head_dim - c.mla_rope_dim
    q = d * q_out if c.mla_q_rank is None else c.mla_q_rank * (d + q_out)
    kv = d * (c.mla_kv_rank + c.mla_rope_dim) + c.mla_kv_rank * c.n_heads * (
        nope + c.mla_v_head_dim
    )
    return q + kv + c.n_heads * c.mla_v_head_dim * d


def _block_norms(config: Config) -> int:
    """Norms per block: before attention and MLP, and after each with sandwich norms."""
    return 4 if config.sandwich_norm else 2


def _attention_params(config: Config) -> int:
    c = config
    if c.mla:  # projections and the latent RMSNorm scales
        return _mla_projection_params(c) + c.mla_kv_rank + (c.mla_q_rank or 0)
    attn = c.d_model * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.d_model
    if c.bias:
        attn += c.q_dim + 2 * c.kv_dim + c.d_model
    elif c.qkv_bias:
        attn += c.q_dim + 2 * c.kv_dim
    if c.qk_norm:
        attn += 2 * c.head_dim
    return attn


def layer_params(config: Config) -> int:
    """Parameters of one dense transformer block."""
    c = config
    n_mats = 3 if c.mlp != "gelu" else 2
    mlp = n_mats * c.d_model * c.d_ff
    if c.bias:
        mlp += (n_mats - 1) * c.d_ff + c.d_model
    return _attention_params(c) + mlp + _block_norms(c) * _norm_params(c)


def _moe_mlp_params(config: Config, n_routed: int) -> int:
    """Router (with its balancing bias, if any), `n_routed` SwiGLU experts and the shared
    experts (no biases)."""
    c = config
    experts = (n_routed + c.n_shared_experts) * 3 * c.d_model * c.expert_d_ff
    router = c.d_model * c.n_experts + (c.n_experts if c.router_bias else 0)
    return router + experts


def moe_layer_params(config: Config) -> int:
    """Parameters of one MoE block: attention, norms, router, every expert."""
    c = config
    return (
        _attention_params(c) + _moe_mlp_params(c, c.n_experts) + _block_norms(c) * _norm_params(c)
    )


def moe_layer_active_params(config: Config) -> int:
    """Parameters of one MoE block that one token uses: only k of the routed experts."""
    c = config
    mlp = _moe_mlp_params(c, c.n_experts_per_token)
    return _attention_params(c) + mlp + _block_norms(c) * _norm_params(c)


def embedding_params(config: Config) -> int:
    """Token table, learned position table and (untied) LM head."""
    c = config
    n = c.vocab_size * c.d_model
    if c.position == "learned":
        n += c.max_seq_len * c.d_model
    if not c.tie_embeddings:
        n += c.d_model * c.vocab_size
    return n


def param_count(config: Config) -> int:
    """Exact number of parameters of `Transformer(config)` (every expert included)."""
    n_moe = len(config.moe_layers)
    blocks = (config.n_layers - n_moe) * layer_params(config)
    if n_moe:
        blocks += n_moe * moe_layer_params(config)
    return embedding_params(config) + blocks + _norm_params(config)


def active_param_count(config: Config) -> int:
    """Parameters one token touches (Mixtral's "active parameters"): as `param_count` with each
    MoE layer's routed experts cut to the k chosen; equal to `param_count` for a dense model."""
    n_moe = len(config.moe_layers)
    if not n_moe:
        return param_count(config)
    moe_saving = moe_layer_params(config) - moe_layer_active_params(config)
    return param_count(config) - n_moe * moe_saving


def lora_param_count(config: Config, targets: str | list[str] | tuple[str, ...], rank: int) -> int:
    """Parameters of `zoo.add_lora(model, targets, rank, ...)`: rank x (in + out) per wrapped
    projection and layer (attention targets in every layer, MLP targets in the dense ones: an
    MoE layer holds no Linear MLP). What a LoRA step trains and keeps AdamW moments for; the
    base weights stay frozen. Target names as add_lora takes them (zoo/adapter.py); unknown
    names are an error there."""
    from zoo.adapter import TARGETS  # zoo.adapter builds models; math only needs its names
    from zoo.stack import segments

    c = config
    names = [targets] if isinstance(targets, str) else list(targets)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; known names: {sorted(TARGETS)}")
    paths = {p for n in names for p in TARGETS[n]}
    sizes = {
        "attn.q_proj": (c.d_model, c.q_dim),
        "attn.k_proj": (c.d_model, c.kv_dim),
        "attn.v_proj": (c.d_model, c.kv_dim),
        "attn.o_proj": (c.q_dim, c.d_model),
        "mlp.gate": (c.d_model, c.d_ff) if c.mlp != "gelu" else (0, 0),
        "mlp.up": (c.d_model, c.d_ff),
        "mlp.down": (c.d_ff, c.d_model),
    }
    dense = sum(repeats * period.count(False) for _, period, repeats in segments(c))
    total = 0
    for path in paths:
        layers = dense if path.startswith("mlp.") else c.n_layers
        total += layers * rank * sum(sizes[path])
    return total


def matmul_params(config: Config) -> int:
    """Parameters that take part in a matmul per token: every block's projections and the LM head
    (tied or not). Norm scales, biases and lookups are left out: their FLOPs are negligible."""
    c = config
    attn = (
        _mla_projection_params(c)
        if c.mla
        else c.d_model * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.d_model
    )
    n_moe = len(c.moe_layers)
    dense_mlp = (3 if c.mlp != "gelu" else 2) * c.d_model * c.d_ff
    mlps = (c.n_layers - n_moe) * dense_mlp
    if n_moe:
        mlps += n_moe * _moe_mlp_params(c, c.n_experts_per_token)
    return c.n_layers * attn + mlps + c.d_model * c.vocab_size


def _attended_keys(seq_len: int, window: int | None, causal: bool) -> float:
    """Keys a query sees on average: seq/2 causal (the convention above), w - w^2 / 2seq under a
    causal window w < seq (min(i + 1, w) averaged, continuous form), seq otherwise."""
    if not causal:
        return float(seq_len)
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops_per_token(config: Config, seq_len: int, *, causal: bool = True) -> float | int:
    """Forward FLOPs per token of QK^T and PV (2 x (q_dim + v_dim) per attended key; MLA's values
    are `mla_v_head_dim` wide), each layer with its own window, plus soft-capping's 3 FLOPs per
    score (per head and key)."""
    c = config
    v_dim = c.n_heads * c.mla_v_head_dim if c.mla else c.q_dim
    per_key = 2.0 * (c.q_dim + v_dim) + (3.0 * c.n_heads if c.attn_softcap is not None else 0.0)
    return sum(per_key * _attended_keys(seq_len, w, causal) for w in c.layer_windows)


def forward_flops_per_token(config: Config, seq_len: int, *, causal: bool = True) -> float | int:
    return 2.0 * matmul_params(config) + attention_flops_per_token(config, seq_len, causal=causal)


def capacity_dispatch_flops_per_token(
    config: Config, seq_len: int, capacity_factor: float
) -> float | int:
    """Extra forward FLOPs per token of capacity dispatch over the model FLOPs: the experts also
    run on the empty slots (experts x capacity slots instead of k per token) and the dispatch
    and combine einsums cost 2 x experts x capacity x d_model each per token."""
    c = config
    n_moe = len(c.moe_layers)
    if not n_moe:
        return 0
    capacity = expert_capacity(seq_len, c.n_experts_per_token, c.n_experts, capacity_factor)
    slots_per_token = c.n_experts * capacity / seq_len
    padding = (slots_per_token - c.n_experts_per_token) * 2 * 3 * c.d_model * c.expert_d_ff
    einsums = 2 * 2 * c.n_experts * capacity * c.d_model
    return n_moe * (padding + einsums)


def training_flops_per_token(
    config: Config, seq_len: int, *, causal: bool = True, weight_grads: bool = True
) -> float | int:
    """6N + attention: forward plus a backward of twice its cost (no remat recompute counted:
    this is the model FLOPs of MFU, not the hardware FLOPs). `weight_grads=False` (a frozen
    base under LoRA): the backward computes only the activations' gradients, 4N + attention
    (the adapters' own FLOPs, rank x (in + out) per projection, are negligible)."""
    if weight_grads:
        return 3.0 * forward_flops_per_token(config, seq_len, causal=causal)
    return 4.0 * matmul_params(config) + 3.0 * attention_flops_per_token(
        config, seq_len, causal=causal
    )


def bytes_per_element(dtype: str | jnp.dtype) -> int:
    return jnp.dtype(dtype).itemsize


def weight_bytes(config: Config, policy: Policy = DEFAULT_POLICY) -> int:
    """The weights, stored in the policy's `param_dtype`."""
    return param_count(config) * bytes_per_element(policy.param_dtype)


def _attention_matrices(config: Config) -> list[tuple[int, int]]:
    """(rows, cols) = (outputs, inputs) of one layer's attention projections that `zoo.quantize`
    packs: q, k, v, o, or MLA's q (or q_a, q_b), kv_a and o (kv_b stays float)."""
    c = config
    if not c.mla:
        return [(c.q_dim, c.d_model), (c.kv_dim, c.d_model), (c.kv_dim, c.d_model),
                (c.d_model, c.q_dim)]  # fmt: skip
    q = [(c.q_dim, c.d_model)]
    if c.mla_q_rank is not None:
        q = [(c.mla_q_rank, c.d_model), (c.q_dim, c.mla_q_rank)]
    return [
        *q,
        (c.mla_kv_rank + c.mla_rope_dim, c.d_model),
        (c.d_model, c.n_heads * c.mla_v_head_dim),
    ]


def _swiglu_matrices(config: Config, width: int, n_up: int = 2) -> list[tuple[int, int]]:
    return [(width, config.d_model)] * n_up + [(config.d_model, width)]


def quantized_matrices(config: Config) -> dict[str, list[tuple[int, int]]]:
    """Every weight matrix `zoo.quantize` packs, as (rows, cols) = (outputs, inputs), by what
    it is: "projections" (attention, dense MLPs, shared experts, over all layers), "experts"
    (each routed expert's three matrices) and "embeddings" (the token table, and the LM head
    when untied)."""
    c = config
    n_moe = len(c.moe_layers)
    projections = _attention_matrices(c) * c.n_layers
    projections += _swiglu_matrices(c, c.d_ff, 2 if c.mlp != "gelu" else 1) * (c.n_layers - n_moe)
    experts = []
    if n_moe:
        if c.n_shared_experts:
            projections += _swiglu_matrices(c, c.n_shared_experts * c.expert_d_ff) * n_moe
        experts = _swiglu_matrices(c, c.expert_d_ff) * c.n_experts * n_moe
    embeddings = [(c.vocab_size, c.d_model)] * (1 if c.tie_embeddings else 2)
    return {"projections": projections, "experts": experts, "embeddings": embeddings}


def packed_bytes(rows: int, cols: int, kind: Kind, group: int | None = None) -> int:
    """Bytes of a `[rows, cols]` matrix packed as `kind` by `layers.quantized.pack`: its codes
    (int8: 1 byte per weight; int4, nf4: 1/2) and 4 bytes per group of `group` weights (int8,
    nf4: a float32 scale; int4: a float16 scale and minimum)."""
    group = group_size(kind, group, cols)
    check_cols(cols, group, what=f"a {rows} x {cols} matrix ({kind})")
    codes = rows * cols if kind == "int8" else rows * cols // 2
    return codes + 4 * rows * (cols // group)


def quantized_weight_bytes(
    config: Config,
    kind: Kind | None,
    policy: Policy = DEFAULT_POLICY,
    *,
    group: int | None = None,
    embeddings: Kind | None = "int8",
    experts: bool = True,
) -> int:
    """The weights of `zoo.quantize(model, kind, group=group, embeddings=embeddings)`: the packed
    matrices (`packed_bytes`), everything else in the policy's `param_dtype`; with
    `experts=False` the experts stay float too. `kind=None` is the float model."""
    if kind is None:
        return weight_bytes(config, policy)
    matrices = quantized_matrices(config)
    packed = [(m, kind, group) for m in matrices["projections"]]
    packed += [(m, kind, group) for m in matrices["experts"]] if experts else []
    if embeddings is not None:
        packed += [(m, embeddings, None) for m in matrices["embeddings"]]
    float_params = param_count(config) - sum(rows * cols for (rows, cols), _, _ in packed)
    n_bytes = sum(packed_bytes(rows, cols, k, g) for (rows, cols), k, g in packed)
    return float_params * bytes_per_element(policy.param_dtype) + n_bytes


def frozen_base_bytes(
    config: Config, kind: Kind | None, policy: Policy = DEFAULT_POLICY, *, block: int = 64
) -> int:
    """The weights of `zoo.quantize_base(model, kind, block=block)` (QLoRA's frozen base): the
    projections packed (int8 per output channel, 4-bit kinds in groups of `block`), embeddings,
    LM head and experts float. What a LoRA adapter trains on top of (the adapter and its
    optimizer state come on top); `kind=None` is the float model."""
    group = None if kind == "int8" else block
    return quantized_weight_bytes(config, kind, policy, group=group, embeddings=None, experts=False)


def _layer_kv_bytes_per_token(config: Config, dtype: str | jnp.dtype) -> int:
    """One layer's cache for one token: keys and values (MLA: the latent) in `dtype`; int8
    adds a scale per token and K/V head (MLA: one latent head)."""
    c = config
    width = c.mla_kv_rank + c.mla_rope_dim if c.mla else 2 * c.kv_dim
    if jnp.dtype(dtype) != jnp.int8:
        return width * bytes_per_element(dtype)
    heads = 1 if c.mla else 2 * c.n_kv_heads
    return width + heads * bytes_per_element(INT8_SCALE_DTYPE)


def kv_cache_bytes_per_token(
    config: Config, policy: Policy = DEFAULT_POLICY, *, kv_dtype: str | None = None
) -> int:
    """Keys and values of every layer for one token, in `kv_dtype` (None: the compute dtype;
    "int8" with its scales); for MLA the latent (`mla_kv_rank + mla_rope_dim` numbers per
    layer), what its cache holds."""
    dtype = kv_dtype or policy.compute_dtype
    return config.n_layers * _layer_kv_bytes_per_token(config, dtype)


def kv_cache_bytes(
    config: Config, context: int, policy: Policy = DEFAULT_POLICY, *, kv_dtype: str | None = None
) -> int:
    """One row's KV cache at `context` tokens: a layer whose sliding window is shorter keeps
    only its window (layers/window_cache.py, a ring in the compute dtype), every other layer
    all `context` tokens in its pages (`kv_dtype`, as `kv_cache_bytes_per_token`). What a
    decode step reads per row."""
    paged = _layer_kv_bytes_per_token(config, kv_dtype or policy.compute_dtype)
    ring = _layer_kv_bytes_per_token(config, policy.compute_dtype)
    return sum(
        context * paged if w is None or w >= context else w * ring for w in config.layer_windows
    )


def per_head_kv_cache_bytes_per_token(config: Config, policy: Policy = DEFAULT_POLICY) -> int:
    """What per-head keys and values of the same heads would take per token (MHA with MLA's
    head widths: keys of head_dim, values of mla_v_head_dim); `kv_cache_bytes_per_token` for
    any other attention."""
    c = config
    if not c.mla:
        return kv_cache_bytes_per_token(c, policy)
    width = c.n_heads * (c.head_dim + c.mla_v_head_dim)
    return c.n_layers * width * bytes_per_element(policy.compute_dtype)


def decode_step_bytes(
    config: Config,
    batch: int,
    context: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    kv_dtype: str | None = None,
    weights: int | None = None,
) -> int:
    """Fewest bytes one decode step must read: all weights once (`weights` bytes as the model
    holds them, e.g. a packed model's; None: `weight_bytes` in the policy's dtype) plus each
    row's KV cache (`kv_cache_bytes`: sliding layers only their window; pages in `kv_dtype`)."""
    kv = kv_cache_bytes(config, context, policy, kv_dtype=kv_dtype)
    return (weight_bytes(config, policy) if weights is None else weights) + batch * kv


def _mlp_width_per_token(config: Config) -> float:
    """Average hidden width of the MLP a token passes through (MoE: its experts, k routed plus the
    shared ones), over the layers."""
    c = config
    n_moe = len(c.moe_layers)
    moe_width = (c.n_experts_per_token + c.n_shared_experts) * c.expert_d_ff
    return ((c.n_layers - n_moe) * c.d_ff + n_moe * moe_width) / c.n_layers


def activation_bytes_per_token(
    config: Config, seq_len: int, policy: Policy = DEFAULT_POLICY
) -> float | int:
    """Activation memory kept for backward, per token: the tensors each block saves, counted from
    the block itself (in the spirit of Korthikanti et al. 2022, eq. 2, without dropout masks).

    - "none": both norms' inputs and outputs (4 d), rotated q, k and v and the attention output
      (2 q_dim + 2 kv_dim), the MLP's hidden tensors (SwiGLU: gate, up, silu(gate), product; GELU:
      pre- and post-activation) and, for the naive and xla kernels, the float32 scores and
      probabilities (8 heads x seq bytes); flash and cudnn keep only a float32 log-sum-exp per head.
    (The policy's `remat`, compute dtype and kernel decide which.)
    - "dots": each layer's input and the outputs of its weight matmuls (q, k, v, attention output
      projection, the MLP's up/gate and down), plus flash's output and log-sum-exp (the policy
      keeps them); scores are recomputed.
    - "full": each layer's input only.
    """
    c, remat = config, policy.remat
    e = bytes_per_element(policy.compute_dtype)
    ff = _mlp_width_per_token(c)
    flash = policy.kernel_name in ("flash", "cudnn")  # fused kernels: no score matrices kept
    lse = 4 * c.n_heads if flash else 0
    if remat == "full":
        per_layer = e * c.d_model
    elif remat == "dots":
        up = 2 * ff if c.mlp != "gelu" else ff
        saved = 3 * c.d_model + c.q_dim + 2 * c.kv_dim + up + (c.q_dim if flash else 0)
        per_layer = e * saved + lse
    else:
        hidden = 4 * ff if c.mlp != "gelu" else 2 * ff
        scores = 0 if flash else 8 * c.n_heads * seq_len
        per_layer = e * (4 * c.d_model + 2 * c.q_dim + 2 * c.kv_dim + hidden) + scores + lse
    return c.n_layers * per_layer


def training_memory_bytes(
    config: Config,
    batch: int,
    seq_len: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    trainable: int | None = None,
    frozen_bytes: int | None = None,
) -> float | int:
    """Parameters + gradients + AdamW moments (float32 master copies) + saved activations + the
    backward's working set (one layer's full activations, recomputed or not, live at once) +
    float32 logits and their gradient.

    LoRA: only `trainable` parameters (the float32 adapters, `lora_param_count`) have gradients
    and moments; the frozen base takes `frozen_bytes` (`frozen_base_bytes`; default its
    `param_dtype` weights). Default: every parameter trains."""
    if trainable is None:
        state = param_count(config) * (bytes_per_element(policy.param_dtype) + 4 + 8)
    else:
        frozen = weight_bytes(config, policy) if frozen_bytes is None else frozen_bytes
        state = frozen + trainable * (4 + 4 + 8)
    tokens = batch * seq_len
    saved = activation_bytes_per_token(config, seq_len, policy)
    one_layer = activation_bytes_per_token(config, seq_len, policy.replace(remat="none"))
    one_layer /= config.n_layers
    logits = tokens * config.vocab_size * 4 * 2
    return state + tokens * (saved + one_layer) + logits


def pipeline_bubble(stages: int, microbatches: int, *, virtual: int = 1) -> float:
    """The fraction of a pipelined step each stage idles. GPipe (Huang et al. 2019): the forward
    takes M + S - 1 ticks of which a stage works M, and the backward mirrors it, so
    (S - 1) / (M + S - 1) (0 for one stage). 1F1B (PipeDream-flush) idles as long: its
    warm-up and cool-down are GPipe's fill and drain. Interleaved with V chunks per device
    (Narayanan et al. 2021): M V + S - 1 ticks of a chunk, 1 / V of a stage's work each, so
    (S - 1) / (M V + S - 1)."""
    if stages < 1 or microbatches < stages or virtual < 1:
        raise ValueError(
            f"a pipeline needs stages >= 1, micro-batches >= stages and virtual stages >= 1, got "
            f"{stages} stages, {microbatches} micro-batches and {virtual} virtual stages"
        )
    return (stages - 1) / (microbatches * virtual + stages - 1)


def pipeline_activation_bytes(
    config: Config,
    seq_len: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    tokens: int,
    stages: int,
    microbatches: int,
    schedule: str = "gpipe",
    virtual: int = 1,
) -> float | int:
    """Activation bytes one pipeline stage keeps at its peak, for `tokens` tokens per step
    (the device's slice of the batch) and its n_layers / stages layers (shard/pipeline.py).

    - GPipe runs every micro-batch's forward before the first backward: a scan over M + S - 1
      ticks that saves, at every tick (the S - 1 idle ones too), what `policy.remat` keeps in
      the stage's layers for one micro-batch (`activation_bytes_per_token`): (M + S - 1) / M
      times the tokens' share.
    - Interleaved: M V + S - 1 ticks of a chunk of 1 / V of the stage's layers, each keeping
      only its input (d_model values per token; the chunk is run again in the backward, since
      keeping what it saves would keep its weights per tick too), plus one chunk's activations
      for one micro-batch, all of them (no per-layer remat inside), while it is.
    - 1F1B: the stage inputs of the micro-batches in flight (min(M, 2 S - 1), d_model values per
      token each) plus one micro-batch's stage activations, all of them, while its backward
      recomputes it.
    1F1B and interleaved thus cost one more forward per micro-batch than GPipe without remat
    (as much as GPipe with `remat="full"`).
    One stage (no pipeline) gives `tokens * activation_bytes_per_token`."""
    if config.n_layers % stages:
        raise ValueError(
            f"pipeline size {stages} does not divide the {config.n_layers} layers; give a "
            "divisor of the layer count"
        )
    pipeline_bubble(stages, microbatches, virtual=virtual)
    stage_share = activation_bytes_per_token(config, seq_len, policy) / stages
    micro, inputs = tokens / microbatches, config.d_model * bytes_per_element(policy.compute_dtype)
    whole = activation_bytes_per_token(config, seq_len, policy.replace(remat="none")) / stages
    if schedule == "1f1b":
        return micro * (min(microbatches, 2 * stages - 1) * inputs + whole)
    if schedule == "interleaved":
        return micro * ((microbatches * virtual + stages - 1) * inputs + whole / virtual)
    if schedule != "gpipe":
        raise ValueError(f"unknown pipeline schedule {schedule!r}: gpipe, 1f1b or interleaved")
    return micro * (microbatches + stages - 1) * stage_share


def speculative_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens one verification of `k` drafts emits when each draft is kept with
    probability `acceptance`, independently (Leviathan et al. 2023, eq. 1): the kept run plus
    the target's own token, `(1 - a^(k+1)) / (1 - a)` (k + 1 when every draft is kept)."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speculative_speedup(
    acceptance: float, k: int, *, verify_cost: float, draft_cost: float = 0.0
) -> float:
    """Expected speedup of speculative decoding over one-token decoding (Leviathan et al. 2023,
    Theorem 3.8, with the verification's own cost): tokens per step over the step's cost, in
    units of a one-token target step: `verify_cost` for the target's `k + 1`-token group (about
    1 while decode reads the weights, not the FLOPs, as the bound: `decode_step_bytes`),
    `draft_cost` per proposed token (0 for prompt lookup, a draft model's step otherwise)."""
    return speculative_tokens_per_step(acceptance, k) / (verify_cost + k * draft_cost)


def speculative_acceptance_needed(
    speedup: float, k: int, *, verify_cost: float, draft_cost: float = 0.0
) -> float | None:
    """The acceptance rate at which `speculative_speedup` reaches `speedup` (tokens per step
    grow with the rate, so it is found by bisection to 1e-6); None when even a draft that is
    always kept falls short (`k + 1` tokens for the step's cost)."""
    if speculative_speedup(1.0, k, verify_cost=verify_cost, draft_cost=draft_cost) < speedup:
        return None
    low, high = 0.0, 1.0
    while high - low > 1e-6:
        middle = (low + high) / 2
        gain = speculative_speedup(middle, k, verify_cost=verify_cost, draft_cost=draft_cost)
        low, high = (middle, high) if gain < speedup else (low, middle)
    return high


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """Peak dense matmul rate per dtype (FLOP/s), memory bandwidth (bytes/s), for chips built
    to be linked the interconnect bandwidth per device (bytes/s, NVLink / ICI), and the device
    memory (bytes) where the chip comes in one size."""

    name: str
    flops: dict[str, float]
    bandwidth: float
    interconnect: float | None = None
    memory: int | None = None

    def peak_flops(self, dtype: str) -> float | int:
        if dtype not in self.flops:
            raise ValueError(
                f"{self.name} has no peak listed for {dtype}; known: {list(self.flops)}"
            )
        return self.flops[dtype]


# Datasheet dense (no sparsity) peaks. fp32 on NVIDIA is the non-tensor-core rate. Interconnect:
# NVLink per GPU one way (900 / 600 GB/s both ways), TPU ICI per chip (2400/1600/4800 Gbps).
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="NVIDIA H100 SXM",
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        bandwidth=3.35e12,
        interconnect=450e9,
    ),
    "h200": Hardware(
        name="NVIDIA H200",
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        bandwidth=4.8e12,
        interconnect=450e9,
    ),
    "a100": Hardware(
        name="NVIDIA A100 80GB",
        flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        bandwidth=2.039e12,
        interconnect=300e9,
    ),
    "tpu-v4": Hardware(
        name="TPU v4",
        flops={"bfloat16": 275e12, "float32": 275e12 / 4},
        bandwidth=1.2e12,
        interconnect=300e9,
    ),
    "tpu-v5e": Hardware(
        name="TPU v5e",
        flops={"bfloat16": 197e12, "float32": 197e12 / 4},
        bandwidth=0.819e12,
        interconnect=200e9,
    ),
    "tpu-v5p": Hardware(
        name="TPU v5p",
        flops={"bfloat16": 459e12, "float32": 459e12 / 4},
        bandwidth=2.765e12,
        interconnect=600e9,
    ),
}


# Devices by the name a plan's verdict takes (`--device`): the chips above with their memory
# (datasheet GiB; HBM stacks come in binary sizes).
GiB = 2**30
DEVICES: dict[str, Hardware] = {
    "h100-80gb": dataclasses.replace(
        HARDWARE["h100"], name="NVIDIA H100 SXM 80GB", memory=80 * GiB
    ),
    "h200-141gb": dataclasses.replace(HARDWARE["h200"], name="NVIDIA H200 141GB", memory=141 * GiB),
    "a100-80gb": dataclasses.replace(HARDWARE["a100"], memory=80 * GiB),
    "a100-40gb": dataclasses.replace(
        HARDWARE["a100"], name="NVIDIA A100 40GB", bandwidth=1.555e12, memory=40 * GiB
    ),
    "tpu-v4-32gb": dataclasses.replace(HARDWARE["tpu-v4"], memory=32 * GiB),
    "tpu-v5e-16gb": dataclasses.replace(HARDWARE["tpu-v5e"], memory=16 * GiB),
    "tpu-v5p-95gb": dataclasses.replace(HARDWARE["tpu-v5p"], memory=95 * GiB),
}


def fastest_seconds(fn, *args, repeats: int = 5) -> float | int:
    """The fastest of `repeats` timed calls after one that compiles. A ceiling is what the
    machine can do: on a shared host the other jobs only ever slow a run, so the fastest run
    is the estimate that moves least between processes (STREAM reports its best too)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul_flops(dtype: str = "float32", n: int = 2048) -> float | int:
    """Achieved FLOP/s of one large square matmul of random numbers on the default device
    (its fastest run).

    Random, not constant, operands: a GPU's tensor cores draw less power on constant bits and
    clock higher, so `jnp.ones` overstates the rate a model's matmuls can reach."""
    a, b = (
        jax.random.normal(k, (n, n), jnp.float32).astype(dtype)
        for k in jax.random.split(jax.random.key(0))
    )
    return 2 * n**3 / fastest_seconds(jax.jit(jnp.matmul), a, b)


def measure_copy_bandwidth(n_bytes: int = 256 * 2**20) -> float | int:
    """Achieved bytes/s of a large device copy (bytes read + bytes written; its fastest run)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    return 2 * n_bytes / fastest_seconds(jax.jit(lambda a: a * 1.0000001), x)


def measure_this_machine(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> Hardware:
    """Ceilings of the machine we run on, measured now (for CPUs, which have no datasheet row)."""
    device = jax.devices()[0]
    return Hardware(
        name=f"measured {device.platform} ({device.device_kind})",
        flops={d: measure_matmul_flops(d) for d in dtypes},
        bandwidth=measure_copy_bandwidth(),
    )


def datasheet_hardware() -> Hardware | None:
    """The datasheet row for the default device if it is a known accelerator, else None."""
    kind = jax.devices()[0].device_kind.lower()
    for key, hw in HARDWARE.items():
        if key.replace("tpu-", "tpu ") in kind or key in kind.replace(" ", ""):
            return hw
    return None


def detect_hardware() -> Hardware:
    """The datasheet row for a known accelerator, else this machine measured."""
    return datasheet_hardware() or measure_this_machine()


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Time a step needs at peak compute and at peak bandwidth; the larger one binds."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float | int:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOPs per byte."""
        return self.flops / max(self.bytes, 1)


def roofline(
    flops: float | int, n_bytes: float | int, hardware: Hardware, dtype: str = "bfloat16"
) -> Roofline:
    flops, n_bytes = float(flops), float(n_bytes)
    return Roofline(
        flops, n_bytes, flops / hardware.peak_flops(dtype), n_bytes / hardware.bandwidth
    )


def training_step_roofline(
    config: Config, batch: int, seq_len: int, hardware: Hardware, policy: Policy = DEFAULT_POLICY
) -> Roofline:
    """One optimizer step on `batch x seq_len` tokens: model FLOPs vs reading weights, gradients
    and optimizer state (a lower bound on bytes)."""
    flops = training_flops_per_token(config, seq_len) * batch * seq_len
    n = param_count(config)
    n_bytes = n * (3 * bytes_per_element(policy.param_dtype) + 2 * 8)
    return roofline(flops, n_bytes, hardware, policy.compute_dtype)


def decode_step_roofline(
    config: Config,
    batch: int,
    context: int,
    hardware: Hardware,
    policy: Policy = DEFAULT_POLICY,
    *,
    weights: int | None = None,
) -> Roofline:
    """One decode step for `batch` rows with `context` cached tokens each (`weights`: the
    weights' bytes as held, `decode_step_bytes`)."""
    flops = batch * forward_flops_per_token(config, 2 * context, causal=True)
    n_bytes = decode_step_bytes(config, batch, context, policy, weights=weights)
    return roofline(flops, n_bytes, hardware, policy.compute_dtype)


@dataclasses.dataclass(frozen=True)
class ContextAttentionCost:
    """One attention layer's training cost (forward + backward) per device under context
    parallelism: `flops` computed, `bytes_moved` received over the context axis, `held_bytes`
    the K/V (and score block) a device holds at once. Time: the ring overlaps each hop with
    the previous block's compute (time = max of the two); the all-gather variant waits for its
    collective (time = the sum)."""

    kernel: str
    flops: float
    bytes_moved: float
    held_bytes: float

    def seconds(self, peak_flops: float, link_bandwidth: float) -> float:
        compute, comm = self.flops / peak_flops, self.bytes_moved / link_bandwidth
        return max(compute, comm) if self.kernel == "ring" else compute + comm


def context_attention_costs(
    config: Config, policy: Policy, *, batch: int, seq: int, context: int
) -> tuple[ContextAttentionCost, ContextAttentionCost]:
    """(ring, allgather) costs of one layer's attention for `batch` sequences of `seq` tokens on
    each group of `context` devices that splits them (layers/kernels/context.py).

    The sequence is cut into 2n chunks of c = seq / 2n tokens (zig-zag), a chunk pair costs
    P = 2 x batch x heads x head_dim x c^2 FLOPs per matmul. Ring: 2n + 1 visible chunk pairs
    per device (3 at its own block, 2 at each of the n - 1 others), 2 matmuls forward and 5
    backward (scores recomputed, dV, dP, dQ, dK); K/V hop n - 1 times forward and again
    backward, the float32 dK/dV accumulators n times. All-gather: the dense score block of its
    2c queries against all 2nc keys (4n chunk pairs), 2 matmuls forward and 4 backward; K/V
    gathered ((n - 1) blocks received) and dK/dV reduce-scattered ((n - 1) blocks sent)."""
    c = config
    n, item = context, bytes_per_element(policy.compute_dtype)
    chunk = seq / (2 * n)
    pair = 2.0 * batch * c.n_heads * c.head_dim * chunk**2
    kv_block = 2.0 * batch * (seq / n) * c.n_kv_heads * c.head_dim  # K and V elements
    mask_block = 2.0 * batch * (seq / n) * 4  # int32 positions and segment ids
    scores = batch * c.n_heads * 4.0  # float32 score elements per query x key
    ring = ContextAttentionCost(
        kernel="ring",
        flops=(2 * n + 1) * 7 * pair,
        bytes_moved=(n - 1) * 2 * (kv_block * item + mask_block) + n * kv_block * 4,
        held_bytes=2 * kv_block * item + scores * chunk**2,
    )
    gather = ContextAttentionCost(
        kernel="allgather",
        flops=4 * n * 6 * pair,
        bytes_moved=(n - 1) * (kv_block * item + mask_block + kv_block * item),
        held_bytes=n * kv_block * item + scores * (seq / n) * seq,
    )
    return ring, gather


def cheaper_context_kernel(
    config: Config, policy: Policy, *, batch: int, seq: int, context: int, hardware: Hardware
) -> str:
    """ "ring" or "allgather": the one `context_attention_costs` predicts faster on `hardware`
    (its peak for the compute dtype and its interconnect; memory bandwidth without one)."""
    peak = hardware.peak_flops(policy.compute_dtype)
    link = hardware.interconnect or hardware.bandwidth
    costs = context_attention_costs(config, policy, batch=batch, seq=seq, context=context)
    return min(costs, key=lambda cost: cost.seconds(peak, link)).kernel
