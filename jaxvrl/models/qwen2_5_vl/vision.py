"""Qwen2.5-VL vision tower: patch embed, 2-D rotary, window/full attention blocks, 2x2 merger.

All images (or all videos) of a batch are packed into one sequence of patches, as the HF
processor emits them. Everything that depends on the grids (window permutation, rotary
positions, attention segments) is computed on the host by `vision_inputs` in numpy, so the
device program only sees arrays of static shape: a batch padded to `num_patches` compiles once.

Attention goes through `jaxvrl.models.attention.attend` with segment ids (one per window, or
one per frame in the full-attention blocks), never a [heads, N, N] mask. The tower runs on rows
of patches [B, N, ...]: the packed layout is one row, the per-row layout B rows, each attending
only within itself. A window is a run of at most `window_patches` consecutive patches (64 in
Qwen2.5-VL; padding is cut into windows as wide), so with any implementation but "xla" the
window blocks run the banded dense form of `attend`: each block of 64 patches against the
192 around it, a few plain kernels where a blocked kernel would loop over blocks that are
almost all skipped (the kernels with a static mask, "splash" and "cudnn", would compute all
N^2 pairs). The full-attention blocks run the model's kernel ("flash" in place of "cudnn",
whose segments would be a dense [N, N] mask); in the scan over blocks, a `lax.cond` on each
block's kind picks between the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.attention import attend
from jaxvrl.models.qwen2_5_vl.config import VisionConfig
from jaxvrl.models.qwen2_5_vl.layers import (
    GatedMLP,
    RMSNorm,
    apply_rope,
    attention_implementation,
    linear,
    remat,
    scan_layers,
    stacked,
)
from jaxvrl.parallel.sharding import constrain

# logical axes of the tower's stream of patches [B, N, D]
PATCHES = ("batch", "length", "act_embed")


@struct.dataclass
class VisionInputs:
    """Packed patches of several images/videos plus their host-computed layout.

    pixel_values:    float[N, C*T*P*P], patches in window order (`vision_inputs` reorders the
                     processor's; N may include padding, last).
    rot_pos:         int32[N, 2] (row, col) rotary position of each patch, window order.
    window_index:    int32[U] original merge unit at each window-order slot (U = N / merge unit).
    reverse_index:   int32[U] inverse permutation of window_index.
    full_segments:   int32[N] attention segment (one per image frame) in window order.
    window_segments: int32[N] attention segment (one per window) in window order.
    """

    pixel_values: jax.Array
    rot_pos: jax.Array
    window_index: jax.Array
    reverse_index: jax.Array
    full_segments: jax.Array
    window_segments: jax.Array


def stack_vision_inputs(rows: list[VisionInputs]) -> VisionInputs:
    """Per-row layout: stack rows of equal `num_patches` along a new leading batch axis."""
    return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def _rot_pos(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(row, col) of every patch, block-major over merge x merge blocks (HF order)."""
    out = []
    for t, h, w in grid_thw:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], -1), (t, 1)))
    return np.concatenate(out, 0) if out else np.zeros((0, 2), np.int64)


