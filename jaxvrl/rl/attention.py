"""Attention metrics, VGR token weights and the MDI balance reward (docs/algorithms.md,
from #attention-statistics to #vgr-token-weights).

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
    """Layers to average, int[...]. early/middle/late are np.array_split thirds (earlier thirds
    get the extra layer: L = 7 -> [0, 1, 2], [3, 4], [5, 6]); a third that would be empty
    (L < 3) is the last layer. last_k > 0 overrides layer_set (all layers if last_k >= L)."""
    if last_k and last_k > 0:
        return np.arange(max(num_layers - last_k, 0), num_layers)
    if layer_set == "all":
        return np.arange(num_layers)
    if layer_set not in LAYER_SETS:
        raise ValueError(f"layer set must be one of {LAYER_SETS}, got {layer_set!r}")
    third = np.array_split(np.arange(num_layers), 3)[LAYER_SETS.index(layer_set) - 1]
    return third if third.size else np.arange(num_layers - 1, num_layers)


def layer_mean(masses: jax.Array, layer_set: str = "all", last_k: int = 0) -> jax.Array:
    """Mean over the chosen layers: float32[L, B, T] -> float32[B, T]."""
    idx = layer_indices(masses.shape[0], layer_set, last_k)
    return jnp.mean(masses[idx].astype(jnp.float32), axis=0)


def _pool_sizes(n_vision, n_text):
    nv = jnp.asarray(n_vision).astype(jnp.float32)
    nx = jnp.asarray(n_text).astype(jnp.float32)
    return nv, nx, (nv > 0) & (nx > 0)


def per_token_vgr(
    vision_mass, text_mass, n_vision, n_text, layer_set="all", last_k=0, eps=1e-6
) -> jax.Array:
    """VGR_t = (A_X(t)/|X|) / (A_V(t)/|V| + eps): float32[B, T]. Above 1: text dominates.

    vision_mass, text_mass: float32[L, B, T]; n_vision, n_text: [B] pool sizes. Rows with an
    empty vision or text pool get the neutral VGR = 1 (hence token weight 1)."""
    nv, nx, ok = _pool_sizes(n_vision, n_text)
    a_v = layer_mean(vision_mass, layer_set, last_k)
    a_x = layer_mean(text_mass, layer_set, last_k)
    vgr = (a_x / jnp.maximum(nx, 1.0)[:, None]) / (a_v / jnp.maximum(nv, 1.0)[:, None] + eps)
    return jnp.where(ok[:, None], vgr, 1.0)


def _completion_means(vision_mass, text_mass, mask, layer_set, last_k):
    """Mean over completion tokens of the layer-averaged masses: (a_v [B], a_x [B])."""
    m = (mask > 0).astype(jnp.float32)
    cnt = jnp.maximum(jnp.sum(m, -1), 1.0)
    a_v = jnp.sum(layer_mean(vision_mass, layer_set, last_k) * m, -1) / cnt
    a_x = jnp.sum(layer_mean(text_mass, layer_set, last_k) * m, -1) / cnt
    return a_v, a_x


def sequence_mdi(
    vision_mass, text_mass, n_vision, n_text, mask, layer_set="all", last_k=0, eps=1e-6
) -> jax.Array:
    """MDI = (mean_t A_X/|X|) / (mean_t A_V/|V| + eps) over completion tokens: float32[B].

    NaN for rows without vision tokens, text tokens or completion tokens: no statistic, which
    mdi_balance_reward turns into the neutral reward 0."""
    nv, nx, ok = _pool_sizes(n_vision, n_text)
    a_v, a_x = _completion_means(vision_mass, text_mass, mask, layer_set, last_k)
    mdi = (a_x / jnp.maximum(nx, 1.0)) / (a_v / jnp.maximum(nv, 1.0) + eps)
    ok = ok & (jnp.sum(mask > 0, -1) > 0)
    return jnp.where(ok, mdi, jnp.nan)


def attention_metrics(
    vision_mass, text_mass, n_vision, n_text, mask, *, layer_set="all", last_k=0, eps=1e-6
) -> dict:
    """Attention diagnostics (VGR, MDI, AEI; arXiv 2508.10552) from the model's pool masses.

    vision_mass, text_mass: float32[L, B, T] (A_V, A_X per layer and query position); n_vision,
    n_text: [B] pool sizes |V|, |X|; mask: [B, T] completion mask. `layer_set` / `last_k`
    (last_k > 0 wins) choose the layers of vgr, mdi and the AEIs; mdi_early / mdi_middle /
    mdi_late always use the thirds of layer_indices. AEI of a modality = its share of the
    two pools' attention / its share of the two pools' tokens (1 = attention in proportion to
    token count). eps = 1e-6 keeps a vision-blind row finite.

    Returns float32 arrays: vgr [B, T] (1 for rows lacking a pool); mdi, mdi_early, mdi_middle,
    mdi_late, aei_vision, aei_text [B] (NaN for rows without image, text or completion
    tokens: no statistic); attn_vision, attn_text [B] (mean layer-averaged masses).
    """
    out = {"vgr": per_token_vgr(vision_mass, text_mass, n_vision, n_text, layer_set, last_k, eps)}
    args = (vision_mass, text_mass, n_vision, n_text, mask)
    out["mdi"] = sequence_mdi(*args, layer_set, last_k, eps)
    for name in ("early", "middle", "late"):
        out[f"mdi_{name}"] = sequence_mdi(*args, name, 0, eps)
    nv, nx, ok = _pool_sizes(n_vision, n_text)
    ok = ok & (jnp.sum(mask > 0, -1) > 0)
    a_v, a_x = _completion_means(vision_mass, text_mass, mask, layer_set, last_k)
    attn_v = a_v / jnp.maximum(a_v + a_x, eps)
    tok_v = nv / jnp.maximum(nv + nx, 1.0)
    nan = jnp.float32(jnp.nan)
    out["aei_vision"] = jnp.where(ok, attn_v / jnp.maximum(tok_v, eps), nan)
    out["aei_text"] = jnp.where(ok, (1.0 - attn_v) / jnp.maximum(1.0 - tok_v, eps), nan)
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
    """VGR token weights (docs/algorithms.md#vgr-token-weights): w_t = 1 / (VGR_t + eps),
    divided by its mean over the row's completion tokens, clipped to `clip`, then
    (smooth_sigma > 0, static) smoothed along t by a Gaussian of radius ceil(3 sigma)
    renormalised over the completion tokens it covers.

    vgr, mask: [B, T]; has_image: bool[B] or None. Rows without images get w = 1; a
    non-finite weight (NaN VGR) counts as 1. Returns float32[B, T], 0 on padding (the loss
    uses m * w in numerator and denominator). No gradient."""
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
    """balance = clip(1 - |ln MDI| / ln R, 0, 1); reward = 2 balance - 1 (-1 at MDI = 0: no
    attention on the text at all). Rows without statistics (NaN, inf, negative MDI) get 0,
    the neutral value. mdi: float32[B]; the tolerance ratio R > 1 (`mdi_balance_ratio`) is
    static. Returns float32[B]."""
    if not ratio > 1.0:
        raise ValueError(f"mdi_balance_ratio must be > 1, got {ratio}")
    mdi = jnp.asarray(mdi, jnp.float32)
    ok = jnp.isfinite(mdi) & (mdi >= 0)
    safe = jnp.where(ok & (mdi > 0), mdi, 1.0)
    balance = jnp.clip(1.0 - jnp.abs(jnp.log(safe)) / math.log(ratio), 0.0, 1.0)
    balance = jnp.where(mdi == 0, 0.0, balance)
    return jnp.where(ok, 2.0 * balance - 1.0, 0.0)
