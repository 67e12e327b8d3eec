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


def _deepseek_yarn(mscale: float) -> RopeScaling:
    """DeepSeek-V2/V3's YaRN: 4K trained context stretched 40x to 160K."""
    return RopeScaling(
        kind="yarn", factor=40.0, original_max_seq_len=4096, mscale=mscale, mscale_all_dim=mscale
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
