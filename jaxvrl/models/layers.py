"""Building blocks shared by the vision tower and the text decoder.

Einsum letters: B batch, T query positions, S key positions, N query heads, K key/value heads,
G query heads per key/value head (N = K*G), H head dim, D model dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxvrl.models.attention import resolve
from jaxvrl.models.config import OFFLOADED, REMAT_POLICIES, checkpoint_policy
from jaxvrl.parallel.sharding import target_platform

_ACTS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(_ACTS)})")
    return _ACTS[name]


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, cast back, then scaled (HF's order of operations)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(dtype)
        return self.weight[...].astype(dtype) * y


class LayerNorm(nnx.Module):
    """LayerNorm with a scale `weight` and a `bias`, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


NORMS = {"rms": RMSNorm, "layer": LayerNorm}


def norm(kind: str, dim: int, eps: float, *, param_dtype=jnp.float32) -> nnx.Module:
    """An RMSNorm ("rms") or a LayerNorm ("layer") over the last axis."""
    if kind not in NORMS:
        raise ValueError(f"norm {kind!r} is not one of {sorted(NORMS)}")
    return NORMS[kind](dim, eps, param_dtype=param_dtype)


def linear(din: int, dout: int, *, bias: bool, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class MLP(nnx.Module):
    """fc2(act(fc1(x))): the plain MLP of ViT blocks and mergers."""

    def __init__(self, dim, hidden, act, *, bias, dtype, param_dtype, rngs, out=None):
        kw = dict(bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = linear(dim, hidden, **kw)
        self.fc2 = linear(hidden, dim if out is None else out, **kw)
        self.act = activation(act)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, dim, hidden, act, *, bias, dtype, param_dtype, rngs):
        kw = dict(bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(dim, hidden, **kw)
        self.up_proj = linear(dim, hidden, **kw)
        self.down_proj = linear(hidden, dim, **kw)
        self.act = activation(act)

    def gate_up(self, x):
        """(gate(x), up(x)) (a decode step's view may fuse the two)."""
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate) * up)


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(cfg, position_ids: jax.Array | None = None) -> jax.Array:
    """float32[head_dim / 2] rotary inverse frequencies of a TextConfig, scaled by its
    `rope_type` as transformers' `modeling_rope_utils` computes them: "linear" divides by the
    factor; "llama3" divides the low frequencies by it and blends the middle band; "dynamic"
    (NTK) raises the base once the call's longest position (max of position_ids + 1, over
    the whole batch) passes max_position_embeddings, so each call of the model (a forward
    pass, a prefill, a decode step) takes the frequencies of its own length, as HF does;
    "yarn" (arXiv 2309.00071) blends the interpolated and original frequencies over a linear
    ramp between the dimensions that turn beta_fast and beta_slow times within the original
    length (its cos/sin scale is `rope_attention_factor`)."""
    hd = cfg.head_dim
    exponent = jnp.arange(0, hd, 2, dtype=jnp.float32) / hd
    inv_freq = 1.0 / (cfg.rope_theta**exponent)
    kind, factor = cfg.rope_type, cfg.rope_factor
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        old = cfg.rope_original_max_position_embeddings
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return jnp.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(cfg, inv_freq)
    if kind == "dynamic":
        limit = cfg.max_position_embeddings
        if position_ids is None:
            return inv_freq
        seq_len = jnp.max(position_ids).astype(jnp.float32) + 1
        grown = jnp.maximum(seq_len, limit)
        base = cfg.rope_theta * ((factor * grown / limit) - (factor - 1)) ** (hd / (hd - 2))
        return jnp.where(seq_len > limit, 1.0 / (base**exponent), inv_freq)
    raise ValueError(f"rope_type {kind!r} is not one of {ROPE_TYPES}")


