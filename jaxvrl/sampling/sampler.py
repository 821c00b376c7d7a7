"""Jitted KV-cache sampler: prefill the prompt (vision tower once), then a `lax.while_loop`
over decode steps that stops as soon as every row has finished.

Shapes: B rows, P prompt length (left-padded), N = max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.qwen2_5_vl import KVCache, get_rope_index, vision_inputs

NEG_INF = -1e30


@struct.dataclass
class SampleOutput:
    """tokens int32[B, N] (pad after the end); logprobs float32[B, N] of the sampled tokens
    under logits / temperature (the full distribution, before top-k/top-p; temperature 0
    uses 1); mask float32[B, N] 1 up to and including the first EOS; truncated bool[B] (no
    EOS within N); vision_mass / text_mass float32[L, B, N] when pools were given."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    truncated: jax.Array
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # Tokens a completion must never contain (image/video pads, vision start/end): a sampled
    # pad token would be replaced by an image embedding in the training forward pass.
    suppress_token_ids: tuple[int, ...] = ()


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering; removed entries get NEG_INF. float32[B, V]."""
    if top_k and top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = (cum - probs) < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, NEG_INF, logits)
    return logits


def _pick(logits, rng, cfg: SamplingConfig):
    """Sample (or argmax) one token per row; returns (tokens int32[B], logprobs float32[B])."""
    temp = cfg.temperature if cfg.temperature > 0 else 1.0
    # The log-prob is that of the model's full distribution, so that it equals what a
    # teacher-forced forward pass (the trainer's old log-prob) computes.
    logp = jax.nn.log_softmax(logits / temp, axis=-1)
    if cfg.suppress_token_ids:
        logits = logits.at[:, jnp.asarray(cfg.suppress_token_ids)].set(NEG_INF)
    if cfg.temperature <= 0:
        tok = jnp.argmax(logits, axis=-1)
    else:
        tok = jax.random.categorical(rng, filter_logits(logits / temp, cfg.top_k, cfg.top_p))
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def sample(
    graphdef,
    params,
    input_ids,
    attention_mask,
    position_ids,
    deltas,
    rng,
    *,
    cfg: SamplingConfig,
    images=None,
    videos=None,
    pools=None,
) -> SampleOutput:
    """Traceable sampling core (jit it with `cfg` static; see `make_sampler`).

    input_ids, attention_mask: int[B, P] left-padded; position_ids int32[3, B, P] and deltas
    int32[B] from `get_rope_index`; images/videos: VisionInputs (packed or per row);
    pools: optional {"vision","text","prompt"} bool[B, P] for per-token attention masses.
    """
    model = nnx.merge(graphdef, params)
    b, p = input_ids.shape
    n = cfg.max_new_tokens
    cache = KVCache.init(model.config.text, b, p + n, model.dtype)
    if pools is not None:
        pools = {k: jnp.pad(v, ((0, 0), (0, n))) for k, v in pools.items()}
    out = model.forward(
        input_ids,
        attention_mask,
        position_ids,
        images=images,
        videos=videos,
        cache=cache,
        return_logits=False,
    )
    logits = model.logits(out.hidden[:, -1])
    start = jnp.sum(attention_mask, axis=1).astype(jnp.int32) + deltas  # next position
    eos = jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)
    n_layers = model.config.text.num_hidden_layers
    state = dict(
        i=jnp.zeros((), jnp.int32),
        cache=out.cache,
        logits=logits,
        done=jnp.zeros((b,), bool),
        tokens=jnp.full((b, n), cfg.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        mask=jnp.zeros((b, n), jnp.float32),
        rng=rng,
    )
    if pools is not None:
        state["vmass"] = jnp.zeros((n_layers, b, n), jnp.float32)
        state["xmass"] = jnp.zeros((n_layers, b, n), jnp.float32)

    def cond(s):
        return (s["i"] < n) & ~jnp.all(s["done"])

    def body(s):
        rng, key = jax.random.split(s["rng"])
        tok, lp = _pick(s["logits"], key, cfg)
        live = ~s["done"]
        tok = jnp.where(live, tok, cfg.pad_token_id)
        i = s["i"]
        new = dict(s)
        new["tokens"] = s["tokens"].at[:, i].set(tok)
        new["logprobs"] = s["logprobs"].at[:, i].set(jnp.where(live, lp, 0.0))
        new["mask"] = s["mask"].at[:, i].set(live.astype(jnp.float32))
        new["done"] = s["done"] | jnp.isin(tok, eos)
        pos = jnp.broadcast_to((start + i)[None, :, None], (3, b, 1))
        step = model.forward(
            tok[:, None],
            jnp.ones((b, 1), jnp.int32),
            pos,
            cache=s["cache"],
            pools=pools,
            return_logits=False,
        )
        new["cache"] = step.cache
        new["logits"] = model.logits(step.hidden[:, 0])
        if pools is not None:
            # masses of the query that *predicts* token i+1, i.e. the one fed at step i
            new["vmass"] = s["vmass"].at[:, :, i].set(step.vision_mass[:, :, 0])
            new["xmass"] = s["xmass"].at[:, :, i].set(step.text_mass[:, :, 0])
        new["i"] = i + 1
        new["rng"] = rng
        return new

    s = jax.lax.while_loop(cond, body, state)
    return SampleOutput(
        tokens=s["tokens"],
        logprobs=s["logprobs"],
        mask=s["mask"],
        truncated=~s["done"],
        vision_mass=s.get("vmass"),
        text_mass=s.get("xmass"),
    )


@functools.lru_cache(maxsize=64)
def make_sampler(graphdef, cfg: SamplingConfig):
    """A jitted `sample` for one model structure and sampling config; it compiles once per
    (batch, prompt length, patch bucket) shape."""
    return jax.jit(functools.partial(sample, graphdef, cfg=cfg))


def generate(
    model,
    input_ids,
    attention_mask,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids=(),
    rng=None,
    pixel_values=None,
    image_grid_thw=None,
    pixel_values_videos=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
    pad_token_id: int = 0,
    pools=None,
) -> SampleOutput:
    """Sample completions for left-padded prompts (numpy or jax arrays). Greedy when
    temperature == 0. Image/video pad and vision start/end tokens are never sampled."""
    cfg_m = model.config
    ids = np.asarray(input_ids)
    mask = np.asarray(attention_mask)
    pos, deltas = get_rope_index(
        ids, mask, cfg_m, image_grid_thw, video_grid_thw, second_per_grid_ts
    )
    images = videos = None
    if pixel_values is not None:
        images = jax.tree.map(
            jnp.asarray, vision_inputs(pixel_values, image_grid_thw, cfg_m.vision)
        )
    if pixel_values_videos is not None:
        videos = jax.tree.map(
            jnp.asarray, vision_inputs(pixel_values_videos, video_grid_thw, cfg_m.vision)
        )
    eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
    cfg = SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        eos_token_ids=eos,
        pad_token_id=pad_token_id,
        suppress_token_ids=(
            cfg_m.image_token_id,
            cfg_m.video_token_id,
            cfg_m.vision_start_token_id,
            cfg_m.vision_end_token_id,
        ),
    )
    graphdef, params = nnx.split(model)
    fn = make_sampler(graphdef, cfg)
    rng = jax.random.key(0) if rng is None else rng
    pools = None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()}
    return fn(
        params,
        jnp.asarray(ids),
        jnp.asarray(mask),
        jnp.asarray(pos),
        jnp.asarray(deltas),
        rng,
        images=images,
        videos=videos,
        pools=pools,
    )
