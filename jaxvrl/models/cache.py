"""KV caches of the text decoder: dense (`KVCache`, rows sharing one write position) and
paged (`PagedKVCache`, rows writing at their own positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxvrl.models.config import TextConfig

# The keys' layouts: positions minor ("BKHS", what the CPU decode kernels read as it lies) or
# second-minor like the values ("BKSH": on accelerators, whose (8, 128) tiles would pad a
# decode step's one new position of a positions-minor key to 128 at every write). Per
# layout: the order that takes keys [B, T, K, H] into it, and its logical axes.
KEY_ORDER = {"BKHS": (0, 2, 3, 1), "BKSH": (0, 2, 1, 3)}
KEY_AXES = {"BKHS": ("batch", "heads", None, "length"), "BKSH": ("batch", "heads", "length", None)}
KEY_LAYOUTS = tuple(KEY_ORDER)


@struct.dataclass
class KVCache:
    """Keys [B, K, H, S] (or [B, K, S, H], `key_layout`) and values [B, K, S, H] of every
    layer, the valid-key mask and the next write position.

    Two layouts of the layers: a tuple of per-layer arrays, or one array with a leading layer
    axis (k float[L, B, K, H, S], v float[L, B, K, S, H]) that a scanned decoder scans over
    (`TextDecoder`). The tuple is the CPU decode steps' layout: each layer's cache is its own
    buffer, updated in place and read as it lies by the CPU attention kernel, where a slice
    of a stacked array would be copied every step.

    Rows share one write position: prompts are left-padded to a common length, so every row
    writes its t-th new token at the same slot. The layout makes a decode step's two products
    (q . keys over H, probabilities . values over S) read the cache as it lies, with the long
    axis S contiguous in the first; [B, S, K, H] made XLA's CPU backend transpose each layer's
    whole cache every step.
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    key_mask: jax.Array  # bool[B, S]
    index: jax.Array  # int32[]
    # nothing written yet (`init`): the decoder runs the first tokens as a forward pass
    # (`attention.attend`, its blocked kernels and sequence split) and writes their keys and
    # values here after (`filled`); a prefill's cost is then the forward pass's
    empty: bool = struct.field(pytree_node=False, default=False)
    key_layout: str = struct.field(pytree_node=False, default="BKHS")  # of KEY_LAYOUTS

    @classmethod
    def init(
        cls,
        cfg: TextConfig,
        batch: int,
        length: int,
        dtype=jnp.float32,
        stacked: bool = False,
        key_layout: str = "BKHS",
    ) -> KVCache:
        """Zeros for `length` positions; stacked: the layer-axis layout, else the tuple."""
        if key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
        kv, hd, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        k_shape = (batch, kv, hd, length) if key_layout == "BKHS" else (batch, kv, length, hd)
        if stacked:
            k = jnp.zeros((n, *k_shape), dtype)
            v = jnp.zeros((n, batch, kv, length, hd), dtype)
        else:
            k = tuple(jnp.zeros(k_shape, dtype) for _ in range(n))
            v = tuple(jnp.zeros((batch, kv, length, hd), dtype) for _ in range(n))
        mask, index = jnp.zeros((batch, length), bool), jnp.zeros((), jnp.int32)
        return cls(k=k, v=v, key_mask=mask, index=index, empty=True, key_layout=key_layout)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    def layer(self, i: int):
        """What layer i's attention takes: (keys, values, write position, key layout)."""
        return self.k[i], self.v[i], self.index, self.key_layout

    def filled(self, k, v, valid: jax.Array) -> KVCache:
        """This empty cache with T tokens written at slots [0, T): their keys k and values v
        [B, T, K, H] per layer (stacked [L, B, T, K, H], or a sequence of layers) and their
        validity bool[B, T]."""
        t = valid.shape[1]
        if t > self.key_mask.shape[1]:
            raise ValueError(f"{t} tokens do not fit a cache of {self.key_mask.shape[1]}")

        def put(buf, new, order):  # new [.., B, T, K, H] into buf in the cache's layout
            lead = tuple(range(new.ndim - 4))
            new = new.transpose(*lead, *(len(lead) + i for i in order)).astype(buf.dtype)
            return jax.lax.dynamic_update_slice(buf, new, (0,) * buf.ndim)

        def layers(x):
            return tuple(x) if isinstance(x, (tuple, list)) else tuple(x[i] for i in range(len(x)))

        k_order, v_order = KEY_ORDER[self.key_layout], KEY_ORDER["BKSH"]
        if self.stacked:
            k = put(self.k, jnp.stack(k) if isinstance(k, (tuple, list)) else k, k_order)
            v = put(self.v, jnp.stack(v) if isinstance(v, (tuple, list)) else v, v_order)
        else:
            k = tuple(put(c, x, k_order) for c, x in zip(self.k, layers(k)))
            v = tuple(put(c, x, v_order) for c, x in zip(self.v, layers(v)))
        key_mask = jax.lax.dynamic_update_slice(self.key_mask, valid, (0, 0))
        return self.replace(k=k, v=v, key_mask=key_mask, index=self.index + t, empty=False)


@struct.dataclass
class PagedKVCache:
    """A KV cache in pages, for decode steps whose rows write at their own positions (the
    sampler's slots, `jaxvrl/sampling/engine.py`): every layer's keys k [pages, K, H, ps] (or
    [pages, K, ps, H], `key_layout` as `KVCache`'s) and values v [pages, K, ps, H] (the dense
    cache's layouts with the length axis cut into pages of ps positions), and per row a page
    table, the validity of its keys and the slot its next token is written to.

    A row's logical sequence is its pages in table order: slot j is position j % ps of page
    table[b, j // ps]. Rows may share pages that nobody writes (a prompt's pages, shared by
    its samples); a row writes only into pages of its own. Keys are attended where `valid`,
    so pages may hold gaps (a prompt padded to whole pages).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    table: jax.Array  # int32[B, n]: the pages of each row, in order
    valid: jax.Array  # bool[B, n * ps]: which of the row's slots hold a key
    write: jax.Array  # int32[B]: the slot the row's next token goes to
    key_layout: str = struct.field(pytree_node=False, default="BKHS")  # of KEY_LAYOUTS

    stacked = False  # one buffer per layer (the layers run as a loop)

    @property
    def page_size(self) -> int:
        return self.v[0].shape[-2]

    def layer(self, i: int) -> PagedLayer:
        """What layer i's attention takes: its pages with the rows' tables and write slots."""
        return PagedLayer(self.k[i], self.v[i], self.table, self.write, self.key_layout)


@struct.dataclass
class PagedLayer:
    """One layer's pages with the rows' tables and write slots (`Attention.__call__`)."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    write: jax.Array
    key_layout: str = struct.field(pytree_node=False, default="BKHS")

    def store(self, k_new, v_new) -> PagedLayer:
        """The layer with each row's new key/value [B, 1, K, H] written at its write slot
        (its attention reads the pages through `cached_attention.attend_cache`)."""
        ps = self.v.shape[-2]
        page = jnp.take_along_axis(self.table, (self.write // ps)[:, None], axis=1)[:, 0]
        off = self.write % ps
        key = k_new[:, 0].astype(self.k.dtype)
        if self.key_layout == "BKHS":
            k_pages = self.k.at[page, :, :, off].set(key)
        else:
            k_pages = self.k.at[page, :, off, :].set(key)
        v_pages = self.v.at[page, :, off, :].set(v_new[:, 0].astype(self.v.dtype))
        return self.replace(k=k_pages, v=v_pages)
