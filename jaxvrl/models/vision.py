"""The vision tower of the Qwen VL families: patch embed, 2-D rotary, window/full attention
blocks, 2x2 merger; optionally (Qwen3-VL) a patch bias, learned position embeddings
interpolated to each grid, and DeepStack: some blocks' outputs through mergers of their own.

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
from flax import nnx, struct

from jaxvrl.models.attention import attend
from jaxvrl.models.config import VisionConfig
from jaxvrl.models.layers import (
    MLP,
    GatedMLP,
    apply_rope,
    attention_implementation,
    linear,
    norm,
    remat,
    scan_layers,
    stacked,
)
from jaxvrl.models.patches import VisionInputs
from jaxvrl.parallel.sharding import constrain

# logical axes of the tower's stream of patches [B, N, D]
PATCHES = ("batch", "length", "act_embed")


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
        self.norm1 = norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.norm2 = norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, **kw)
        mlp = GatedMLP if cfg.mlp == "gated" else MLP
        self.mlp = mlp(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True, **kw)

    def __call__(self, x, cos, sin, segments: Segments, *, implementation="xla", block=512):
        h = self.attn(self.norm1(x), cos, sin, segments, implementation=implementation, block=block)
        x = x + h
        return constrain(x + self.mlp(self.norm2(x)), PATCHES)


class PatchMerger(nnx.Module):
    """The tower's norm, then each 2x2 block of patches concatenated and projected by a GELU
    MLP; postshuffle: the norm over the concatenated block instead (Qwen3-VL's DeepStack
    mergers)."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs, postshuffle=False):
        kw = dict(bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.hidden = cfg.hidden_size * cfg.merge_unit
        width = self.hidden if postshuffle else cfg.hidden_size
        self.ln_q = norm(cfg.norm, width, 1e-6, param_dtype=param_dtype)
        self.postshuffle = postshuffle
        self.fc1 = linear(self.hidden, self.hidden, **kw)
        self.fc2 = linear(self.hidden, cfg.out_hidden_size, **kw)

    def __call__(self, x):
        """x: [..., N, D] -> [..., N / merge unit, out_hidden]."""
        if self.postshuffle:
            x = self.ln_q(x.reshape(*x.shape[:-2], -1, self.hidden))
        else:
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

    Qwen3-VL's pieces, present where the config asks: a bias on the patch embedding,
    `pos_embed` (a square table bilinearly interpolated to each grid by the host's
    `VisionInputs.pos_index` / `pos_weight`) added to the patch embeddings, and
    `deepstack_merger_list`: the outputs of the `deepstack_visual_indexes` blocks, each
    through its own merger (`features`).
    """

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs, scan_layers: bool = True):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.cfg = cfg
        self.patch_embed = linear(cfg.patch_dim, cfg.hidden_size, bias=cfg.patch_bias, **kw)
        if cfg.num_position_embeddings:
            self.pos_embed = nnx.Embed(
                cfg.num_position_embeddings,
                cfg.hidden_size,
                dtype=dtype,
                param_dtype=param_dtype,
                embedding_init=nnx.initializers.normal(0.02),
                rngs=rngs,
            )
        bkw = dict(dtype=dtype, param_dtype=param_dtype)
        if scan_layers:
            self.blocks = stacked(lambda r: VisionBlock(cfg, rngs=r, **bkw), cfg.depth, rngs)
        else:
            self.blocks = nnx.List([VisionBlock(cfg, **kw) for _ in range(cfg.depth)])
        self.scan_layers = scan_layers
        self.merger = PatchMerger(cfg, **kw)
        if cfg.deepstack_visual_indexes:
            self.deepstack_merger_list = nnx.List(
                [PatchMerger(cfg, postshuffle=True, **kw) for _ in cfg.deepstack_visual_indexes]
            )
        self.dtype = dtype
        self.remat_policy = "none"  # see Model.set_remat_policy
        self.attention = "auto"  # see Model.set_attention
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
        return self.features(vi)[0]

    def features(self, vi: VisionInputs) -> tuple[jax.Array, jax.Array | None]:
        """(merged embeddings in window order, as `window_order`; the DeepStack levels
        [K, ...] of the same shape in the same order, or None without DeepStack)."""
        cfg = self.cfg
        vi = jax.tree.map(jnp.asarray, vi)
        rows = vi.pixel_values.ndim == 3
        if not rows:
            vi = jax.tree.map(lambda a: a[None], vi)
        x = self.patch_embed(vi.pixel_values.astype(self.dtype))  # [B, N, D], window order
        if cfg.num_position_embeddings:
            x = x + self.positions(vi).astype(x.dtype)
        x = constrain(x, PATCHES)
        cos, sin = self.rotary(vi.rot_pos)
        full = cfg.full_blocks
        block_call = functools.partial(
            VisionBlock.__call__,
            implementation=self.implementation(),
            block=self.full_block(x.shape[1]),
        )
        segments = Segments(vi.full_segments, vi.window_segments, window=cfg.window_patches)
        deep = list(cfg.deepstack_visual_indexes)
        if self.scan_layers:
            x, taken = self._scan_blocks(block_call, x, cos, sin, segments, full, deep)
        else:
            call = remat(block_call, self.remat_policy)
            taken = [None] * len(deep)
            for i, blk in enumerate(self.blocks):
                x = call(blk, x, cos, sin, segments.replace(full=i in full))
                if i in deep:
                    taken[deep.index(i)] = x
        out = self.merger(x)
        levels = None
        if deep:  # in block order, as transformers collects them (a repeated block once),
            # each through the merger at the block's first place in the list
            first = [deep.index(b) for b in sorted(set(deep))]
            levels = jnp.stack([self.deepstack_merger_list[k](taken[k]) for k in first])
        if rows:
            return out, levels
        return out[0], None if levels is None else levels[:, 0]

    def _scan_blocks(self, block_call, x, cos, sin, segments, full, deep):
        """The blocks as one scan; the DeepStack blocks' outputs [B, N, D] are written into
        a carried buffer of K + 1 slots (the last one takes every other block's). -> (x, the
        K outputs)."""
        cfg = self.cfg
        call = remat(block_call, self.remat_policy, prevent_cse=False)
        slot = [deep.index(i) if i in deep else len(deep) for i in range(cfg.depth)]
        flags = jnp.asarray([i in full for i in range(cfg.depth)])
        # every block's kind, known when tracing where no block has windows (no window branch)
        kind = (
            (lambda f: segments.replace(flag=f))
            if cfg.windowed
            else (lambda f: segments.replace(full=True))
        )
        if not deep:

            def body(blk, x, is_full):
                return call(blk, x, cos, sin, kind(is_full)), None

            return scan_layers(self.blocks, body, x, flags)[0], []

        def body(blk, carry, xs):
            x, buf = carry
            is_full, k = xs
            x = call(blk, x, cos, sin, kind(is_full))
            return (x, jax.lax.dynamic_update_index_in_dim(buf, x, k, 0)), None

        buf = jnp.zeros((len(deep) + 1, *x.shape), x.dtype)
        (x, buf), _ = scan_layers(self.blocks, body, (x, buf), (flags, jnp.asarray(slot)))
        return x, list(buf[: len(deep)])

    def positions(self, vi: VisionInputs) -> jax.Array:
        """float32[B, N, D]: each patch's learned position embedding, bilinearly interpolated
        from the square table: the sum of 4 rows by the host's indices and weights."""
        table = self.pos_embed.embedding[...].astype(jnp.float32)
        w = jnp.asarray(vi.pos_weight, jnp.float32)
        return jnp.sum(table[vi.pos_index] * w[..., None], axis=-2)
