"""Multi-head attention behind one function, `attend`, with implementations chosen by name
(docs/attention.md gives the whole description).

The model calls `attend(q, k, v, *, scale, key_valid, q_positions, k_positions, q_segments,
k_segments, causal, pools, implementation, ...)` and never builds a [T, S] mask: who may see
whom is given by O(T + S) arrays,

    visible(b, t, s) = key_valid[b, s]
                       and (not causal or k_positions[b, s] <= q_positions[b, t])
                       and (no segments or q_segments[b, t] == k_segments[b, s]),

from which every implementation builds its own mask, block by block where it works in blocks:
"xla" (dense, the reference), "flash" (blocked, online softmax, custom VJP), "splash" (the
Pallas TPU kernel), "cudnn" (`jax.nn.dot_product_attention`); callers that promise a `window`
get the banded dense form. A fully masked row gets zero output and statistics, not NaN. With
`pools`, `attend` also returns the heads-averaged attention mass on the vision and text key
pools (no gradient). Where the mesh being traced splits the tokens (`mesh.sequence`), both
run per device: an all-to-all over heads (Ulysses) or keys and values gathered. Einsum
letters: B batch, T query positions, S key positions, N query heads, K key/value heads, G
query heads per key/value head (N = K*G), H head dim, P pools.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxvrl.models.attention_kernels import cudnn, splash
from jaxvrl.models.visibility import (
    Blocks,
    Visibility,
    every_query_sees_itself,
    make_visibility,
    pad_axis,
    round_up,
    visibility_mask,
)
from jaxvrl.parallel.sharding import (
    logical_to_spec,
    sequence_split,
    target_platform,
    traced_mesh,
)

IMPLEMENTATIONS = ("xla", "flash", "splash", "cudnn")
POOLS = ("vision", "text", "prompt")  # the order of the pool axis P


def resolve(implementation: str, platform: str) -> str:
    """The implementation for a platform ("cpu", "gpu", "tpu") of the devices the program is
    compiled for (pass the mesh's platform, not the process's default backend).

    "auto" gives the dense reference on the CPU (small programs, where the dense softmax is
    fastest), the splash kernel on TPUs and the blocked plain-JAX attention on GPUs (cuDNN
    wants bfloat16 or float16; bench/RESULTS.md has the three timed in small train steps on
    an H100); any other name must be one of IMPLEMENTATIONS and is returned unchanged. Splash
    computes every block its static mask allows: with narrow segments (the vision tower's
    windows) "flash", which skips the blocks no query of a block may see, does far less
    work."""
    if implementation == "auto":
        if platform not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"unknown platform {platform!r} (expected cpu, gpu or tpu)")
        return {"cpu": "xla", "gpu": "flash", "tpu": "splash"}[platform]
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention implementation {implementation!r}; "
            f"known: auto, {', '.join(IMPLEMENTATIONS)}"
        )
    return implementation


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    key_valid: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    k_positions: jax.Array | None = None,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    causal: bool = True,
    pools: dict | None = None,
    implementation: str = "xla",
    block_q: int = 512,
    block_k: int = 512,
    interpret: bool = False,
    window: int | None = None,
    sliding: int = 0,
):
    """Attention of q float[B, T, N, H] over k, v float[B, S, K, H] (N = K*G).

    key_valid: bool[B, S] (default all valid); q_positions int[T] or [B, T] and k_positions
    int[S] or [B, S]: a query at position p sees keys at positions <= p when causal (default
    0..T-1 for both when T == S); q_segments int[T] or [B, T], k_segments int[S] or [B, S]:
    attention only within equal ids. pools: None or {"vision", "text", "prompt"}: bool[B, S].
    scale multiplies the logits. block_q, block_k: block sizes of "flash" (clipped to T, S)
    and "splash" (rounded up to multiples of 128). interpret: run Pallas kernels in the
    interpreter (CPU tests). window: a promise of the caller that no query sees a key
    `window` or more positions away (self-attention, T == S; e.g. segments that are runs of
    at most `window` consecutive positions, as the vision tower's windows are): every
    implementation but "xla" (the reference) then runs the banded dense form, each block of
    at least `window` queries against the three blocks of keys around it. sliding: with
    causal, a query at position p sees only keys at positions > p - sliding (a sliding-window
    decoder's layers; 0: none); splash and cudnn, whose masks are index-causal, then run
    "flash".

    Returns (out [B, T, N, H] in q's dtype, stats): stats is None without pools, else
    (A_V, A_X) float32[B, T], gradient-free.
    """
    b, t, n, h = q.shape
    if (
        k.shape[0] != b
        or k.shape[3] != h
        or k.shape[2] == 0
        or n % k.shape[2]
        or v.shape != k.shape
    ):
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected [B,T,K*G,H], [B,S,K,H]")
    if implementation not in IMPLEMENTATIONS:  # "auto" needs the platform: see resolve
        hint = (
            " (map 'auto' with resolve(name, platform) first)" if implementation == "auto" else ""
        )
        raise ValueError(
            f"attention implementation {implementation!r}: one of {IMPLEMENTATIONS}{hint}"
        )
    if window is not None and sliding:
        raise ValueError("window (a promise of narrow segments) and sliding do not combine")
    pool = None
    if pools is not None:
        pool = jnp.stack([jnp.asarray(pools[name], bool) for name in POOLS], axis=-1)  # [B, S, P]
    rows = dict(key_valid=key_valid, q_positions=q_positions, k_positions=k_positions,
                q_segments=q_segments, k_segments=k_segments)  # fmt: skip
    settings = dict(scale=scale, causal=causal, implementation=implementation,
                    block_q=block_q, block_k=block_k, interpret=interpret, window=window,
                    sliding=sliding)  # fmt: skip
    split = _split_of(q, k)
    if split is None:
        out, masses = _attend(q, k, v, pool, **rows, **settings)
    else:
        out, masses = _split_attend(split, q, k, v, pool, rows, settings)
    return out, (None if masses is None else pool_ratios(lax.stop_gradient(masses)))


def _attend(
    q, k, v, pool, *, scale, key_valid, q_positions, k_positions, q_segments, k_segments,
    causal, implementation, block_q, block_k, interpret, window, sliding,
):  # fmt: skip
    """`attend` on one device's arrays: (out, the heads-averaged pool masses float32[B, T, P]
    or None)."""
    b, t, n, h = q.shape
    vis = make_visibility(q, k, key_valid, q_positions, k_positions, q_segments, k_segments, causal)
    sees_self = every_query_sees_itself(
        t, k.shape[1], key_valid, q_positions, q_segments, k_segments, causal
    )
    sliding = int(sliding) if causal else 0
    blocks = Blocks(
        float(scale),
        causal,
        max(1, min(block_q, t)),
        max(1, min(block_k, k.shape[1])),
        sees_self,
        sliding,
    )
    explicit_positions = causal and q_positions is not None
    if implementation in ("splash", "cudnn") and (explicit_positions or sliding):
        # kernels with an index-causal mask cannot take a cache's positions or a window
        implementation = "xla" if t == 1 else "flash"
    if window is not None and implementation != "xla":
        if k.shape[1] != t or window < 1:
            raise ValueError(f"window={window} needs self-attention (T == S), got {t}, {k.shape}")
        block = round_up(window, 128) if target_platform() == "tpu" else window
        out, masses = _banded(q, k, v, vis, pool, scale=scale, causal=causal, block=block)
    elif implementation == "xla":
        out, masses = _xla(q, k, v, vis, pool, scale=scale, causal=causal, sliding=sliding)
    elif implementation == "flash":
        out, masses = _flash(q, k, v, vis, pool, blocks)
    else:
        if implementation == "splash":
            out = splash(q, k, v, vis, blocks, interpret=interpret)
        else:
            masked = key_valid is not None or q_segments is not None
            out = cudnn(q, k, v, vis, blocks, masked=masked)
        masses = None if pool is None else _blocked_masses(q, k, vis, pool, blocks)
    return out, masses


def pool_ratios(masses: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32[B, T, P] heads-averaged pool masses (POOLS order) -> (A_V, A_X) float32[B, T]."""
    vision, text, prompt = masses[..., 0], masses[..., 1], masses[..., 2]
    safe = jnp.where(prompt > 0, prompt, 1.0)
    return jnp.where(prompt > 0, vision / safe, 0.0), jnp.where(prompt > 0, text / safe, 0.0)


# ---------------------------------------------------------------------------------------------
# sequence parallel: a row's tokens split over a mesh axis (the "length" rule's)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How a self-attention's tokens lie on the mesh: `axis` (of `size` devices) splits the
    length; `rows` and `heads` the spec entries of the rows and of the heads (q's and k's
    alike, or None); `ulysses`: every device's query and key/value heads divide by `size`."""

    mesh: object
    axis: str
    size: int
    rows: object
    heads: object
    ulysses: bool

    def spec(self, *dims):  # "rows" / "length" / "heads" / None per dimension
        names = {"rows": self.rows, "length": self.axis, "heads": self.heads}
        return P(*(names.get(d) for d in dims))

    @property
    def head_axes(self) -> tuple[str, ...]:  # the axes a device's heads are a share of
        heads = () if self.heads is None else self.heads
        return (heads,) if isinstance(heads, str) else tuple(heads)


def _split_of(q, k) -> _Split | None:
    """q [B, T, N, H] and k [B, S, K, H] of a self-attention (T == S) whose length a mesh
    axis splits (`sequence_split`), or None."""
    t, b = q.shape[1], q.shape[0]
    split = sequence_split(t) if k.shape[1] == t else None
    if split is None:
        return None
    mesh = traced_mesh()
    rows = logical_to_spec(("batch",), (b,), mesh)[0]
    q_heads = logical_to_spec((None, None, "heads", None), q.shape, mesh)[2]
    k_heads = logical_to_spec((None, None, "heads", None), k.shape, mesh)[2]
    out = _Split(mesh, *split, rows, q_heads if q_heads == k_heads else None, False)
    shares = math.prod(mesh.shape[a] for a in out.head_axes)
    heads = (q.shape[2] // shares, k.shape[2] // shares)
    return dataclasses.replace(out, ulysses=all(n % out.size == 0 for n in heads))


def _split_attend(split: _Split, q, k, v, pool, rows: dict, settings: dict):
    """`_attend` with the tokens split over `split.axis`, each device holding its run of
    every row (the whole of attention's arithmetic, float32 sums in the same order).

    Ulysses (where the heads divide): an all-to-all gives each device every token of its
    share of the heads, attention runs whole, a second all-to-all returns the tokens. Else
    (context parallel) each device's queries attend to the keys and values gathered from
    every device, at their positions in the row. The pool masses, averaged over a device's
    heads, are averaged over the devices that split the heads. Each step's arrays travel in
    one collective, and the collectives in a fixed order; under a causal mask a blocked
    kernel's queries are reordered so that every device sees as many keys (`_zigzag`)."""
    axis, t = split.axis, q.shape[1]
    given = {name: jnp.broadcast_to(x, q.shape[:2]) for name, x in rows.items() if x is not None}
    if settings["causal"] and not split.ulysses:  # a query's and a key's place in the row
        given.setdefault("q_positions", jnp.broadcast_to(jnp.arange(t), q.shape[:2]))
        given.setdefault("k_positions", given["q_positions"])
    opts = settings if split.ulysses else dict(settings, window=None)  # a band needs T == S
    gathered = [n for n in given if split.ulysses or n[0] != "q"]  # the keys' (all: Ulysses)
    # causal context parallel with a kernel that skips the blocks a query does not see: each
    # device takes the halves s and 2 size - 1 - s of the row's 2 size (the "zigzag" order),
    # so that every device's queries see as many keys (`_zigzag`)
    balance = (
        not split.ulysses
        and settings["causal"]
        and settings["implementation"] != "xla"
        and (t // split.size) % 2 == 0
    )
    queries = [n for n in given if n not in gathered]

    def body(q, k, v, pool, given):
        ints = [given[n] for n in gathered] + ([] if pool is None else [pool])
        if split.ulysses:  # tokens <-> heads
            q, k, v = _heads_to_tokens(axis, split.size, q, k, v)
            after = q
        else:
            k, v = lax.all_gather(jnp.stack([k, v]), axis, axis=2, tiled=True)
            after = k
        run = dict(rows, **given)
        if ints:
            ints = _gather_ints(axis, ints, after)
            run.update(zip(gathered, ints))
            pool = pool if pool is None else ints[-1]
        if balance:
            q, *mine = _zigzag(axis, split.size, [q, *(given[n] for n in queries)])
            run.update(zip(queries, mine))
        out, masses = _attend(q, k, v, pool, **run, **opts)
        if balance:
            out, *back = _zigzag(axis, split.size, [out] + ([] if masses is None else [masses]),
                                 back=True)  # fmt: skip
            masses = back[0] if back else None
        if masses is not None:
            masses = _devices_masses(split, masses)
            out = lax.optimization_barrier((out, masses))[0]
        if split.ulysses:
            out = lax.all_to_all(out, axis, 1, 2, tiled=True)
        return out, masses

    qkv = split.spec("rows", "length", "heads", None)
    length = split.spec("rows", "length")
    specs = (qkv, qkv, qkv, split.spec("rows", "length", None), {n: length for n in given})
    out_specs = (qkv, None if pool is None else split.spec("rows", "length", None))
    run = jax.shard_map(body, mesh=split.mesh, in_specs=specs, out_specs=out_specs,
                        check_vma=False)  # fmt: skip
    return run(q, k, v, pool, given)


def _zigzag(axis: str, size: int, xs: list, back: bool = False) -> list:
    """Arrays [B, T / size, ...], each device's run of the row (its halves 2d and 2d + 1 of 2
    size), -> each device's halves d and 2 size - 1 - d (under a causal mask every device's
    queries then see as many keys: the load-balanced order of Llama 3's context parallelism,
    arXiv 2407.21783); back: the inverse. Two collective permutes per array: every device
    sends its first halves along one, its second halves along the other."""
    dest = lambda c: c if c < size else 2 * size - 1 - c  # noqa: E731 -- half c's device
    first = [(d, dest(2 * d)) for d in range(size)]
    second = [(d, dest(2 * d + 1)) for d in range(size)]
    if back:
        first, second = [(b, a) for a, b in first], [(b, a) for a, b in second]
    # half d comes by the first permute on an even device d, by the second on an odd one
    even = lax.axis_index(axis) % 2 == 0
    out = []
    for x in xs:
        h = x.shape[1] // 2
        a, b = x[:, :h], x[:, h:]
        if back:  # this device's halves back along the permutes they came by
            a, b = jnp.where(even, a, b), jnp.where(even, b, a)
        a, b = lax.ppermute(a, axis, first), lax.ppermute(b, axis, second)
        if not back:
            a, b = jnp.where(even, a, b), jnp.where(even, b, a)
        out.append(jnp.concatenate([a, b], axis=1))
    return out


def _heads_to_tokens(axis: str, size: int, *xs):
    """Arrays [B, T / size, heads_i, H] of one dtype, each device's run of the tokens -> [B, T,
    heads_i / size, H]: every token of the device's share of each one's heads (one
    all-to-all)."""
    b, local, _, h = xs[0].shape
    parts = [x.reshape(b, local, size, x.shape[2] // size, h) for x in xs]
    joined = lax.all_to_all(jnp.concatenate(parts, axis=3), axis, 2, 1, tiled=True)[:, :, 0]
    cuts = np.cumsum([p.shape[3] for p in parts])[:-1]
    return [y.astype(x.dtype) for y, x in zip(jnp.split(joined, cuts, axis=2), xs)]


def _gather_ints(axis: str, arrays: list, after: jax.Array) -> list:
    """Integer and bool arrays [B, T / size, ...] gathered along their tokens (one all-gather
    of them stacked as int32, once `after` is: collectives in one order on every device),
    each back in its dtype."""
    arrays = lax.optimization_barrier((after, arrays))[1]
    flat = [x.reshape(*x.shape[:2], -1) for x in arrays]
    cuts = np.cumsum([x.shape[2] for x in flat])[:-1]
    whole = lax.all_gather(
        jnp.concatenate(flat, axis=2).astype(jnp.int32), axis, axis=1, tiled=True
    )
    return [
        part.reshape(*part.shape[:2], *x.shape[2:]).astype(x.dtype)
        for part, x in zip(jnp.split(whole, cuts, axis=2), arrays)
    ]


def _devices_masses(split: _Split, masses: jax.Array) -> jax.Array:
    """Masses [B, T', ...] averaged over a device's heads -> over every head (the mean over
    the devices that split the heads), of this device's run of the tokens (Ulysses: the
    device's heads saw every token)."""
    axes = split.head_axes + ((split.axis,) if split.ulysses else ())
    masses = lax.pmean(masses, axes) if axes else masses
    if not split.ulysses:
        return masses
    local = masses.shape[1] // split.size
    return lax.dynamic_slice_in_dim(masses, lax.axis_index(split.axis) * local, local, 1)


# ---------------------------------------------------------------------------------------------
# xla: dense reference


def _xla(q, k, v, vis: Visibility, pool, *, scale, causal, sliding=0):
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(q.dtype)) * scale
    mask = visibility_mask(vis, causal, sliding=sliding)[:, None, None]  # [B, 1, 1, T, S]
    logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(q.dtype), v.astype(q.dtype))
    masses = None
    if pool is not None:
        p = lax.stop_gradient(probs)
        masses = jnp.einsum("BKGTS,BSP->BTP", p, pool.astype(jnp.float32)) / n
    return out.reshape(b, t, n, h), masses


# ---------------------------------------------------------------------------------------------
# banded: dense attention of each block of queries over the keys of its own block and the two
# beside it, for attention no wider than a block


def _banded(q, k, v, vis: Visibility, pool, *, scale, causal, block):
    """Exact where no query sees a key `block` or more positions away: the keys a query of
    block i may see then lie in blocks i - 1, i, i + 1. Logits [B, T / block, K, G, block,
    3 block]: O(T * block), no loop, plain autodiff."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    c = block
    nb = -(-t // c)
    tp = nb * c

    def around(x, fill):
        """[B, T, ...] -> [B, nb, 3c, ...]: each block's keys with its neighbours'."""
        x = pad_axis(x, 1, tp, fill)
        x = jnp.concatenate([jnp.full_like(x[:, :c], fill), x, jnp.full_like(x[:, :c], fill)], 1)
        x = x.reshape(x.shape[0], nb + 2, c, *x.shape[2:])
        return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

    qb = pad_axis(q, 1, tp, 0).reshape(b, nb, c, kh, n // kh, h)
    kb, vb = around(k.astype(q.dtype), 0), around(v.astype(q.dtype), 0)  # [B, nb, 3c, K, H]
    logits = jnp.einsum("BNcKGH,BNsKH->BNKGcs", qb, kb) * scale
    rows = lambda x: pad_axis(x, 1, tp, 0).reshape(x.shape[0], nb, c)  # noqa: E731
    mask = around(vis.key_valid, False)[:, :, None, :]  # [B, nb, 1, 3c]
    if causal:
        qp, kp = rows(vis.q_positions), around(vis.k_positions, 0)
        mask = mask & (kp[:, :, None, :] <= qp[:, :, :, None])
    if vis.q_segments is not None:
        qs, ks = rows(vis.q_segments), around(vis.k_segments, 0)
        mask = mask & (qs[:, :, :, None] == ks[:, :, None, :])
    mask = mask[:, :, None, None]  # [B, nb, 1, 1, c, 3c]
    logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("BNKGcs,BNsKH->BNcKGH", probs.astype(q.dtype), vb)
    out = out.reshape(b, tp, n, h)[:, :t]
    masses = None
    if pool is not None:
        pb = around(pool.astype(jnp.float32), 0.0)  # [B, nb, 3c, P]
        masses = jnp.einsum("BNKGcs,BNsP->BNcP", lax.stop_gradient(probs), pb) / n
        masses = masses.reshape(b, tp, -1)[:, :t]
    return out, masses


# ---------------------------------------------------------------------------------------------
# flash: blocked attention with an online softmax and a recomputing backward pass


def _to_blocks(q, k, v, vis: Visibility, pool, cfg: Blocks):
    """Heads first and T, S padded to whole blocks: q [B, K, G, Tp, H], k and v [B, K, Sp, H],
    pool float32[B, Sp, P]. Padded keys are invalid; padded queries are dropped by the caller
    (so their output cotangent is zero)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    tp = -(-t // cfg.block_q) * cfg.block_q
    sp = -(-s // cfg.block_k) * cfg.block_k
    qg = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    qg = pad_axis(qg, 3, tp, 0)
    kt = pad_axis(k.transpose(0, 2, 1, 3), 2, sp, 0)
    vt = None if v is None else pad_axis(v.transpose(0, 2, 1, 3), 2, sp, 0)
    vis = Visibility(
        pad_axis(vis.key_valid, 1, sp, False),
        pad_axis(vis.q_positions, 1, tp, 0),
        pad_axis(vis.k_positions, 1, sp, 0),
        pad_axis(vis.q_segments, 1, tp, 0),
        pad_axis(vis.k_segments, 1, sp, 0),
    )
    if pool is not None:
        pool = pad_axis(pool.astype(jnp.float32), 1, sp, 0.0)
    return qg, kt, vt, vis, pool


def _flash(q, k, v, vis: Visibility, pool, cfg: Blocks):
    b, t, n, h = q.shape
    out, masses = _flash_kernel(cfg, *_to_blocks(q, k, v, vis, pool, cfg))
    out = out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return out, (None if masses is None else masses[:, :t])


def _blocked_masses(q, k, vis: Visibility, pool, cfg: Blocks):
    """Pool masses float32[B, T, P] alone, by the blocked forward pass without values (for
    kernels that return no log-sum-exp per row): a second pass over the logits, no [T, S]."""
    qg, kt, _, vis, pool = _to_blocks(q, k, None, vis, pool, cfg)
    _, _, masses = _flash_forward(
        cfg, lax.stop_gradient(qg), lax.stop_gradient(kt), None, vis, pool
    )
    return masses[:, : q.shape[1]]


def _flash_forward(cfg: Blocks, q, k, v, vis: Visibility, pool):
    """q [B, K, G, Tp, H], k and v [B, K, Sp, H], pool float32[B, Sp, P] or None.
    Returns out [B, K, G, Tp, H] (q's dtype; None when v is None), lse float32[B, K, G, Tp]
    (0 on rows that see no key) and heads-averaged pool masses float32[B, Tp, P] or None."""
    b, kh, g, tp, h = q.shape
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = tp // bq, k.shape[2] // bk
    f32 = jnp.float32

    def q_block(i):
        t0 = i * bq
        qb = lax.dynamic_slice_in_dim(q, t0, bq, axis=3)  # [B, K, G, bq, H]

        def k_block(j, carry):
            s0 = j * bk
            mask = visibility_mask(vis, cfg.causal, t0, bq, s0, bk, cfg.sliding)[:, None, None]

            def update(carry):
                m, total, acc, lp = carry
                kb = lax.dynamic_slice_in_dim(k, s0, bk, axis=2)  # [B, K, bk, H]
                s = jnp.einsum("BKGTH,BKSH->BKGTS", qb, kb, preferred_element_type=f32)
                s = jnp.where(mask, s * cfg.scale, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that saw no key yet
                p = jnp.exp(s - shift[..., None])  # 0 where masked
                corr = jnp.exp(m - shift)  # 0 while m is -inf
                total = total * corr + jnp.sum(p, axis=-1)
                if acc is not None:
                    vb = lax.dynamic_slice_in_dim(v, s0, bk, axis=2)
                    pv = jnp.einsum(
                        "BKGTS,BKSH->BKGTH", p.astype(v.dtype), vb, preferred_element_type=f32
                    )
                    acc = acc * corr[..., None] + pv
                if lp is not None:
                    pb = lax.dynamic_slice_in_dim(pool, s0, bk, axis=1)  # [B, bk, P]
                    lp = lp * corr[..., None] + jnp.einsum("BKGTS,BSP->BKGTP", p, pb)
                return m_new, total, acc, lp

            return lax.cond(jnp.any(mask), update, lambda c: c, carry)

        init = (
            jnp.full((b, kh, g, bq), -jnp.inf, f32),
            jnp.zeros((b, kh, g, bq), f32),
            None if v is None else jnp.zeros((b, kh, g, bq, h), f32),
            None if pool is None else jnp.zeros((b, kh, g, bq, pool.shape[-1]), f32),
        )
        m, total, acc, lp = lax.fori_loop(0, nk, k_block, init)
        seen = total > 0
        safe = jnp.where(seen, total, 1.0)
        out = None
        if acc is not None:
            out = jnp.where(seen[..., None], acc / safe[..., None], 0.0).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(safe), 0.0)
        masses = None
        if lp is not None:  # per head lp / l, then the mean over the K*G heads
            masses = jnp.mean(jnp.where(seen[..., None], lp / safe[..., None], 0.0), axis=(1, 2))
        return out, lse, masses

    out, lse, masses = lax.map(q_block, jnp.arange(nq))  # leading axis: query blocks
    if out is not None:
        out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, tp, h)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)
    if masses is not None:
        masses = jnp.moveaxis(masses, 0, 1).reshape(b, tp, -1)
    return out, lse, masses


def _flash_backward(cfg: Blocks, q, k, v, vis: Visibility, out, lse, d_out):
    """FlashAttention-2 backward: for each key block, a loop over query blocks recomputes the
    probabilities from lse; dK, dV accumulate per key block, dQ in a carried float32 buffer."""
    b, kh, g, tp, h = q.shape
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = tp // bq, k.shape[2] // bk
    f32 = jnp.float32
    d_all = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)  # D: [B, K, G, Tp]

    def k_block(dq, j):
        s0 = j * bk
        kb = lax.dynamic_slice_in_dim(k, s0, bk, axis=2)  # [B, K, bk, H]
        vb = lax.dynamic_slice_in_dim(v, s0, bk, axis=2)

        def q_block(i, carry):
            t0 = i * bq
            mask = visibility_mask(vis, cfg.causal, t0, bq, s0, bk, cfg.sliding)[:, None, None]

            def update(carry):
                dq, dk, dv = carry
                qb = lax.dynamic_slice_in_dim(q, t0, bq, axis=3)  # [B, K, G, bq, H]
                dob = lax.dynamic_slice_in_dim(d_out, t0, bq, axis=3)
                lse_b = lax.dynamic_slice_in_dim(lse, t0, bq, axis=3)
                d_b = lax.dynamic_slice_in_dim(d_all, t0, bq, axis=3)
                s = jnp.einsum("BKGTH,BKSH->BKGTS", qb, kb, preferred_element_type=f32)
                p = jnp.where(mask, jnp.exp(s * cfg.scale - lse_b[..., None]), 0.0)
                dv = dv + jnp.einsum(
                    "BKGTS,BKGTH->BKSH", p.astype(dob.dtype), dob, preferred_element_type=f32
                )
                dp = jnp.einsum("BKGTH,BKSH->BKGTS", dob, vb, preferred_element_type=f32)
                ds = (p * (dp - d_b[..., None]) * cfg.scale).astype(q.dtype)
                dk = dk + jnp.einsum("BKGTS,BKGTH->BKSH", ds, qb, preferred_element_type=f32)
                dq_b = lax.dynamic_slice_in_dim(dq, t0, bq, axis=3) + jnp.einsum(
                    "BKGTS,BKSH->BKGTH", ds, kb, preferred_element_type=f32
                )
                return lax.dynamic_update_slice_in_dim(dq, dq_b, t0, axis=3), dk, dv

            return lax.cond(jnp.any(mask), update, lambda c: c, carry)

        zeros = jnp.zeros((b, kh, bk, h), f32)
        dq, dk, dv = lax.fori_loop(0, nq, q_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(k_block, jnp.zeros(q.shape, f32), jnp.arange(nk))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)  # [nk, B, K, bk, H] -> [B, K, Sp, H]
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_kernel(cfg: Blocks, q, k, v, vis: Visibility, pool):
    """(out [B, K, G, Tp, H], masses float32[B, Tp, P] or None); masses carry no gradient."""
    out, _, masses = _flash_forward(cfg, q, k, v, vis, pool)
    return out, masses


def _flash_kernel_fwd(cfg, q, k, v, vis, pool):
    out, lse, masses = _flash_forward(cfg, q, k, v, vis, pool)
    return (out, masses), (q, k, v, vis, out, lse)


def _flash_kernel_bwd(cfg, residuals, cotangents):
    q, k, v, vis, out, lse = residuals
    d_out, _ = cotangents  # the statistics' cotangent is dropped: they are gradient-free
    dq, dk, dv = _flash_backward(cfg, q, k, v, vis, out, lse, d_out)
    return dq, dk, dv, None, None


_flash_kernel.defvjp(_flash_kernel_fwd, _flash_kernel_bwd)


# ---------------------------------------------------------------------------------------------
# kernels with a static mask: splash (TPU, Pallas) and cuDNN (GPU)


# ---------------------------------------------------------------------------------------------
# key masses: where a set of queries puts its attention (a diagnostic pass, no gradient)


def attend_key_masses(
    q, k, v, *, scale, key_valid, queries, implementation="xla", block=512, sliding=0
):
    """Causal self-attention (T == S, default positions) as `attend`, plus where the queries
    `queries` bool[B, T] put their attention: (out [B, T, N, H], masses float32[B, S]), masses
    = sum over those queries of the heads-averaged probabilities (gradient-free). "xla" sums
    the dense probabilities; the others run the blocked forward (the output and its
    log-sum-exps) and a blocked second pass over the logits that reuses those log-sum-exps,
    so no [T, S] array is built (splash and cudnn take the blocked form too: a diagnostic);
    sliding: as `attend`'s."""
    split = _split_of(q, k)
    if split is not None and split.ulysses:  # tokens <-> heads around it, as in `attend`
        axis = split.axis

        def body(q, k, v, key_valid, queries):
            q, k, v = _heads_to_tokens(axis, split.size, q, k, v)
            key_valid, queries = _gather_ints(axis, [key_valid, queries], q)
            out, masses = attend_key_masses(
                q, k, v, scale=scale, key_valid=key_valid, queries=queries,
                implementation=implementation, block=block, sliding=sliding,
            )  # fmt: skip
            masses = _devices_masses(split, masses)
            out = lax.optimization_barrier((out, masses))[0]
            return lax.all_to_all(out, axis, 1, 2, tiled=True), masses

        qkv, length = split.spec("rows", "length", "heads", None), split.spec("rows", "length")
        run = jax.shard_map(body, mesh=split.mesh, in_specs=(qkv, qkv, qkv, length, length),
                            out_specs=(qkv, length), check_vma=False)  # fmt: skip
        rows = q.shape[:2]
        valid = jnp.ones(rows, bool) if key_valid is None else jnp.broadcast_to(key_valid, rows)
        return run(q, k, v, valid, jnp.broadcast_to(queries, rows))
    b, t, n, h = q.shape
    vis = make_visibility(q, k, key_valid, None, None, None, None, True)
    chosen = jnp.broadcast_to(jnp.asarray(queries, bool), (b, t))
    if implementation == "xla":  # _xla's arithmetic, its probabilities kept
        kh = k.shape[2]
        qg = q.reshape(b, t, kh, n // kh, h)
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(q.dtype)) * scale
        mask = visibility_mask(vis, True, sliding=sliding)[:, None, None]
        logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(q.dtype), v.astype(q.dtype))
        p = lax.stop_gradient(probs)
        masses = jnp.einsum("BKGTS,BT->BS", p, chosen.astype(jnp.float32)) / n
        return out.reshape(b, t, n, h), masses
    cfg = Blocks(
        float(scale), True, max(1, min(block, t)), max(1, min(block, k.shape[1])), False, sliding
    )
    qg, kt, vt, vis_b, _ = _to_blocks(q, k, v, vis, None, cfg)
    out, lse, _ = _flash_forward(cfg, qg, kt, vt, vis_b, None)
    out = out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    chosen = pad_axis(chosen, 1, qg.shape[3], False)
    q_, k_ = lax.stop_gradient(qg), lax.stop_gradient(kt)
    return out, _blocked_key_masses(cfg, q_, k_, vis_b, lse, chosen)[:, : k.shape[1]]


def _blocked_key_masses(cfg: Blocks, q, k, vis: Visibility, lse, chosen):
    """q [B, K, G, Tp, H], k [B, K, Sp, H], lse float32[B, K, G, Tp] from the forward, chosen
    bool[B, Tp] -> float32[B, Sp]: per key block, a loop over the query blocks recomputes
    exp(logits - lse) and sums it over the chosen queries and the heads (mean over heads)."""
    b, kh, g, tp, _ = q.shape
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = tp // bq, k.shape[2] // bk

    def k_block(j):
        s0 = j * bk
        kb = lax.dynamic_slice_in_dim(k, s0, bk, axis=2)

        def q_block(i, acc):
            t0 = i * bq
            rows = lax.dynamic_slice_in_dim(chosen, t0, bq, axis=1)  # [B, bq]
            mask = visibility_mask(vis, True, t0, bq, s0, bk, cfg.sliding) & rows[:, :, None]

            def add(acc):
                qb = lax.dynamic_slice_in_dim(q, t0, bq, axis=3)
                lse_b = lax.dynamic_slice_in_dim(lse, t0, bq, axis=3)
                s = jnp.einsum("BKGTH,BKSH->BKGTS", qb, kb, preferred_element_type=jnp.float32)
                p = jnp.exp(s * cfg.scale - lse_b[..., None])
                return acc + jnp.sum(jnp.where(mask[:, None, None], p, 0.0), axis=(1, 2, 3))

            return lax.cond(jnp.any(mask), add, lambda a: a, acc)

        return lax.fori_loop(0, nq, q_block, jnp.zeros((b, bk), jnp.float32))

    masses = lax.map(k_block, jnp.arange(nk))  # [nk, B, bk]
    return jnp.moveaxis(masses, 0, 1).reshape(b, nk * bk) / (kh * g)
