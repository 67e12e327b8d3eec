"""Token embeddings (with the tied-unembedding path) and learned absolute positions."""

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers.init import scaled_normal
from layers.kernels.cpu.dense import dense_product, uses_dense_kernel


class Embedding(eqx.Module):
    """Token ids -> vectors; `unembed` reuses the same matrix as the output head (weight tying,
    Press & Wolf 2017), as GPT-2 and the small Llamas do."""

    weight: Float[Array, "vocab embed"]

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        init_std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = scaled_normal(key, init_std, (vocab_size, d_model), dtype)

    @staticmethod
    def of(weight: Float[Array, "vocab embed"]) -> "Embedding":
        """An Embedding holding this table (no initialisation)."""
        embedding = object.__new__(Embedding)
        object.__setattr__(embedding, "weight", weight)
        return embedding

    def __call__(
        self, tokens: Int[Array, "batch seq"], *, dtype: DTypeLike = jnp.float32
    ) -> Float[Array, "batch seq embed"]:
        return jnp.take(self.weight, tokens, axis=0).astype(dtype)

    def unembed(
        self, x: Float[Array, "batch seq embed"], *, dtype: DTypeLike | None = None
    ) -> Float[Array, "batch seq vocab"]:
        """A few float32 tokens on a CPU (a decode step's rows) take the CPU kernel of
        `layers.kernels.cpu.dense`, walking the table's rows in order; everything else one XLA
        einsum."""
        dtype = dtype or x.dtype
        (batch, seq, embed), vocab = x.shape, self.weight.shape[0]
        if uses_dense_kernel(batch * seq, x.dtype, self.weight.dtype, dtype, transposed=True):
            flat = dense_product(x.reshape(batch * seq, embed), self.weight, True)
            return flat.reshape(batch, seq, vocab)
        return jnp.einsum("bsd,vd->bsv", x.astype(dtype), self.weight.astype(dtype))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"weight": ("vocab", "embed")}


class LearnedPositions(eqx.Module):
    """GPT-2's learned absolute position table, looked up by explicit positions so packed
    sequences (positions restarting per document) and ragged decode rows work."""

    weight: Float[Array, "seq embed"]

    def __init__(
        self,
        max_seq_len: int,
        d_model: int,
        *,
        init_std: float = 0.01,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = scaled_normal(key, init_std, (max_seq_len, d_model), dtype)

    def __call__(
        self, positions: Int[Array, "batch seq"], *, dtype: DTypeLike = jnp.float32
    ) -> Float[Array, "batch seq embed"]:
        return jnp.take(self.weight, positions, axis=0).astype(dtype)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"weight": ("seq", "embed")}