def _yarn_inv_freq(cfg, inv_freq: jax.Array) -> jax.Array:
    hd, base, old = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_position_embeddings

    def turns_at(rotations):  # the dimension that turns `rotations` times within `old`
        return hd * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_at(cfg.rope_beta_fast), turns_at(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(hd // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1.0 - ramp)


def rope_attention_factor(rope: dict, factor: float) -> float:
    """YaRN's cos/sin scale from config.json's rope parameters: `attention_factor` as given,
    else 0.1 ln(factor) + 1 (with mscale and mscale_all_dim: the ratio of the two such
    terms, each ln scaled by its own), as transformers resolves it."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def scale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return float(scale(mscale) / scale(all_dim))
    return scale()


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., T, heads, H]; cos/sin: [..., T, H] broadcast over heads."""
    return x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax in float32 over the last axis; fully masked rows give zeros, not NaN."""
    logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.where(mask, probs, 0.0)


def pool_masses(probs: jax.Array, pools: dict) -> tuple[jax.Array, jax.Array]:
    """Heads-averaged attention mass on the vision and text pools, renormalised over prompt keys.

    probs: float32[B, heads..., T, S] attention probabilities (any number of head axes).
    pools: {"vision", "text", "prompt"}: bool[B, S] key masks; "prompt" excludes the sink key.
    Returns (A_V, A_X): float32[B, T]. Rows whose prompt mass is 0 give 0.
    """
    head_axes = tuple(range(1, probs.ndim - 2))
    p = jnp.mean(probs, axis=head_axes)  # [B, T, S]
    f32 = jnp.float32
    tot = jnp.einsum("BTS,BS->BT", p, pools["prompt"].astype(f32))
    a_v = jnp.einsum("BTS,BS->BT", p, pools["vision"].astype(f32))
    a_x = jnp.einsum("BTS,BS->BT", p, pools["text"].astype(f32))
    safe = jnp.where(tot > 0, tot, 1.0)
    return jnp.where(tot > 0, a_v / safe, 0.0), jnp.where(tot > 0, a_x / safe, 0.0)


def attention_implementation(name: str) -> str:
    """The `jaxvrl.models.attention` implementation that `name` ("auto" or one of
    IMPLEMENTATIONS) stands for in the program being traced: "auto" follows the platform of the
    devices it is compiled for (the mesh in context), not the process's default backend."""
    return resolve(name, target_platform())


def remat(method, policy: str, prevent_cse: bool = True):
    """`method` (a Module method, called with the module first) under jax.checkpoint with the
    named policy, or unchanged for "none". Only differentiation sees a difference.

    The module is split into graph and state and merged inside the checkpoint (a pure
    function of arrays), so it also works on modules merged inside an outer jit/grad.
    prevent_cse: jax.checkpoint's; False inside a scan body, where the loop already keeps
    XLA from merging the recomputation with the forward pass.
    """
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy {policy!r} is not one of {REMAT_POLICIES}")
    if policy == "none":
        return method

    def call(module, *args):
        graphdef, state = nnx.split(module)

        def pure(state, x, *args):
            if policy == "offload":  # the layer's input, the one value its backward pass keeps
                x = checkpoint_name(x, OFFLOADED)
            return method(nnx.merge(graphdef, state), x, *args)

        policy_ = checkpoint_policy(policy)
        return jax.checkpoint(pure, policy=policy_, prevent_cse=prevent_cse)(state, *args)

    return call


def stacked(make, n: int, rngs: nnx.Rngs) -> nnx.Module:
    """`n` modules `make(rngs)` as one module whose variables have a leading axis of size n
    (the layer axis; each layer draws its own initial values), the Flax "scan over layers"
    construction."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(rngs):
        return make(rngs)

    return build(rngs)


def layer_at(module: nnx.Module, i: int) -> nnx.Module:
    """Layer i of a `stacked` module: a module of the same type on the i-th slice of every
    variable (a view for a Python loop over layers; the stacked arrays are not changed)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def scan_layers(module: nnx.Module, body, carry, xs=None):
    """jax.lax.scan of body(layer, carry, x) -> (carry, y) over the layers of a `stacked`
    module (and over the leading axis of `xs`): the layer program is traced and compiled
    once, whatever the number of layers. -> (carry, ys stacked on a leading layer axis)."""
    graphdef, state = nnx.split(module)

    def step(carry, inputs):
        layer_state, x = inputs
        return body(nnx.merge(graphdef, layer_state), carry, x)

    return jax.lax.scan(step, carry, (state, xs))
