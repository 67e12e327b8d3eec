"""`LoRABank`: one frozen projection with several LoRA adapters, each batch row choosing its own
(S-LoRA, Sheng et al. 2023; Punica, Chen et al. 2023): requests for different adapters share one
batch and one base, `y_b = base(x_b) + x_b · A[a_b] · B[a_b]` for row b's adapter `a_b` (-1:
none), instead of a merged copy of the weights per adapter.

Every adapter's down-projection is computed for every row and the rows' own are kept (a one-hot
over the adapters): `adapters x rank` extra columns, exact, with no gather of per-row weight
copies; for the handful of adapters a server loads this costs little beside the base's
`in x out`. The rows' choice is data (`rows`, set per call by `with_rows`), so any mix of
adapters runs in one compiled program.
"""

import string

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers.linear import Linear
from layers.lora import AroundProjection
from layers.quantized import QuantizedLinear


class LoRABank(AroundProjection):
    """`base` with adapters `lora_a` `[*lead, adapters, *in_shape, rank]` and `lora_b` `[*lead,
    adapters, rank, *out_shape]` (each adapter's alpha / rank folded into its B; ranks padded
    with zeros to the largest, which changes nothing), `rows` `[*lead, batch]` the adapter of
    each batch row of the next call (`*lead` is a stacked layer axis, if any). Frozen: for
    serving, not training."""

    base: Linear | QuantizedLinear
    lora_a: Float[Array, "..."]
    lora_b: Float[Array, "..."]
    rows: Int[Array, "..."]

    @property
    def n_adapters(self) -> int:
        return self.lora_a.shape[-len(self.in_shape) - 2]

    def with_rows(self, rows: Int[Array, " batch"]) -> "LoRABank":
        """This bank with each batch row's adapter for the next call (-1: the base alone)."""
        lead = self.lora_a.shape[: self.lora_a.ndim - len(self.in_shape) - 2]
        return eqx.tree_at(lambda b: b.rows, self, jnp.broadcast_to(rows, (*lead, *rows.shape)))

    def __call__(
        self,
        x: Float[Array, "batch ..."],
        *,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "batch ..."]:
        """x: `[batch, *rest, *in_shape]` -> `[batch, *rest, *out_shape]`; row b adds its own
        adapter's update (`key` is accepted for the projection interface; no dropout)."""
        if self.rows.shape[-1] != x.shape[0]:
            raise ValueError(
                f"LoRABank holds adapters for {self.rows.shape[-1]} rows, called on {x.shape[0]}: "
                "choose each row's adapter first (with_adapter_rows(model, rows))"
            )
        dtype = dtype or x.dtype
        y = self.base(x, dtype=dtype)
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        letters = string.ascii_letters
        contract, out, r = letters[:n_in], letters[n_in : n_in + n_out], letters[-1]
        h = x.astype(dtype)
        down = jnp.einsum(f"...{contract},n{contract}{r}->...n{r}", h,
                          self.lora_a.astype(dtype))  # fmt: skip
        pick = jax.nn.one_hot(self.rows, self.n_adapters, dtype=dtype)  # -1: all zeros
        pick = pick.reshape(pick.shape[:1] + (1,) * (down.ndim - 3) + pick.shape[1:] + (1,))
        up = jnp.einsum(f"...n{r},n{r}{out}->...{out}", down * pick, self.lora_b.astype(dtype))
        return y + up


def is_bank(node) -> bool:
    return isinstance(node, LoRABank)


def adapters_in(tree) -> int:
    """How many adapters the banks of `tree` hold (0: no bank)."""
    banks = [n for n in jax.tree.leaves(tree, is_leaf=is_bank) if is_bank(n)]
    return max((b.n_adapters for b in banks), default=0)


def with_adapter_rows(tree, rows: Int[Array, " batch"]):
    """`tree` (a model) with every bank set to give batch row b adapter `rows[b]` (-1: none)."""
    return jax.tree.map(lambda n: n.with_rows(rows) if is_bank(n) else n, tree, is_leaf=is_bank)
