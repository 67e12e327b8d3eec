"""Mixture-of-experts weights held packed (layers/quantized/formats.py): `QuantizedExperts` has
`Experts`' interface (`grouped`, `batched`, `n_experts`), each of its three matrices a packed
`[experts, rows, cols]` weight run by `quantized_ragged_matmul`, which on CPU reads only the
experts that received tokens (decode touches k of N)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from layers.kernels.quantized import quantized_ragged_matmul
from layers.moe.experts import Experts
from layers.quantized.formats import PackedWeight
from layers.quantized.quantize import Kind, pack


class QuantizedExperts(eqx.Module):
    """down_e(silu(x · gate_e) * (x · up_e)) for each expert e, every weight packed as W^T:
    gate and up `[experts, mlp, embed]`, down `[experts, embed, mlp]`."""

    gate: PackedWeight
    up: PackedWeight
    down: PackedWeight

    @staticmethod
    def from_experts(
        experts: Experts, kind: Kind, *, group: int | None = None
    ) -> "QuantizedExperts":
        """`experts` quantized as `kind` (stacked layers, if any, stay stacked)."""

        def packed(w, axes, name):  # w [..., experts, in, out] -> W^T [..., experts, out, in]
            what = f"experts.{name} {w.shape[-3:]}"
            return pack(jnp.swapaxes(w, -1, -2), kind, group=group, axes=axes, what=what)

        return QuantizedExperts(
            gate=packed(experts.gate, ("experts", "mlp", "embed"), "gate"),
            up=packed(experts.up, ("experts", "mlp", "embed"), "up"),
            down=packed(experts.down, ("experts", "embed", "mlp"), "down"),
        )

    @property
    def n_experts(self) -> int:
        return self.gate.lead[-1]

    @property
    def kind(self) -> str:
        return self.gate.name

    def grouped(
        self, x: Float[Array, "rows embed"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows embed"]:
        """Rows sorted by expert, `group_sizes[e]` of them for expert e (Experts.grouped)."""
        gate = quantized_ragged_matmul(x, self.gate, group_sizes)
        up = quantized_ragged_matmul(x, self.up, group_sizes)
        return quantized_ragged_matmul(jax.nn.silu(gate) * up, self.down, group_sizes)

    def batched(
        self, x: Float[Array, "experts *slots embed"]
    ) -> Float[Array, "experts *slots embed"]:
        """A buffer of rows per expert (the capacity layout): the grouped product with every
        expert's group its own slots."""
        n = self.n_experts
        rows = x.reshape(n, -1, x.shape[-1])
        sizes = jnp.full((n,), rows.shape[1], jnp.int32)
        out = self.grouped(rows.reshape(-1, x.shape[-1]), sizes)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Experts:
        """The float `Experts` this stands for."""
        w = lambda p: jnp.swapaxes(p.dequantize(dtype), -1, -2)  # noqa: E731
        return Experts.of(w(self.gate), w(self.up), w(self.down))

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {}
