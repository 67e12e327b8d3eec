"""The page pool: where each token's key and value live, who may see them, how new ones are
written, and the host-side check of a page table.

Layout (one layer; vLLM's PagedAttention, Kwon et al. 2023, in the layout of JAX's GPU paged
attention kernel):

    k_pages, v_pages  [kv_heads, pages, page_size, head_dim]  the pool, shared by every row
    page_table        [batch, row_pages] int32                 row b's i-th page id
    lengths           [batch] int32                            tokens row b holds

Row b's token at position j lives in page `page_table[b, j // page_size]` at offset
`j % page_size`, so a row's positions are 0, 1, ..., lengths[b] - 1 with no padding. `kv_heads`
leads so that one (row, K/V head) program of the decode kernel reads each page as one contiguous
`page_size x head_dim` block. Table entries past a row's last page are never read for keys (they
may point anywhere in the pool, e.g. page 0); a row holds at most `row_pages * page_size` tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from layers.kernels.paged.int8 import Int8Pages, quantize

Pool = Float[Array, "*layers kv_heads pages page_size head_dim"] | Int8Pages


def visible(
    q_pos: Int[Array, "..."], key_pos: Int[Array, "..."], length: Int[Array, "..."],
    window: Int[Array, "..."] | int | None,
) -> Bool[Array, "..."]:  # fmt: skip
    """The paged attention rule, broadcast elementwise: the key at position j is visible to the
    query at position i iff j <= i, j < length and (no window or i - j < window)."""
    allowed = (key_pos <= q_pos) & (key_pos < length)
    if window is not None:
        allowed &= q_pos - key_pos < window
    return allowed


def write_pages(
    pool: Pool,
    page_table: Int[Array, "groups row_pages"],
    groups: Int[Array, " tokens"],
    positions: Int[Array, " tokens"],
    new: Float[Array, "tokens kv_heads head_dim"],
    valid: Bool[Array, " tokens"],
    *,
    layer: Int[Array, ""] | None = None,
) -> Pool:
    """The pool with each valid new token's key (or value, or latent) written at its position in
    its group's pages (`groups[t]` is token t's row of `page_table`): one scatter, cast to the
    pool's dtype; into an int8 pool (int8.py) each token's head vector is quantized with its own
    scale, so tokens already written are never touched. `layer` indexes a leading stacked-layers
    axis (None: no such axis).

    Padding (`valid` False) writes nothing, and so does a position outside the group's page
    table (negative, or >= row_pages * page_size): the engine allocates pages before writing,
    and a token without a page must not land in another row's page. Two valid tokens at the same
    slot leave either one. Donate the pool (`jax.jit(..., donate_argnums=...)`) and the scatter
    updates it in place: a step costs the bytes written, not a copy of the pool.
    """
    n_pages, page_size = pool.shape[-3], pool.shape[-2]
    row_pages = page_table.shape[1]
    slot = positions // page_size
    in_table = valid & (positions >= 0) & (slot < row_pages)
    page = page_table[groups, jnp.clip(slot, 0, row_pages - 1)]
    # Out of bounds (a positive index: JAX wraps negative ones), so mode="drop" skips the write.
    page = jnp.where(in_table, page, n_pages)
    offset = positions % page_size

    def scatter(target, update):  # update [tokens, kv_heads, ...]
        if layer is None:  # target.at[:, page, offset] is [kv_heads, tokens, ...]
            return target.at[:, page, offset].set(jnp.swapaxes(update, 0, 1), mode="drop")
        # With the layer index apart from page/offset, NumPy indexing puts [tokens] first.
        return target.at[layer, :, page, offset].set(update, mode="drop")

    if isinstance(pool, Int8Pages):
        numbers, scales = quantize(new)
        return Int8Pages(scatter(pool.values, numbers), scatter(pool.scales, scales), pool.axes)
    return scatter(pool, new.astype(pool.dtype))


def check_page_table(
    page_table: Int[ArrayLike, "batch row_pages"],
    lengths: Int[ArrayLike, " batch"],
    *,
    page_size: int,
    n_pages: int,
) -> None:
    """Host-side check of a page table's values (numpy; for concrete arrays, not under jit): every
    length fits the row's table, and every page a row uses is a page of the pool. A ValueError
    names the first bad row. `paged_attention` runs it whenever its arguments are concrete; an
    engine runs it where it allocates pages, since under jit values cannot be inspected."""
    table, lengths = np.asarray(page_table), np.asarray(lengths)
    capacity = table.shape[1] * page_size
    for row, length in enumerate(lengths):
        if not 0 <= length <= capacity:
            raise ValueError(
                f"paged attention: row {row} holds {length} tokens but its page table has "
                f"{table.shape[1]} pages of {page_size} tokens ({capacity} slots); lengths must "
                f"be in [0, {capacity}]"
            )
        used = table[row, : -(-int(length) // page_size)]
        bad = used[(used < 0) | (used >= n_pages)]
        if bad.size:
            raise ValueError(
                f"paged attention: row {row}'s page table points at page {int(bad[0])}, outside "
                f"the pool of {n_pages} pages"
            )


def is_concrete(*arrays: ArrayLike) -> bool:
    """True when every array has values now (not a tracer inside jit, vmap or grad)."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)
