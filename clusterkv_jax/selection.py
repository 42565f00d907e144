"""`Selection`: the rows of a layer's store one decode step attends, as a policy's `select` returns them.

Shapes: B batch, h selection heads (N query heads, or K KV heads when a selection is shared by a KV head's
query heads), n chunks, M = n * chunk rows.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Selection:
    """Per selection head, n chunks of `chunk` consecutive store rows, and which of their rows hold a selected token.

    chunk = 1 is a plain list of rows (`of_rows`); ClusterKV selects whole blocks of a cluster's members, Quest
    whole pages. A chunk's first row identifies it (host offload's recall cache looks chunks up by it)."""

    starts: jax.Array  # [B, h, n] int32 first row of each chunk
    mask: jax.Array  # [B, h, n, chunk] bool rows holding a selected token
    chunk: int = flax.struct.field(pytree_node=False, default=1)
    #: Every start is a multiple of `chunk` (chunks are whole blocks of the store, as ClusterKV's are; Quest's
    #: pages of generated tokens start anywhere): a store whose rows are whole chunks reads them as blocks.
    aligned: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def of_rows(cls, rows: jax.Array, mask: jax.Array) -> "Selection":
        """A selection of single rows [B, h, M] and their validity mask [B, h, M]."""
        return cls(starts=rows.astype(jnp.int32), mask=mask[..., None], chunk=1)

    @property
    def heads(self) -> int:
        return self.starts.shape[1]

    def rows(self) -> jax.Array:
        """[B, h, n * chunk] every selected row, chunk after chunk."""
        B, h, n = self.starts.shape
        return (self.starts[..., None] + jnp.arange(self.chunk, dtype=jnp.int32)).reshape(B, h, n * self.chunk)

    def flat_mask(self) -> jax.Array:
        """[B, h, n * chunk]"""
        B, h, n = self.starts.shape
        return self.mask.reshape(B, h, n * self.chunk)
