"""A token embedding held packed (formats.py), with the tied-unembedding path: the table
`[vocab, embed]` is already a packed matrix of `vocab` rows of `embed` inputs, which is both what
a lookup gathers (only the looked-up rows are dequantized) and what the LM head multiplies
(`x · table^T`, the quantized matmul kernels)."""

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from layers.embedding import Embedding
from layers.kernels.quantized import quantized_matmul
from layers.quantized.formats import PackedWeight
from layers.quantized.quantize import Kind, pack


class QuantizedEmbedding(eqx.Module):
    """Token ids -> vectors from a packed `[vocab, embed]` table; `unembed` is the tied head."""

    packed: PackedWeight

    @property
    def kind(self) -> str:
        return self.packed.name

    @staticmethod
    def from_embedding(
        embedding: Embedding, kind: Kind, *, group: int | None = None
    ) -> "QuantizedEmbedding":
        """`embedding`'s table quantized as `kind`, each token's row with its own scales."""
        what = f"Embedding {embedding.weight.shape}"
        return QuantizedEmbedding(
            pack(embedding.weight, kind, group=group, axes=("vocab", "embed"), what=what)
        )

    def __call__(
        self, tokens: Int[Array, "batch seq"], *, dtype: DTypeLike = jnp.float32
    ) -> Float[Array, "batch seq embed"]:
        return self.packed.take(tokens, dtype)

    def unembed(
        self, x: Float[Array, "batch seq embed"], *, dtype: DTypeLike | None = None
    ) -> Float[Array, "batch seq vocab"]:
        dtype = dtype or x.dtype
        flat = x.astype(dtype).reshape(-1, x.shape[-1])
        return quantized_matmul(flat, self.packed).reshape(*x.shape[:-1], -1)

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Embedding:
        """The float `Embedding` this stands for."""
        return Embedding.of(self.packed.dequantize(dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {}
