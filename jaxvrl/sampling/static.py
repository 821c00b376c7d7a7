"""The static sampler: every row of a call decoded at once, over a dense KV cache.

`prefill` runs the vision tower and the prompts' prefill once (each prompt once, its cache
repeated to its G samples; or each of the already repeated rows), into a cache of
`prompt + max_new_tokens` positions per row: the carry (`StaticCarry`) that `decode` starts
from. `decode` picks token 0 from the prefill's last hidden state, then runs a
`lax.while_loop` of decode steps until every row has ended (checked every `check_every`
steps). Every row draws token i with its key folded with i (`steps.pick`), so the slots
engine (`engine.py`) draws the same tokens; `sampler.py` chooses between the two.

Shapes: R prompts of P tokens (left-padded), G samples each, B rows, N = max_new_tokens,
D hidden size, L decoder layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxvrl.models import KVCache, continue_positions
from jaxvrl.sampling import steps
from jaxvrl.sampling.layout import compute_params, for_decode
from jaxvrl.sampling.steps import SampleOutput, SamplingConfig


@struct.dataclass
class StaticCarry:
    """What `prefill` hands `decode`: the rows' KV cache (B rows of P + N positions, per
    layer), `last` float[B, D] the hidden state of each row's last prompt token (token 0 is
    picked from its logits), `start` int32[B] each row's next position, `keys` key[B]
    (`steps.row_keys`), `pools` {name: bool[B, P + N]} or None, `limits` int[B] or None,
    `routes` the prompts' recorded routes [B, P, L', k] or None (`SamplingConfig.routes`),
    `first_mass` (A_V, A_X) float32[B, L] of each row's last prompt query (the one that
    predicts token 0) with pools, else None."""

    cache: KVCache
    last: jax.Array
    start: jax.Array
    keys: jax.Array
    pools: dict | None = None
    limits: jax.Array | None = None
    routes: jax.Array | None = None
    first_mass: tuple | None = None
    # the decode loop's state where a call paused it (`decode` with pause_at), with "rows":
    # the output row of each of its rows (they are fewer once narrowed), else None
    loop: dict | None = None


# loop entries whose rows are their second axis (the others with rows: their first)
_LAYERS_FIRST = ("vmass", "xmass")


@functools.partial(jax.jit, static_argnums=1)
def narrow_rows(carry: StaticCarry, width: int) -> StaticCarry:
    """A paused loop (`decode` with pause_at) at `width` rows: its running rows first, in
    row order, with their caches, keys, positions and outputs so far (one program). Every
    running row must fit (pause_at <= width)."""
    order = jnp.argsort(carry.loop["done"], stable=True)[:width]  # running rows first

    def take(x, axis=0):
        return x if jnp.ndim(x) == 0 else x[order] if axis == 0 else x[:, order]

    loop = {k: take(v, 1 if k in _LAYERS_FIRST else 0) for k, v in carry.loop.items()}
    rest = jax.tree.map(take, carry.replace(loop=None))
    return rest.replace(loop=loop)


@jax.jit
def merge_rows(whole: SampleOutput, part: SampleOutput, rows) -> SampleOutput:
    """`whole` with the rows of `part` (a narrowed loop's output, its rows `rows` int[b] of
    whole's) written in, and part's decode steps."""

    def put(w, p, axis=0):
        if w is None or jnp.ndim(w) == 0:
            return p
        return w.at[rows].set(p) if axis == 0 else w.at[:, rows].set(p)

    fields = {k: put(getattr(whole, k), getattr(part, k)) for k in ("tokens", "logprobs",
              "mask", "truncated", "entropies", "routes", "ended", "steps")}  # fmt: skip
    fields.update({k: put(getattr(whole, k), getattr(part, k), 1)
                   for k in ("vision_mass", "text_mass")})  # fmt: skip
    return SampleOutput(**fields)


def prefill(
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
    num_samples: int = 1,
    prefill_once: bool = True,
    limits=None,
) -> StaticCarry:
    """Traceable (the arguments are `sampler.sample`'s): the vision tower and the prompts'
    prefill into a cache per row, repeated to the G samples of each prompt with
    `prefill_once`."""
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    rows, t = input_ids.shape
    g, n = num_samples, cfg.max_new_tokens
    expand = g if prefill_once else 1
    if not prefill_once and rows % g:
        raise ValueError(f"{rows} repeated rows are not groups of num_samples={g}")
    b = rows * expand
    # A cache per layer, with scanned layers too: prefill and decode steps loop over the
    # layers (per-layer slices of scanned parameters) and write each new key and value into
    # its layer's buffer in place. A stacked cache run through the decoder's scan made every
    # decode step write out the whole cache again (docs/scaling.md, scanned layers), and the
    # CPU decode forms read each layer's buffer as it lies.
    cache = KVCache.init(
        model.config.text, rows, t + n, model.dtype, key_layout=steps.key_layout(cfg)
    )
    record = steps.records_routes(model, cfg)
    out = model.forward(
        input_ids,
        attention_mask,
        position_ids,
        images=images,
        videos=videos,
        cache=cache,
        pools=pools,
        return_logits=False,
        record_routes=record,
    )
    routes = _repeat(steps.step_routes(model, out.routes, rows), expand) if record else None
    first = None
    if pools is not None:
        pools = {k: _repeat(jnp.pad(v, ((0, 0), (0, n))), expand) for k, v in pools.items()}
        first = steps.last_query_masses(out, expand)
    carry = StaticCarry(
        # One copy of the prompt's cache per sample: decode steps write each row's own slots
        # (the slots engine shares a prompt's pages between its samples instead).
        cache=_repeat_cache(out.cache, expand),
        last=_repeat(out.hidden[:, -1], expand),
        start=_repeat(jnp.sum(attention_mask, axis=1).astype(jnp.int32) + deltas, expand),
        keys=steps.row_keys(rng, b // g, g),
        pools=pools,
        limits=limits,
        routes=routes,
        first_mass=first,
    )
    # on a prefill mesh, rows over its data and sequence axes: the decode mesh's rows
    cache = carry.cache
    kv = dict(
        k=tuple(for_decode(x, ("batch", "heads")) for x in cache.k),
        v=tuple(for_decode(x, ("batch", "heads")) for x in cache.v),
    )
    carry = jax.tree.map(for_decode, carry.replace(cache=cache.replace(k=(), v=())))
    return carry.replace(cache=carry.cache.replace(**kv))


def decode(
    graphdef,
    params,
    carry: StaticCarry,
    decode_weights=None,
    *,
    cfg: SamplingConfig,
    pause_at: int = 0,
) -> tuple[SampleOutput, StaticCarry]:
    """Traceable: every row's decode steps from `prefill`'s carry. Returns (SampleOutput, the
    carry with the cache as the steps left it: jit it with the carry donated and the cache is
    updated in place).

    pause_at > 0: the loop also stops once at most `pause_at` rows run, its state kept in
    the carry (`loop["paused"]` says whether it stopped so); given that carry (as it is, or
    `narrow_rows` to fewer rows) it goes on where it stopped, and its SampleOutput holds the
    carry's rows (`loop["rows"]` of the call's: `merge_rows`)."""
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    keys, pools, n = carry.keys, carry.pools, cfg.max_new_tokens
    forms = steps.decode_forms(model, cfg, keys.shape[0], decode_weights)
    if carry.loop is None:
        # token 0 is picked from the prefill's last logits; each decode step then feeds token
        # i and picks token i+1 from the new logits, so no [B, V] array is carried
        tok, lp, ent = steps.pick(steps.logits(model, forms, carry.last), keys, 0, cfg)
        layers = model.config.text.num_hidden_layers if pools is not None else 0
        state = _loop_state(carry.cache, tok, lp, n, cfg, layers, ent)
        if layers:  # token 0's masses: the prefill's last query's
            state["vmass"] = state["vmass"].at[:, :, 0].set(carry.first_mass[0].T)
            state["xmass"] = state["xmass"].at[:, :, 0].set(carry.first_mass[1].T)
        if carry.routes is not None:  # [B, N, L', k]: each completion token's, as it is fed
            b, _, *per_token = carry.routes.shape
            state["routes"] = jnp.zeros((b, n, *per_token), carry.routes.dtype)
        rows = jnp.arange(keys.shape[0], dtype=jnp.int32)
    else:  # a paused loop goes on
        state = {k: v for k, v in carry.loop.items() if k not in ("paused", "rows")}
        state["cache"], rows = carry.cache, carry.loop["rows"]
    step = functools.partial(
        _decode_step, model, forms, cfg, keys, carry.start, pools, limits=carry.limits
    )

    def running(s):
        return (s["i"] < n) & ~jnp.all(s["done"])

    def goes_on(s):
        return running(s) & (jnp.sum(~s["done"]) > pause_at) if pause_at else running(s)

    # `check_every` steps per while iteration (a fixed-trip inner loop): the done flag is read
    # once per chunk, which on GPUs saves a device-to-host sync per token.
    k = _chunk(n, cfg.check_every)
    s = jax.lax.while_loop(
        goes_on,
        lambda s: jax.lax.fori_loop(0, k, lambda _, s: step(s), s),
        state,
    )
    ended = jnp.any(jnp.isin(s["tokens"], steps.eos_ids(cfg)) & (s["mask"] > 0), axis=1)
    out = SampleOutput(
        tokens=s["tokens"],
        logprobs=s["logprobs"],
        mask=s["mask"],
        truncated=~ended,  # no EOS: ran to max_new_tokens or to the row's limit
        steps=s["i"],
        vision_mass=s.get("vmass"),
        text_mass=s.get("xmass"),
        entropies=s.get("entropies"),
        routes=None if carry.routes is None else jnp.concatenate([carry.routes, s["routes"]], 1),
    )
    loop = None
    if pause_at or carry.loop is not None:  # (a continued loop's state is donated: kept)
        loop = dict(s, paused=running(s), rows=rows)
        del loop["cache"]
    return out, carry.replace(cache=s["cache"], loop=loop)


def _repeat(x: jax.Array, g: int) -> jax.Array:
    """Each row (leading axis) repeated g times in a row (prompt-major)."""
    return x if g == 1 else jnp.repeat(x, g, axis=0)


def _repeat_cache(cache: KVCache, g: int) -> KVCache:
    """The prefill's per-layer cache of R prompts as R * g rows."""
    if g == 1:
        return cache
    k = tuple(_repeat(x, g) for x in cache.k)
    v = tuple(_repeat(x, g) for x in cache.v)
    return cache.replace(k=k, v=v, key_mask=_repeat(cache.key_mask, g))


def _loop_state(cache, tok, lp, n: int, cfg: SamplingConfig, layers: int = 0, ent=None) -> dict:
    """The decode loop's carry after the prefill: the cache, the picked first token and its
    log-prob [B] (and entropy, with cfg.entropies), and the outputs so far; with `layers`,
    the attention masses [L, B, N]."""
    b = tok.shape[0]
    state = dict(
        i=jnp.zeros((), jnp.int32),
        cache=cache,
        next_tok=tok,
        next_lp=lp,
        done=jnp.zeros((b,), bool),
        tokens=jnp.full((b, n), cfg.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        mask=jnp.zeros((b, n), jnp.float32),
    )
    if cfg.entropies:
        state["next_ent"] = jnp.zeros((b,), jnp.float32) if ent is None else ent
        state["entropies"] = jnp.zeros((b, n), jnp.float32)
    if layers:
        state["vmass"] = jnp.zeros((layers, b, n), jnp.float32)
        state["xmass"] = jnp.zeros((layers, b, n), jnp.float32)
    return state


def abstract_loop_state(model_config, rows: int, prompt_len: int, cfg: SamplingConfig, dtype):
    """Shapes of the decode loop's carry for `rows` prompts of `prompt_len` tokens (the cache
    holds prompt_len + max_new_tokens positions, per layer as `prefill` makes it), for
    `decode_step`."""
    n = cfg.max_new_tokens

    def make():
        # as the prefill leaves it: written (decode steps attend over it)
        layout = steps.key_layout(cfg)
        cache = KVCache.init(model_config.text, rows, prompt_len + n, dtype, key_layout=layout)
        cache = cache.replace(empty=False)
        tok, lp = jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.float32)
        return _loop_state(cache, tok, lp, n, cfg)

    return jax.eval_shape(make)


def decode_step(graphdef, params, state: dict, start, rng, *, cfg: SamplingConfig) -> dict:
    """One decode step of `decode`'s loop as a program of its own (feed a token, write the
    cache, pick the next), with the stored weights: for pricing a step ahead of time
    (`jaxvrl.aot`); `decode` runs the same `_decode_step` inside its loop, on the parameters
    cast once to the compute dtype (`compute_params`: give them so cast, as the loop reads
    them)."""
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    stored = dataclasses.replace(cfg, decode_layout="model")
    rows = state["done"].shape[0]
    forms = steps.decode_forms(model, stored, rows, None)
    return _decode_step(model, forms, cfg, steps.row_keys(rng, rows, 1), start, None, state)


def _chunk(n: int, most: int) -> int:
    """Largest divisor of n that is <= most (so chunks never run past max_new_tokens)."""
    return max(d for d in range(1, max(1, min(n, most)) + 1) if n % d == 0)


def _decode_step(model, forms, cfg: SamplingConfig, keys, start, pools, s: dict, limits=None):
    """Write token i (picked at the previous step), feed it (one cache write), pick token i+1.

    Rows already done emit pad with mask 0 and logprob 0; a row whose limit (`limits` int[B],
    or None) is i + 1 is done after token i.
    """
    i = s["i"]
    live = ~s["done"]
    tok = jnp.where(live, s["next_tok"], cfg.pad_token_id)
    eos = steps.eos_ids(cfg)
    pos = continue_positions(model.position_rank, start + i, 1)
    # a row that has ended feeds a pad no query sees and sees no key itself: a decode kernel
    # reads nothing of its cache (`jaxvrl.models.cached_kernels`); its outputs are dropped
    cache = s["cache"]
    cache = cache.replace(key_mask=cache.key_mask & live[:, None])
    out = model.forward(
        tok[:, None],
        live[:, None].astype(jnp.int32),
        pos,
        cache=cache,
        pools=pools,
        return_logits=False,
        step=forms,
        record_routes="routes" in s,
    )
    logits = steps.logits(model, forms, out.hidden[:, 0])
    next_tok, next_lp, next_ent = steps.pick(logits, keys, i + 1, cfg)
    new = dict(
        s,
        i=i + 1,
        cache=out.cache,
        next_tok=next_tok,
        next_lp=next_lp,
        done=s["done"] | jnp.isin(tok, eos) | (False if limits is None else i + 1 >= limits),
        tokens=s["tokens"].at[:, i].set(tok),
        logprobs=s["logprobs"].at[:, i].set(jnp.where(live, s["next_lp"], 0.0)),
        mask=s["mask"].at[:, i].set(live.astype(jnp.float32)),
    )
    if cfg.entropies:
        new["next_ent"] = next_ent
        new["entropies"] = s["entropies"].at[:, i].set(jnp.where(live, s["next_ent"], 0.0))
    if "routes" in s:  # token i's routes (a done row's pad: 0)
        fed = steps.step_routes(model, out.routes, tok.shape[0])[:, 0]  # [B, L', k]
        fed = jnp.where(live[:, None, None], fed, 0)
        new["routes"] = s["routes"].at[:, i].set(fed)
    if pools is not None:
        # the query fed at step i (token i) predicts token i+1: its masses are token i+1's
        # (none after the last token)
        for name, mass in (("vmass", out.vision_mass), ("xmass", out.text_mass)):
            mass = jnp.where(live, mass[:, :, 0], 0.0)
            new[name] = s[name].at[:, :, i + 1].set(mass, mode="drop")
    return new
