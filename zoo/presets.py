"""Named configs of published models (sizes from their papers and HF config.json files) and tiny
ones for tests. `preset(name)` returns a Config; `presets()` lists the names."""

from layers.rotary import RopeScaling
from zoo.config import Config


def _gpt2(n_layers: int, d_model: int, n_heads: int) -> Config:
    return Config(
        vocab_size=50257,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        max_seq_len=1024,
        norm="layernorm",
        norm_eps=1e-5,
        position="learned",
        mlp="gelu",
        tie_embeddings=True,
        bias=True,
    )


def _llama3(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    d_ff: int,
    tie: bool,
    rope_factor: float,
    head_dim: int | None = None,
) -> Config:
    return Config(
        vocab_size=128256,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=head_dim,
        d_ff=d_ff,
        max_seq_len=131072,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=rope_factor),
        tie_embeddings=tie,
    )


def _qwen(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    d_ff: int,
    tie: bool,
    vocab_size: int = 151936,
    max_seq_len: int = 32768,
    **family,
) -> Config:
    """Qwen2.5 (q/k/v biases: `qkv_bias=True`) and Qwen3 (`qk_norm=True`, head_dim 128): rope
    theta 1e6, RMSNorm eps 1e-6, no sliding window."""
    return Config(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_embeddings=tie,
        **family,
    )


def _deepseek_yarn(mscale: float) -> RopeScaling:
    """DeepSeek-V2/V3's YaRN: 4K trained context stretched 40x to 160K."""
    return RopeScaling(
        kind="yarn", factor=40.0, original_max_seq_len=4096, mscale=mscale, mscale_all_dim=mscale
    )


def _gemma2(*, d_model: int, n_layers: int, n_heads: int, d_ff: int) -> Config:
    """Gemma 2 (Gemma Team 2024): local (4096-token window) and global layers alternate, scores
    and logits soft-capped at 50 and 30, GeGLU, sandwich norms, head_dim 256."""
    return Config(
        vocab_size=256000,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads // 2,
        head_dim=256,
        d_ff=d_ff,
        max_seq_len=8192,
        norm_eps=1e-6,
        norm_plus_one=True,
        mlp="geglu",
        tie_embeddings=True,
        sandwich_norm=True,
        embed_scale=True,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=4096,
        layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers)),
    )


def _gemma3(
    *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int,
    window: int, max_seq_len: int, rope_scaling: RopeScaling | None,
) -> Config:  # fmt: skip
    """Gemma 3 text (Gemma Team 2025): five local layers then one global (the pattern runs on
    past the last global layer), QK-norm instead of soft-capping, local rope theta 10k and
    global 1M, head_dim 256."""
    return Config(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=256,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        norm_plus_one=True,
        rope_theta=1_000_000.0,
        rope_scaling=rope_scaling,
        mlp="geglu",
        tie_embeddings=True,
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=True,
        sliding_window=window,
        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers)),
        local_rope_theta=10_000.0,
    )


_TINY_LLAMA = Config(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128
)

