"""Flash attention in Pallas (Dao et al. 2022; FlashAttention-2, Dao 2023).

- `attention.py`: the entry point `flash_attention(q, k, v, mask)` and its `jax.custom_vjp`;
  decode (seq == 1) goes to `xla_attention`, see there why. Under active sharding rules it runs
  per shard (`shard.per_shard`, i.e. `jax.shard_map`): XLA cannot partition a Pallas call.
- `forward.py`: the forward kernel (running max / denominator, saves the log-sum-exp).
- `backward.py`: the backward kernel(s): dK/dV with dQ by atomic adds, or a separate dQ kernel.
- `tiles.py`: per-tile visibility from positions and segment ids (tile skipping, element masks).
- `config.py`: `BlockSizes` and the input checks.

On CPU the kernels run in the Pallas interpreter (a correctness path, not a speed path); on GPU
they compile through Triton, on JAX 0.11 and 0.12 alike.
"""

from layers.kernels.flash.attention import flash_attention
from layers.kernels.flash.config import DEFAULT_BLOCK_SIZES, BlockSizes

__all__ = ["DEFAULT_BLOCK_SIZES", "BlockSizes", "flash_attention"]
