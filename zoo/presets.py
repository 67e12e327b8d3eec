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
