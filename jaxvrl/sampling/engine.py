"""Slots that refill: a decode batch of `slots` rows over a paged KV cache.

The static sampler (`static.py`) decodes every row at once until its longest row ends: with
long-tailed completion lengths most rows idle at the end, and the cache holds `prompt +
max_new_tokens` positions for every row. Here (`prefill_slots`, then `decode_slots`; chosen
by `sampler.py` when `cfg.slots` is set):

- Each of the R prompts is prefilled once (its vision tower included) into pages of
  `page_size` positions that all its samples' page tables point at (shared, never written
  again). Work rows w = p * G + g (prompt-major, as the static sampler's rows) each take
  their first token from the prompt's last logits with their own key.
- `slots` rows decode together, each slot with `ceil(max_new_tokens / page_size)` pages of
  its own after its prompt's. When a row ends (EOS, or its last token), the next waiting
  work row takes its slot at once, in the same jitted loop (a device-side queue: every
  process takes the same decisions).
- Rows draw their tokens as the static sampler's do (`steps.pick`, `steps.row_keys`), so the
  completions, log-probs and attention masses depend on neither `slots`, the page size nor
  the mesh: the static sampler is this engine's reference.
- Decode attention reads pages through `jaxvrl.models.PagedKVCache`: in place by a paged
  kernel (TPUs; GPUs with decode_attention "gpu"), else gathered into the dense form (their
  reference); keys lie as the static cache holds them (`steps.key_layout`).

Shapes: R prompts of P tokens (left-padded), G samples each, W = R * G work rows, S slots,
N = max_new_tokens, ps = page_size; pp = ceil(P / ps) and pc = ceil(N / ps) pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxvrl.models import KVCache, PagedKVCache, continue_positions
from jaxvrl.parallel.sharding import constrain
from jaxvrl.sampling import steps
from jaxvrl.sampling.layout import compute_params, for_decode
from jaxvrl.sampling.steps import SampleOutput, SamplingConfig


@struct.dataclass
class SlotsCarry:
    """What `prefill_slots` hands `decode_slots`: `pages` (keys, values), each a tuple of one
    array per layer, [R * pp + S * pc, K, H, ps] and [R * pp + S * pc, K, ps, H] (the
    prompts' pages, then room for each slot's own); `prompt_valid` bool[R, width] the prompts'
    key mask; `pools` {name: bool[R, width]} or None; `start` int32[R] each prompt's next
    position; `keys` key[W] (`steps.row_keys`); `first_tok` int32[W], `first_lp` float32[W]
    each work row's first token and its log-prob (`first_ent` its entropy, with
    cfg.entropies); `limits` int[W] or None; `groups` int32[W] each work row's group (-1:
    none) and `need` int32[], or None: the loop stops once `need` groups have ended whole
    (`decode_slots`); `prompt_of` int32[W] the prompt each work row continues; `order`
    int32[W] the work rows in the order they take slots, or None: in index order; `routes` the
    prompts' recorded routes [R, P, L', k] or None (`SamplingConfig.routes`); `first_mass`
    (A_V, A_X) float32[R, L] of each prompt's last query with pools, else None; `loop` the
    decode loop's state where a call paused it (`decode_slots` with pause_at), else None.
    width = (pp + pc) * ps."""

    pages: tuple
    prompt_valid: jax.Array
    pools: dict | None
    start: jax.Array
    keys: jax.Array
    first_tok: jax.Array
    first_lp: jax.Array
    limits: jax.Array | None = None
    first_ent: jax.Array | None = None
    groups: jax.Array | None = None
    need: jax.Array | None = None
    prompt_of: jax.Array | None = None
    order: jax.Array | None = None
    routes: jax.Array | None = None
    first_mass: tuple | None = None
    loop: dict | None = None


# the loop state's entries with one row per slot: what `narrow_slots` gathers
PER_SLOT = ("row", "t", "next_tok", "next_lp", "next_ent", "table", "valid", "write")


def narrow_slots(carry: SlotsCarry, width: int) -> SlotsCarry:
    """A paused loop's state (`decode_slots` with pause_at) at `width` slots, its running
    slots first in slot order (each with its page table, keys' validity and write slot: no
    page moves). Every running slot must fit (pause_at <= width). One small program
    (`_narrow_rows`) gathers the slots' entries; the pages and outputs stay where they are."""
    loop = carry.loop
    rows = _narrow_rows({k: loop[k] for k in PER_SLOT if k in loop}, carry.keys.shape[0], width)
    return carry.replace(loop={**loop, **rows})