def _window_layout(grid_thw: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Window permutation of merge units and the window id of each unit, in window order.

    Windows are `window_size` pixels square; grids that do not divide the window get partial
    windows at the bottom/right edges (HF pads the index grid with -100 and drops those slots).
    """
    merge = cfg.spatial_merge_size
    ws = cfg.window_units
    index, window_ids, offset, next_window = [], [], 0, 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        idx = np.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = (-gh) % ws, (-gw) % ws
        # HF pads by ws - g % ws, which adds an all-padding window when g divides ws; empty
        # windows have no tokens, so padding by (-g) % ws gives the same layout.
        padded = np.pad(idx, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (gh + ph) // ws, (gw + pw) // ws
        padded = padded.reshape(t, nh, ws, nw, ws).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        wid = np.broadcast_to(np.arange(t * nh * nw).reshape(t, nh * nw, 1), padded.shape)
        keep = padded >= 0
        index.append(padded[keep] + offset)
        window_ids.append(wid[keep] + next_window)
        offset += t * gh * gw
        next_window += t * nh * nw
    if not index:
        return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    return np.concatenate(index), np.concatenate(window_ids)


def vision_inputs(
    pixel_values, grid_thw, cfg: VisionConfig, num_patches: int | None = None
) -> VisionInputs:
    """Host-side layout of packed patches (pixel_values in the processor's order). Pads to
    `num_patches` rows (a multiple of the merge unit) so that batches with different grids
    share one compiled program, and puts the patches in window order: the embedding is
    patch-wise, so reordering the pixels here is reordering its output, without a gather (and
    its backward scatter) in the program."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    pv = np.asarray(pixel_values)
    unit, merge = cfg.merge_unit, cfg.spatial_merge_size
    n_valid = int(np.sum(np.prod(grid, axis=-1))) if len(grid) else 0
    if pv.ndim != 2 or pv.shape[1] != cfg.patch_dim:
        raise ValueError(f"pixel_values must be [num_patches, {cfg.patch_dim}], got {pv.shape}")
    if np.any(grid[:, 1:] % merge):
        raise ValueError(f"grid_thw h and w must be multiples of {merge}, got {grid.tolist()}")
    if pv.shape[0] < n_valid:
        raise ValueError(f"pixel_values has {pv.shape[0]} rows but grid_thw needs {n_valid}")
    n = pv.shape[0] if num_patches is None else num_patches
    if n < n_valid or n % unit:
        raise ValueError(
            f"num_patches={n} must be >= {n_valid} and a multiple of the merge unit {unit}"
        )
    pv = np.concatenate([pv[:n_valid], np.zeros((n - n_valid, pv.shape[1]), pv.dtype)])

    win_index, win_ids = _window_layout(grid, cfg)
    n_units, n_valid_units = n // unit, n_valid // unit
    window_index = np.concatenate([win_index, np.arange(n_valid_units, n_units)])
    reverse_index = np.argsort(window_index)
    # One full-attention segment per (image, frame); padding gets its own segment.
    frame = np.repeat(
        np.arange(int(np.sum(grid[:, 0])) if len(grid) else 0),
        np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]) if len(grid) else [],
    )
    frame_units = np.concatenate([frame[::unit], np.full(n_units - n_valid_units, -1)])
    # win_ids is already in window order; frame ids are in processor order. Padding units get
    # windows of their own, as wide as whole ones, so every window is a run of at most
    # `window_patches` consecutive patches (what the banded attention relies on).
    first_pad = int(win_ids.max()) + 1 if len(win_ids) else 0
    pad_windows = first_pad + np.arange(n_units - n_valid_units) // cfg.window_units**2
    window_units = np.concatenate([win_ids, pad_windows])
    rot = np.concatenate([_rot_pos(grid, merge), np.zeros((n - n_valid, 2), np.int64)])
    rot = rot.reshape(n_units, unit, 2)[window_index].reshape(n, 2)
    return VisionInputs(
        pixel_values=pv.reshape(n_units, unit, -1)[window_index].reshape(n, -1),
        rot_pos=rot.astype(np.int32),
        window_index=window_index.astype(np.int32),
        reverse_index=reverse_index.astype(np.int32),
        full_segments=np.repeat(frame_units[window_index], unit).astype(np.int32),
        window_segments=np.repeat(window_units, unit).astype(np.int32),
    )


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs):
        d = cfg.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = linear(d, 3 * d, bias=True, **kw)
        self.proj = linear(d, d, bias=True, **kw)
        self.num_heads = cfg.num_heads

    def __call__(self, x, cos, sin, segments: Segments, *, implementation="xla", block=512):
        """x: [B, N, D]; cos/sin: float32[B, N, H]; segments: whom each patch attends to (a
        window or its frame); implementation, block: `attend`'s implementation and block size."""
        b, n, d = x.shape
        hd = d // self.num_heads
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q = apply_rope(q.astype(jnp.float32), cos, sin).astype(x.dtype)
        k = apply_rope(k.astype(jnp.float32), cos, sin).astype(x.dtype)

        def run(ids, window=None):
            out, _ = attend(
                q,
                k,
                v,
                scale=hd**-0.5,
                causal=False,
                q_segments=ids,
                k_segments=ids,
                implementation=implementation,
                block_q=block,
                block_k=block,
                window=window,  # "xla", the reference, does not read it
            )
            return out

        if segments.flag is None:  # which kind of block is known when tracing
            out = run(segments.frames) if segments.full else run(segments.windows, segments.window)
        elif implementation == "xla":  # one dense form, with the block's segment ids
            out = run(jnp.where(segments.flag, segments.frames, segments.windows))
        else:
            out = jax.lax.cond(
                segments.flag,
                lambda: run(segments.frames),
                lambda: run(segments.windows, segments.window),
            )
        return self.proj(out.reshape(b, n, d))


@struct.dataclass
class Segments:
    """Whom the patches of a block attend to: `frames` int32[B, N] (one id per image frame)
    in a full-attention block, else `windows` int32[B, N] (one id per window: runs of at
    most `window` consecutive patches). The kind of block: `flag` (a traced bool, inside the
    scan over blocks) or, where it is None, `full`."""

    frames: jax.Array
    windows: jax.Array
    flag: jax.Array | None = None
    full: bool = struct.field(pytree_node=False, default=False)
    window: int = struct.field(pytree_node=False, default=0)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, **kw)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True, **kw)

    def __call__(self, x, cos, sin, segments: Segments, *, implementation="xla", block=512):
        h = self.attn(self.norm1(x), cos, sin, segments, implementation=implementation, block=block)
        x = x + h
        return constrain(x + self.mlp(self.norm2(x)), PATCHES)