_PRESETS: dict[str, Config] = {
    "gpt2-124m": _gpt2(12, 768, 12),
    "gpt2-355m": _gpt2(24, 1024, 16),
    "gpt2-774m": _gpt2(36, 1280, 20),
    "gpt2-1.5b": _gpt2(48, 1600, 25),
    "llama3-1b": _llama3(
        d_model=2048, n_layers=16, n_heads=32, d_ff=8192, tie=True, rope_factor=32.0
    ),
    "llama3-3b": _llama3(
        d_model=3072, n_layers=28, n_heads=24, d_ff=8192, tie=True, rope_factor=32.0, head_dim=128
    ),
    "llama3-8b": _llama3(
        d_model=4096, n_layers=32, n_heads=32, d_ff=14336, tie=False, rope_factor=8.0
    ),
    "llama3-70b": _llama3(
        d_model=8192, n_layers=80, n_heads=64, d_ff=28672, tie=False, rope_factor=8.0
    ),
    "smollm2-135m": Config(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        max_seq_len=8192,
        rope_theta=100_000.0,
        tie_embeddings=True,
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active per token.
    "mixtral-8x7b": Config(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
        n_experts=8,
        n_experts_per_token=2,
    ),
    # DeepSeek-MoE 16B (Dai et al. 2024): 64 fine-grained routed experts (6 per token) + 2 shared,
    # first layer dense; 16.4B parameters, 2.8B active. Gates are not renormalised.
    "deepseek-moe-16b": Config(
        vocab_size=102400,
        d_model=2048,
        n_layers=28,
        n_heads=16,
        d_ff=10944,
        max_seq_len=4096,
        norm_eps=1e-6,
        n_experts=64,
        n_experts_per_token=6,
        n_shared_experts=2,
        moe_d_ff=1408,
        first_dense_layers=1,
        router_normalize=False,
    ),
    # Qwen2.5 (Qwen Team 2024), base models' config.json.
    "qwen2.5-0.5b": _qwen(
        d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864, tie=True, qkv_bias=True
    ),
    "qwen2.5-1.5b": _qwen(
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        d_ff=8960,
        tie=True,
        max_seq_len=131072,
        qkv_bias=True,
    ),
    "qwen2.5-7b": _qwen(
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        d_ff=18944,
        tie=False,
        vocab_size=152064,
        max_seq_len=131072,
        qkv_bias=True,
    ),
    # Qwen3 (Yang et al. 2025): q/k norms, head_dim 128 apart from d_model / n_heads.
    "qwen3-0.6b": _qwen(
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        d_ff=3072,
        tie=True,
        max_seq_len=40960,
        head_dim=128,
        qk_norm=True,
    ),
    "qwen3-8b": _qwen(
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        d_ff=12288,
        tie=False,
        max_seq_len=40960,
        head_dim=128,
        qk_norm=True,
    ),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, renormalised; every layer MoE.
    "qwen3-30b-a3b": _qwen(
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        d_ff=6144,
        tie=False,
        max_seq_len=40960,
        head_dim=128,
        qk_norm=True,
        n_experts=128,
        n_experts_per_token=8,
        moe_d_ff=768,
        router_normalize=True,
    ),
    # Mistral 7B v0.3 (Jiang et al. 2023): vocabulary 32768, no sliding window in v0.2+.
    "mistral-7b": Config(
        vocab_size=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
    ),
    # Phi-3-mini-4k (Abdin et al. 2024): MHA, window 2047 on every layer.
    "phi3-mini-4k": Config(
        vocab_size=32064,
        d_model=3072,
        n_layers=32,
        n_heads=32,
        d_ff=8192,
        max_seq_len=4096,
        sliding_window=2047,
    ),
    # DeepSeek-V2-Lite (arXiv 2405.04434): MLA without a low-rank query, 64 routed experts (6
    # per token, softmax gates not renormalised) + 2 shared, first layer dense; 15.7B parameters.
    "deepseek-v2-lite": Config(
        vocab_size=102400,
        d_model=2048,
        n_layers=27,
        n_heads=16,
        head_dim=192,
        d_ff=10944,
        max_seq_len=163840,
        norm_eps=1e-6,
        rope_scaling=_deepseek_yarn(0.707),
        n_experts=64,
        n_experts_per_token=6,
        n_shared_experts=2,
        moe_d_ff=1408,
        first_dense_layers=1,
        router_normalize=False,
        mla_kv_rank=512,
        mla_rope_dim=64,
        mla_v_head_dim=128,
    ),
    # DeepSeek-V3 (arXiv 2412.19437): MLA with a rank-1536 query, 256 routed experts in 8 groups
    # (4 kept, 8 experts per token, sigmoid gates with the balancing bias, x2.5) + 1 shared,
    # three dense layers; 671B parameters without the multi-token-prediction module.
    "deepseek-v3": Config(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        head_dim=192,
        d_ff=18432,
        max_seq_len=163840,
        norm_eps=1e-6,
        rope_scaling=_deepseek_yarn(1.0),
        n_experts=256,
        n_experts_per_token=8,
        n_shared_experts=1,
        moe_d_ff=2048,
        first_dense_layers=3,
        router_scoring="sigmoid",
        router_scale=2.5,
        router_bias=True,
        router_groups=8,
        router_topk_groups=4,
        mla_kv_rank=512,
        mla_q_rank=1536,
        mla_rope_dim=64,
        mla_v_head_dim=128,
    ),
    "gemma2-2b": _gemma2(d_model=2304, n_layers=26, n_heads=8, d_ff=9216),
    "gemma2-9b": _gemma2(d_model=3584, n_layers=42, n_heads=16, d_ff=14336),
    "gemma3-1b": _gemma3(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        d_ff=6912,
        window=512,
        max_seq_len=32768,
        rope_scaling=None,
    ),
    # The text part of Gemma 3 4B (its vision tower is not in the zoo).
    "gemma3-4b": _gemma3(
        vocab_size=262208,
        d_model=2560,
        n_layers=34,
        n_heads=8,
        n_kv_heads=4,
        d_ff=10240,
        window=1024,
        max_seq_len=131072,
        rope_scaling=RopeScaling(kind="linear", factor=8.0),
    ),
    # The default model of `python train.py`: trains in minutes on 2 CPU cores.
    "gpt-mini": _gpt2(4, 128, 4).replace(vocab_size=2048, max_seq_len=256),
    "tiny-gpt2": _gpt2(2, 64, 4).replace(vocab_size=256, max_seq_len=128),
    "tiny-llama": _TINY_LLAMA,
    "tiny-moe": _TINY_LLAMA.replace(n_experts=4, n_experts_per_token=2, moe_d_ff=64),
    "tiny-deepseek-moe": Config(
        vocab_size=256,
        d_model=64,
        n_layers=3,
        n_heads=4,
        d_ff=128,
        max_seq_len=128,
        n_experts=8,
        n_experts_per_token=3,
        n_shared_experts=1,
        moe_d_ff=32,
        first_dense_layers=1,
        router_normalize=False,
    ),
    "tiny-deepseek-v3": Config(
        vocab_size=256,
        d_model=64,
        n_layers=3,
        n_heads=4,
        head_dim=24,
        d_ff=128,
        max_seq_len=128,
        norm_eps=1e-6,
        n_experts=8,
        n_experts_per_token=2,
        n_shared_experts=1,
        moe_d_ff=32,
        first_dense_layers=1,
        router_scoring="sigmoid",
        router_scale=2.5,
        router_bias=True,
        router_groups=4,
        router_topk_groups=2,
        mla_kv_rank=24,
        mla_q_rank=16,
        mla_rope_dim=8,
        mla_v_head_dim=16,
    ),
}


def presets() -> list[str]:
    """Names of every known preset."""
    return list(_PRESETS)


def preset(name: str, **changes) -> Config:
    """The config called `name`, with optional changes: `preset("gpt2-124m", n_layers=2)`."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(presets())}")
    config = _PRESETS[name]
    return config.replace(**changes) if changes else config