@functools.partial(jax.jit, static_argnums=(1, 2))
def _narrow_rows(slots: dict, work_rows: int, width: int) -> dict:
    order = jnp.argsort(slots["row"] >= work_rows, stable=True)[:width]  # running slots first
    return {k: v[order] for k, v in slots.items()}


def _by_rows(out: SampleOutput) -> SampleOutput:
    """The loop's outputs (written whole on every device, each slot to its row) split by
    work row over the mesh's row axes, as the prompts are: on a pod each process reads its
    own rows back (`runtime.host_local`)."""

    def rows(x, at=0):
        return None if x is None else constrain(x, (None,) * at + ("batch",))

    per_row = ("tokens", "logprobs", "mask", "truncated", "entropies", "ended", "routes")
    return out.replace(
        **{k: rows(getattr(out, k)) for k in per_row},
        vision_mass=rows(out.vision_mass, 1),
        text_mass=rows(out.text_mass, 1),
    )


def _check(cfg: SamplingConfig):
    if cfg.slots < 1 or cfg.page_size < 1:
        raise ValueError(f"slots and page_size must be positive, got {cfg.slots}, {cfg.page_size}")


def prefill_slots(
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
    limits=None,
    groups=None,
    need=None,
    prompt_of=None,
    order=None,
) -> SlotsCarry:
    """Traceable: the R prompts' prefill (once each) into pages, and every work row's first
    token: the carry `decode_slots` starts from. groups int[W] (-1: a row of no group) and
    need int[]: stop once `need` of the groups have ended whole (all their rows), leaving the
    other rows where they are (partial rollouts; `SampleOutput.ended` tells which ended);
    None: every row runs to its end. prompt_of int[W]: the prompt each work row samples (any
    number of rows per prompt, each with the key `steps.row_keys(rng, W, 1)` gives it);
    None: num_samples rows per prompt, prompt-major. order int[W]: the work rows in the order
    they take slots (a permutation; None: row 0 first), e.g. several processes' rows in turn."""
    _check(cfg)
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    r, p_len = input_ids.shape
    n, ps = cfg.max_new_tokens, cfg.page_size
    if prompt_of is None:
        g = num_samples
        prompt_of = jnp.arange(r * g, dtype=jnp.int32) // g
        keys = steps.row_keys(rng, r, g)  # [W]
    else:
        prompt_of = jnp.asarray(prompt_of, jnp.int32)
        keys = steps.row_keys(rng, prompt_of.shape[0], 1)
    s = min(cfg.slots, prompt_of.shape[0])
    pp, pc = -(-p_len // ps), -(-n // ps)
    width = (pp + pc) * ps  # a row's logical slots: its prompt's pages, then its own
    tcfg = model.config.text

    # one prefill per prompt, into a dense cache of the prompt's length
    out = model.forward(
        input_ids,
        attention_mask,
        position_ids,
        images=images,
        videos=videos,
        cache=KVCache.init(tcfg, r, p_len, model.dtype, key_layout=steps.key_layout(cfg)),
        pools=pools,
        return_logits=False,
        record_routes=steps.records_routes(model, cfg),
    )
    last = steps.logits(model, None, out.hidden[:, -1])[prompt_of]  # [W, V]
    first_tok, first_lp, first_ent = steps.pick(last, keys, 0, cfg)

    kv, hd = tcfg.num_key_value_heads, tcfg.head_dim
    gap = pp * ps - p_len

    def prompt_k(x):  # [R, K, H, P] -> [R * pp, K, H, ps]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, gap)))
        return x.reshape(r, kv, hd, pp, ps).transpose(0, 3, 1, 2, 4).reshape(r * pp, kv, hd, ps)

    def prompt_v(x):  # [R, K, P, H] -> [R * pp, K, ps, H]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, gap), (0, 0)))
        return x.reshape(r, kv, pp, ps, hd).transpose(0, 2, 1, 3, 4).reshape(r * pp, kv, ps, hd)

    def pages(cache, prompt, page):  # the prompts' pages, then the slots' own (zeros)
        return tuple(
            jnp.concatenate([prompt(x), jnp.zeros((s * pc, *page), x.dtype)]) for x in cache
        )

    if out.cache.key_layout == "BKSH":  # keys by slot (accelerators): paged as the values
        k_pages = pages(out.cache.k, prompt_v, (kv, ps, hd))
    else:
        k_pages = pages(out.cache.k, prompt_k, (kv, hd, ps))
    v_pages = pages(out.cache.v, prompt_v, (kv, ps, hd))
    tail = ((0, 0), (0, width - p_len))
    if pools is not None:
        pools = {k: jnp.pad(v.astype(bool), tail) for k, v in pools.items()}
    carry = SlotsCarry(
        pages=(),
        prompt_valid=jnp.pad(out.cache.key_mask, tail),
        pools=pools,
        start=jnp.sum(attention_mask, axis=1).astype(jnp.int32) + deltas,
        keys=keys,
        first_tok=first_tok,
        first_lp=first_lp,
        limits=limits,
        first_ent=first_ent,
        groups=None if groups is None else jnp.asarray(groups, jnp.int32),
        need=None if need is None else jnp.asarray(need, jnp.int32),
        prompt_of=prompt_of,
        order=None if order is None else jnp.asarray(order, jnp.int32),
        routes=None if out.routes is None else steps.step_routes(model, out.routes, r),
        first_mass=None if pools is None else steps.last_query_masses(out),
    )
    # on a prefill mesh, rows over its data and sequence axes: the decode mesh's rows
    pages = jax.tree.map(lambda x: for_decode(x, (None, "heads")), (k_pages, v_pages))
    return jax.tree.map(for_decode, carry).replace(pages=pages)


def decode_slots(
    graphdef,
    params,
    carry: SlotsCarry,
    decode_weights=None,
    *,
    cfg: SamplingConfig,
    pause_at: int = 0,
) -> tuple[SampleOutput, SlotsCarry]:
    """Traceable: every work row's decode steps in `cfg.slots` slots, from `prefill_slots`'
    carry. Returns (SampleOutput, the carry with the pages as the steps left them).

    pause_at > 0: the loop also stops once no work row waits and at most `pause_at` slots
    run, its state kept in the carry (`loop["paused"]` says whether it stopped so); given
    that carry (as it is, or `narrow_slots` to fewer slots) it goes on where it stopped. The
    SampleOutput is then the rows' so far. The rows draw the same tokens either way."""
    _check(cfg)
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    keys, pools, limits = carry.keys, carry.pools, carry.limits
    first_tok, first_lp, start = carry.first_tok, carry.first_lp, carry.start
    first_ent = carry.first_ent
    prompt_valid, prompt_of = carry.prompt_valid, carry.prompt_of
    k_pages, v_pages = carry.pages
    (r, width), w = prompt_valid.shape, keys.shape[0]
    n, ps = cfg.max_new_tokens, cfg.page_size
    s = min(cfg.slots, w) if carry.loop is None else carry.loop["row"].shape[0]
    pc = -(-n // ps)
    pp = width // ps - pc
    tcfg = model.config.text
    forms = steps.decode_forms(model, cfg, s, decode_weights)
    slot_ids = jnp.arange(s)

    def table(rows):  # the page tables of slots running work rows `rows` [S]
        prompt = prompt_of[jnp.minimum(rows, w - 1)]
        mine = r * pp + slot_ids[:, None] * pc + jnp.arange(pc)[None, :]
        return jnp.concatenate([prompt[:, None] * pp + jnp.arange(pp)[None, :], mine], axis=1)

    def valid(rows):
        return prompt_valid[prompt_of[jnp.minimum(rows, w - 1)]]

    layers = tcfg.num_hidden_layers if pools is not None else 0
    stops = carry.groups is not None
    if stops:  # rows of each group (the last entry: rows of no group)
        grp = jnp.where(carry.groups < 0, w, jnp.minimum(carry.groups, w))
        per_group = jnp.zeros((w + 1,), jnp.int32).at[grp].add(1)
        grouped = per_group[:w] > 0  # the groups that have rows

    def queued(i):  # the work row at queue place i (i < w)
        return i if carry.order is None else carry.order[i]

    if carry.loop is None:
        rows0 = queued(slot_ids)  # the first S work rows
        state = dict(
            table=table(rows0),
            valid=valid(rows0),
            write=jnp.full((s,), pp * ps),
            row=rows0,  # the work row each slot runs (w: idle)
            t=jnp.zeros((s,), jnp.int32),  # its token index
            next_tok=first_tok[rows0],
            next_lp=first_lp[rows0],
            queue=jnp.asarray(s, jnp.int32),  # the queue place of the next waiting row
            steps=jnp.zeros((), jnp.int32),
            # outputs, with a last row that idle slots write into
            tokens=jnp.full((w + 1, n), cfg.pad_token_id, jnp.int32),
            logprobs=jnp.zeros((w + 1, n), jnp.float32),
            mask=jnp.zeros((w + 1, n), jnp.float32),
            truncated=jnp.zeros((w + 1,), bool),
            ended=jnp.zeros((w + 1,), bool),
        )
        if stops:  # rows of each group not ended yet
            state["left"] = per_group
        if layers:  # token 0's masses: its prompt's last query's
            state["vmass"] = jnp.zeros((layers, w + 1, n), jnp.float32)
            state["xmass"] = jnp.zeros((layers, w + 1, n), jnp.float32)
            for name, first in zip(("vmass", "xmass"), carry.first_mass):
                state[name] = state[name].at[:, :w, 0].set(first[prompt_of].T)
        if cfg.entropies:
            state["next_ent"] = first_ent[rows0]
            state["entropies"] = jnp.zeros((w + 1, n), jnp.float32)
        if carry.routes is not None:  # each completion token's, as it is fed
            state["routes"] = jnp.zeros((w + 1, n, *carry.routes.shape[2:]), carry.routes.dtype)
    else:  # a paused loop goes on
        state = {k: v for k, v in carry.loop.items() if k != "paused"}
    key_layout = steps.key_layout(cfg)
    state["cache"] = PagedKVCache(
        k_pages, v_pages, state.pop("table"), state.pop("valid"), state.pop("write"),
        key_layout=key_layout,
    )  # fmt: skip
    eos = steps.eos_ids(cfg)

    def step(st):
        row, t = st["row"], st["t"]
        live = row < w
        safe = jnp.minimum(row, w - 1)
        prompt = prompt_of[safe]
        tok = jnp.where(live, st["next_tok"], cfg.pad_token_id)
        pos = continue_positions(model.position_rank, start[prompt] + t, 1)
        slot_pools = None if pools is None else {k: v[prompt] for k, v in pools.items()}
        o = model.forward(
            tok[:, None],
            live[:, None].astype(jnp.int32),
            pos,
            cache=st["cache"],
            pools=slot_pools,
            return_logits=False,
            step=forms,
            record_routes="routes" in st,
        )
        out_row = jnp.where(live, row, w)
        if "routes" in st:
            fed = steps.step_routes(model, o.routes, s)[:, 0]  # [S, L', k]
            new_routes = st["routes"].at[out_row, t].set(jnp.where(live[:, None, None], fed, 0))
        new = dict(st)
        new["tokens"] = st["tokens"].at[out_row, t].set(tok)
        new["logprobs"] = st["logprobs"].at[out_row, t].set(jnp.where(live, st["next_lp"], 0.0))
        new["mask"] = st["mask"].at[out_row, t].set(live.astype(jnp.float32))
        if "routes" in st:
            new["routes"] = new_routes
        if layers:  # the query fed (token t) predicts token t+1: its masses are t+1's
            at = (slice(None), out_row, t + 1)
            new["vmass"] = st["vmass"].at[at].set(o.vision_mass[:, :, 0], mode="drop")
            new["xmass"] = st["xmass"].at[at].set(o.text_mass[:, :, 0], mode="drop")
        nxt, nlp, nent = steps.pick(
            steps.logits(model, forms, o.hidden[:, 0]), keys[safe], t + 1, cfg
        )
        if cfg.entropies:
            written = jnp.where(live, st["next_ent"], 0.0)
            new["entropies"] = st["entropies"].at[out_row, t].set(written)
        is_eos = jnp.isin(tok, eos)
        last = t + 1 == n if limits is None else (t + 1 == n) | (t + 1 >= limits[safe])
        ended = live & (is_eos | last)
        new["truncated"] = st["truncated"].at[out_row].set(ended & ~is_eos)
        new["ended"] = st["ended"].at[out_row].set(ended)
        if stops:
            new["left"] = st["left"].at[jnp.where(ended, grp[safe], w)].add(-1)
        # ended slots take the next waiting rows, in slot order
        order = jnp.cumsum(ended) - 1
        take = st["queue"] + order
        refill = ended & (take < w)
        row2 = jnp.where(ended, jnp.where(refill, queued(jnp.minimum(take, w - 1)), w), row)
        new["queue"] = jnp.minimum(st["queue"] + jnp.sum(ended), w)
        new["row"] = row2
        new["t"] = jnp.where(ended, 0, t + 1)
        first = jnp.minimum(row2, w - 1)
        new["next_tok"] = jnp.where(refill, first_tok[first], nxt)
        new["next_lp"] = jnp.where(refill, first_lp[first], nlp)
        if cfg.entropies:
            new["next_ent"] = jnp.where(refill, first_ent[first], nent)
        c = o.cache
        new["cache"] = c.replace(
            table=jnp.where(refill[:, None], table(row2), c.table),
            valid=jnp.where(ended[:, None], valid(row2), c.valid),
            write=pp * ps + new["t"],
        )
        new["steps"] = st["steps"] + jnp.any(live).astype(jnp.int32)
        return new

    def running(st):
        if not stops:
            return jnp.any(st["row"] < w)
        whole = jnp.sum(grouped & (st["left"][:w] == 0))
        return jnp.any(st["row"] < w) & (whole < carry.need)

    def goes_on(st):
        if not pause_at:
            return running(st)
        few = (st["queue"] >= w) & (jnp.sum(st["row"] < w) <= pause_at)
        return running(st) & ~few

    k = max(1, cfg.check_every)
    st = jax.lax.while_loop(
        goes_on,
        lambda st: jax.lax.fori_loop(0, k, lambda _, x: step(x), st),
        state,
    )
    out = _by_rows(SampleOutput(
        tokens=st["tokens"][:w],
        logprobs=st["logprobs"][:w],
        mask=st["mask"][:w],
        truncated=st["truncated"][:w],
        steps=st["steps"],
        vision_mass=st["vmass"][:, :w] if layers else None,
        text_mass=st["xmass"][:, :w] if layers else None,
        entropies=st["entropies"][:w] if cfg.entropies else None,
        ended=st["ended"][:w],
        routes=None
        if carry.routes is None
        else jnp.concatenate([carry.routes[prompt_of], st["routes"][:w]], axis=1),
    ))  # fmt: skip
    c = st.pop("cache")
    loop = None
    if pause_at or carry.loop is not None:  # (a continued loop's state is donated: kept)
        loop = dict(st, table=c.table, valid=c.valid, write=c.write, paused=running(st))
    return out, carry.replace(pages=(c.k, c.v), loop=loop)