class PatchMerger(nnx.Module):
    """RMSNorm, then each 2x2 block of patches concatenated and projected by a GELU MLP."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs):
        kw = dict(bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6, param_dtype=param_dtype)
        self.hidden = cfg.hidden_size * cfg.merge_unit
        self.fc1 = linear(self.hidden, self.hidden, **kw)
        self.fc2 = linear(self.hidden, cfg.out_hidden_size, **kw)

    def __call__(self, x):
        """x: [..., N, D] -> [..., N / merge unit, out_hidden]."""
        x = self.ln_q(x).reshape(*x.shape[:-2], -1, self.hidden)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """Patch embedding, blocks and merger.

    scan_layers: the blocks are one `VisionBlock` with a leading block axis [depth, ...] on
    its parameters, run by one scan over all blocks; each block's flag (full attention or
    not, from `fullatt_block_indexes`) rides along as the scan's xs and picks its attention
    (`Segments`), the only difference between the two kinds: "xla" builds its mask from the
    selected segment ids, the other implementations take a `lax.cond` between the full
    blocks' kernel and the window blocks' banded form. Else `nnx.List` of blocks and a Python
    loop (the reference), each block's kind known when tracing.
    """

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs, scan_layers: bool = True):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.cfg = cfg
        self.patch_embed = linear(cfg.patch_dim, cfg.hidden_size, bias=False, **kw)
        bkw = dict(dtype=dtype, param_dtype=param_dtype)
        if scan_layers:
            self.blocks = stacked(lambda r: VisionBlock(cfg, rngs=r, **bkw), cfg.depth, rngs)
        else:
            self.blocks = nnx.List([VisionBlock(cfg, **kw) for _ in range(cfg.depth)])
        self.scan_layers = scan_layers
        self.merger = PatchMerger(cfg, **kw)
        self.dtype = dtype
        self.remat_policy = "none"  # see Qwen2_5_VL.set_remat_policy
        self.attention = "auto"  # see Qwen2_5_VL.set_attention
        self.attention_block = 512

    def rotary(self, rot_pos):
        """cos, sin: float32[..., N, head_dim] from (row, col) positions [..., N, 2] (axial 2-D
        rope)."""
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (
            self.cfg.rope_theta ** (jnp.arange(0, hd // 2, 2, dtype=jnp.float32) / (hd // 2))
        )
        freqs = rot_pos.astype(jnp.float32)[..., None] * inv_freq  # [..., N, 2, hd/4]
        freqs = freqs.reshape(*rot_pos.shape[:-1], -1)  # [..., N, hd/2]: rows then cols
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    def implementation(self) -> str:
        """The `attend` implementation of the tower's full-attention blocks: the model's, but
        "flash" for cuDNN (its segments would be a dense [N, N] mask). The window blocks run
        the banded dense form with every implementation but "xla" (the module docstring)."""
        name = attention_implementation(self.attention)
        return "flash" if name == "cudnn" else name

    def full_block(self, n: int) -> int:
        """Block size of the full-attention blocks' kernel over n patches: the model's
        `attention_block`, halved (down to 128) while padding n to whole blocks would add more
        than n / 16 (3,136 patches at 784 px: 256, padded to 3,328 rather than 3,584 with 512;
        and the 7B train step's compile for v5p-16 fell by 5 to 8 s)."""
        b = self.attention_block
        while b > 128 and (-n) % b > n // 16:
            b //= 2
        return b

    def __call__(self, vi: VisionInputs) -> jax.Array:
        """Merged patch embeddings in processor order: [N / merge unit, out_hidden] for packed
        inputs (pixel_values [N, C*T*P*P]), [B, N / merge unit, out_hidden] for per-row inputs
        (every field with a leading row axis)."""
        out = self.window_order(vi)
        index = jnp.asarray(vi.reverse_index)
        if out.ndim == 2:
            return out[index]
        return jnp.take_along_axis(out, index[:, :, None], axis=1)

    def window_order(self, vi: VisionInputs) -> jax.Array:
        """`__call__`'s embeddings in window order (the u-th is the processor's
        `window_index[u]`-th), as the blocks compute them."""
        cfg = self.cfg
        vi = jax.tree.map(jnp.asarray, vi)
        rows = vi.pixel_values.ndim == 3
        if not rows:
            vi = jax.tree.map(lambda a: a[None], vi)
        x = self.patch_embed(vi.pixel_values.astype(self.dtype))  # [B, N, D], window order
        x = constrain(x, PATCHES)
        cos, sin = self.rotary(vi.rot_pos)
        full = set(cfg.fullatt_block_indexes)
        block_call = functools.partial(
            VisionBlock.__call__,
            implementation=self.implementation(),
            block=self.full_block(x.shape[1]),
        )
        segments = Segments(vi.full_segments, vi.window_segments, window=cfg.window_patches)
        if self.scan_layers:
            call = remat(block_call, self.remat_policy, prevent_cse=False)

            def body(blk, x, is_full):
                return call(blk, x, cos, sin, segments.replace(flag=is_full)), None

            flags = jnp.asarray([i in full for i in range(cfg.depth)])
            x, _ = scan_layers(self.blocks, body, x, flags)
        else:
            call = remat(block_call, self.remat_policy)
            for i, blk in enumerate(self.blocks):
                x = call(blk, x, cos, sin, segments.replace(full=i in full))
        out = self.merger(x)
        return out if rows else out[0]
