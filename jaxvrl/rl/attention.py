"""Attention metrics, VGR token weights and the MDI balance reward (SPEC section 2).

Inputs are the model's per-layer pool masses A_V, A_X: float32[L, B, T] (heads-averaged,
sink dropped, renormalised over prompt keys) and the pool sizes |V|, |X|: [B].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

LAYER_SETS = ("all", "early", "middle", "late")


def layer_indices(num_layers: int, layer_set: str = "all", last_k: int = 0) -> np.ndarray:
    """Layers to average. early/middle/late are np.array_split thirds (earlier thirds get the
    extra layer when L is not divisible by 3); last_k > 0 overrides layer_set."""
    if last_k and last_k > 0:
        return np.arange(max(num_layers - last_k, 0), num_layers)
    if layer_set == "all":
        return np.arange(num_layers)
    if layer_set not in LAYER_SETS:
        raise ValueError(f"layer set must be one of {LAYER_SETS}, got {layer_set!r}")
    thirds = np.array_split(np.arange(num_layers), 3)
    return thirds[LAYER_SETS.index(layer_set) - 1]


def layer_mean(masses: jax.Array, layer_set: str = "all", last_k: int = 0) -> jax.Array:
    idx = layer_indices(masses.shape[0], layer_set, last_k)
    return jnp.mean(masses[idx], axis=0)


def per_token_vgr(
    vision_mass, text_mass, n_vision, n_text, layer_set="all", last_k=0, eps=1e-6
) -> jax.Array:
    """VGR_t = (A_X(t)/|X|) / (A_V(t)/|V| + eps): float32[B, T]. Above 1: text dominates."""
    a_v = layer_mean(vision_mass, layer_set, last_k)
    a_x = layer_mean(text_mass, layer_set, last_k)
    nv = jnp.maximum(n_vision.astype(jnp.float32), 1.0)[:, None]
    nx = jnp.maximum(n_text.astype(jnp.float32), 1.0)[:, None]
    return (a_x / nx) / (a_v / nv + eps)


def sequence_mdi(
    vision_mass, text_mass, n_vision, n_text, mask, layer_set="all", last_k=0, eps=1e-6
) -> jax.Array:
    """MDI = (mean_t A_X/|X|) / (mean_t A_V/|V| + eps) over completion tokens: float32[B].
    NaN for rows without vision tokens, text tokens or completion tokens (no statistics)."""
    m = (mask > 0).astype(jnp.float32)
    cnt = jnp.maximum(jnp.sum(m, -1), 1.0)
    a_v = jnp.sum(layer_mean(vision_mass, layer_set, last_k) * m, -1) / cnt
    a_x = jnp.sum(layer_mean(text_mass, layer_set, last_k) * m, -1) / cnt
    nv = n_vision.astype(jnp.float32)
    nx = n_text.astype(jnp.float32)
    mdi = (a_x / jnp.maximum(nx, 1.0)) / (a_v / jnp.maximum(nv, 1.0) + eps)
    ok = (nv > 0) & (nx > 0) & (jnp.sum(m, -1) > 0)
    return jnp.where(ok, mdi, jnp.nan)


def attention_metrics(vision_mass, text_mass, n_vision, n_text, mask, *, last_k=0, eps=1e-6):
    """Per-token VGR, sequence MDI (all / early / middle / late / last-k) and the attention
    efficiency index AEI = attention share / token share of each modality.

    Returns a dict of float32 arrays: vgr [B, T], mdi [B], mdi_early/mdi_middle/mdi_late [B],
    aei_vision [B], aei_text [B], attn_vision [B], attn_text [B] (mean masses).
    """
    out = {
        "vgr": per_token_vgr(vision_mass, text_mass, n_vision, n_text, "all", last_k, eps),
        "mdi": sequence_mdi(vision_mass, text_mass, n_vision, n_text, mask, "all", last_k, eps),
    }
    for name in ("early", "middle", "late"):
        out[f"mdi_{name}"] = sequence_mdi(
            vision_mass, text_mass, n_vision, n_text, mask, name, 0, eps
        )
    m = (mask > 0).astype(jnp.float32)
    cnt = jnp.maximum(jnp.sum(m, -1), 1.0)
    a_v = jnp.sum(layer_mean(vision_mass, "all", last_k) * m, -1) / cnt
    a_x = jnp.sum(layer_mean(text_mass, "all", last_k) * m, -1) / cnt
    nv, nx = n_vision.astype(jnp.float32), n_text.astype(jnp.float32)
    attn_share_v = a_v / jnp.maximum(a_v + a_x, eps)
    tok_share_v = nv / jnp.maximum(nv + nx, 1.0)
    out["aei_vision"] = attn_share_v / jnp.maximum(tok_share_v, eps)
    out["aei_text"] = (1.0 - attn_share_v) / jnp.maximum(1.0 - tok_share_v, eps)
    out["attn_vision"], out["attn_text"] = a_v, a_x
    return out


def _gaussian_smooth(w: jax.Array, m: jax.Array, sigma: float) -> jax.Array:
    """Gaussian smoothing along T, normalised over valid tokens only (radius ceil(3 sigma))."""
    radius = max(1, math.ceil(3 * sigma))
    offs = np.arange(-radius, radius + 1)
    kernel = np.exp(-0.5 * (offs / sigma) ** 2).astype(np.float32)
    t = w.shape[-1]
    num = jnp.zeros_like(w)
    den = jnp.zeros_like(w)
    wp = jnp.pad(w * m, ((0, 0), (radius, radius)))
    mp = jnp.pad(m, ((0, 0), (radius, radius)))
    for k, o in zip(kernel, offs):
        num = num + k * wp[:, radius + o : radius + o + t]
        den = den + k * mp[:, radius + o : radius + o + t]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), w)


def vgr_token_weights(
    vgr: jax.Array,
    mask: jax.Array,
    clip: tuple[float, float] = (0.2, 3.0),
    smooth_sigma: float = 0.0,
    has_image: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """w_t = 1 / (VGR_t + eps), divided by its mean over the row's completion tokens, clipped
    to `clip`, optionally Gaussian-smoothed along t. Rows without images get w = 1. Returns
    float32[B, T], 0 on padding (the loss uses m * w)."""
    m = (mask > 0).astype(jnp.float32)
    w = 1.0 / (vgr.astype(jnp.float32) + eps)
    w = jnp.where(jnp.isfinite(w), w, 1.0)
    mean = jnp.sum(w * m, -1, keepdims=True) / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0)
    w = jnp.clip(w / jnp.where(mean > 0, mean, 1.0), clip[0], clip[1])
    if smooth_sigma and smooth_sigma > 0:
        w = _gaussian_smooth(w, m, float(smooth_sigma))
    if has_image is not None:
        w = jnp.where(has_image[:, None], w, 1.0)
    return jax.lax.stop_gradient(w * m)


def mdi_balance_reward(mdi: jax.Array, ratio: float = 2.0) -> jax.Array:
    """balance = clip(1 - |ln MDI| / ln R, 0, 1); reward = 2 balance - 1. Rows without
    statistics (NaN, non-positive MDI) get 0, the neutral value."""
    mdi = jnp.asarray(mdi, jnp.float32)
    ok = jnp.isfinite(mdi) & (mdi > 0)
    safe = jnp.where(ok, mdi, 1.0)
    balance = jnp.clip(1.0 - jnp.abs(jnp.log(safe)) / math.log(ratio), 0.0, 1.0)
    return jnp.where(ok, 2.0 * balance - 1.0, 0.0)
