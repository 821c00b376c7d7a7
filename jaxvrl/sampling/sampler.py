"""Jitted KV-cache sampler: prefill the prompt (vision tower once), then a `lax.while_loop`
over decode steps that stops once every row has finished (checked every `check_every` steps).

Two entry points: `generate(model, ids, mask, ...)` on host arrays (HF-processor-style vision
inputs), and `Sampler(graphdef, cfg)`, the jitted `sample` over precomputed positions and
VisionInputs that the trainer calls with its own patch buckets. A program compiled for the
CPU takes its decode steps' forms from `sampling.cpu` (weights as rows or packed for the CPU
kernels, held in an explicit `DecodeWeights` that the caller keeps between calls); this file
chooses them, in `_decode_forms`, and nowhere else.

Groups: `sample(..., num_samples=G)` prefills each of R prompts once (vision tower included)
and decodes B = R * G rows from copies of its cache; every row draws with its own key
(`row_keys`: the call's key, prompt index, sample index, then the token index).

Shapes: B rows, P prompt length (left-padded), N = max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.qwen2_5_vl import KVCache, get_rope_index, stack_vision_inputs, vision_inputs
from jaxvrl.parallel import sharding
from jaxvrl.sampling import engine, rules
from jaxvrl.sampling.cpu import decode as cpu_decode
from jaxvrl.sampling.cpu import kernels as cpu_kernels
from jaxvrl.sampling.cpu.decode import DecodeWeights
from jaxvrl.sampling.layout import Layout, Preparer, compute_params
from jaxvrl.sampling.rules import NEG_INF


@struct.dataclass
class SampleOutput:
    """tokens int32[B, N] (pad after the end); logprobs float32[B, N] of the sampled tokens
    under logits / temperature (the full distribution, before top-k/top-p; temperature 0
    uses 1); mask float32[B, N] 1 up to and including the first EOS; truncated bool[B] (no
    EOS within N); vision_mass / text_mass float32[L, B, N] when pools were given; steps
    int32[]: decode steps run (< N when every row ended early)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    truncated: jax.Array
    steps: jax.Array | None = None
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
    # Decode steps between two checks of "every row is done" (a divisor of max_new_tokens is
    # used): fewer checks cost a few wasted steps at the end, save a host sync per token.
    check_every: int = 8
    # How decode steps multiply by the text decoder's and LM head's weights: "model" (the
    # stored [in, out] kernels), "transposed" ([out, in] copies made once per call, the weight
    # as the matmul's row operand: 1.7-1.9x faster M = B matmuls on XLA's CPU backend, at the
    # cost of a second copy of those weights during the call), "auto" (transposed in programs
    # compiled for the CPU: the mesh in context decides, not the host).
    decode_layout: str = "auto"
    # Rows decoded at once (`engine.py`): 0 decodes every row of a call together until the
    # longest ends (the static sampler); S > 0 decodes S rows, each ended row's slot taken by
    # the next waiting one, over a paged KV cache whose pages hold `page_size` positions
    # (a prompt's pages shared by its samples). The same completions either way.
    slots: int = 0
    page_size: int = 16


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering; removed entries get NEG_INF. float32[B, V]."""
    return rules.top_p_filter(rules.top_k_filter(logits, top_k), top_p)


def eos_ids(cfg: SamplingConfig) -> jax.Array:
    """int32[E]: the ids that end a row (-1, no token, where there are none)."""
    return jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)


def _filters(cfg: SamplingConfig, vocab: int) -> bool:
    """Whether top-k or top-p filtering changes the distribution."""
    return 0 < cfg.top_k < vocab or cfg.top_p < 1.0


def row_keys(rng: jax.Array, prompts: int, samples: int) -> jax.Array:
    """key[prompts * samples]: row p * samples + g's key, rng folded with p then g. A row's
    draws (`_pick`: this key folded with the token index) depend on neither how many rows a
    call holds nor how they are laid out (one prefill per prompt or repeated rows)."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    per_prompt = fold(rng, jnp.arange(prompts))
    return jax.vmap(fold, in_axes=(0, None))(per_prompt, jnp.arange(samples)).reshape(-1)


def _pick(logits, keys, index, cfg: SamplingConfig):
    """Sample (or argmax) token `index` of each row, row b with its key keys[b] (`row_keys`);
    returns (tokens int32[B], logprobs float32[B]).

    On one CPU device, greedy picks and unfiltered draws (no top-k, top-p) are one kernel
    each (`cpu_kernels.greedy_pick`, `categorical_pick`: the same inverse-CDF method and
    uniform numbers as `rules.categorical`). Otherwise suppressed ids are masked by a
    constant bool[V] that XLA fuses into the passes reading the logits: a scatter into (and
    gather from) logits split over a tensor axis cost the TPU decode step 140 MB per chip
    (7B, 64 rows on v5p-16), as much as half the cache of a layer. The log-prob's normaliser
    covers the suppressed ids too (the unmasked logits).
    """
    if logits.dtype == jnp.float32 and cpu_kernels.usable():
        if cfg.temperature <= 0:
            return cpu_kernels.greedy_pick(logits, cfg.suppress_token_ids)
        if not _filters(cfg, logits.shape[-1]):
            u = rules.row_uniforms(keys, index)
            return cpu_kernels.categorical_pick(logits, u, cfg.suppress_token_ids, cfg.temperature)
    temp = cfg.temperature if cfg.temperature > 0 else 1.0
    x = logits / temp if temp != 1.0 else logits
    allowed = x
    if cfg.suppress_token_ids:
        allowed = jnp.where(_suppressed(cfg.suppress_token_ids, x.shape[-1]), NEG_INF, x)
    if cfg.temperature <= 0:
        tok = rules.first_argmax(allowed)
    else:
        u = rules.row_uniforms(keys, index)
        tok = rules.categorical_from_uniform(u, filter_logits(allowed, cfg.top_k, cfg.top_p))
    # The log-prob is that of the model's full distribution, so that it equals what a
    # teacher-forced forward pass (the trainer's old log-prob) computes.
    return tok, rules.token_logprob(x, tok, 1.0)


def _suppressed(ids: tuple[int, ...], vocab: int) -> jax.Array:
    """bool[V], a constant of the program: True at the ids (those inside the vocabulary)."""
    mask = np.zeros((vocab,), bool)
    mask[[i for i in ids if 0 <= i < vocab]] = True
    return jnp.asarray(mask)


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
    decode_weights: DecodeWeights | None = None,
    num_samples: int = 1,
    prefill_once: bool = True,
    limits=None,
) -> SampleOutput:
    """Traceable sampling core: `prefill`, then `decode` (jit it with `cfg`, `num_samples`,
    `prefill_once` static; `Sampler` runs the two as programs of their own). Samples
    `num_samples` (G) completions of each of the R given rows.

    input_ids, attention_mask: int[R, T] left-padded; position_ids int32[3, R, T] and deltas
    int32[R] from `get_rope_index`; images/videos: VisionInputs (packed or per row);
    pools: optional {"vision","text","prompt"} bool[R, T] for per-token attention masses;
    decode_weights: the decode steps' weights prepared for the B decode rows
    (`Sampler.decode_weights`), or None: made here where the layout asks for them (see
    `SamplingConfig.decode_layout`).

    prefill_once: the R rows are R distinct prompts; the vision tower and the prefill run once
    per prompt and their cache, positions, pools and last hidden state are repeated to B =
    R * G rows (prompt-major: row p * G + g is prompt p's sample g). Otherwise the R rows are
    already repeated (B = R, each prompt's G rows adjacent) and each is prefilled: the same
    rows and per-row keys (`row_keys`), so the same tokens, at G times the prefill's cost.

    limits: optional int[B], the most tokens each output row may have (default: every row
    max_new_tokens); a row that reaches its limit without EOS ends truncated.
    """
    carry = prefill(
        graphdef,
        params,
        input_ids,
        attention_mask,
        position_ids,
        deltas,
        rng,
        cfg=cfg,
        images=images,
        videos=videos,
        pools=pools,
        num_samples=num_samples,
        prefill_once=prefill_once,
        limits=limits,
    )
    return decode(graphdef, params, carry, decode_weights, cfg=cfg)[0]


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
) -> dict:
    """A rollout's first program (traceable; the arguments are `sample`'s): the vision tower
    and the prompts' prefill, as the carry `decode` starts from (the rows' KV cache, their
    last hidden states, next positions, keys, pools and limits; with `cfg.slots`, the slot
    engine's pages: `engine.prefill_slots`)."""
    if cfg.slots and prefill_once:
        return engine.prefill_slots(
            graphdef,
            params,
            input_ids,
            attention_mask,
            position_ids,
            deltas,
            rng,
            cfg=cfg,
            images=images,
            videos=videos,
            pools=pools,
            num_samples=num_samples,
            limits=limits,
        )
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
    # decode step write out the whole cache again (the 7B decode step compiled for v5p-16:
    # 79.5 ms estimated and 210 s to compile, against 22.6 ms and 13 s with a buffer per layer), and the CPU
    # decode forms read each layer's buffer as it lies.
    cache = KVCache.init(model.config.text, rows, t + n, model.dtype)
    out = model.forward(
        input_ids,
        attention_mask,
        position_ids,
        images=images,
        videos=videos,
        cache=cache,
        return_logits=False,
    )
    if pools is not None:
        pools = {k: _repeat(jnp.pad(v, ((0, 0), (0, n))), expand) for k, v in pools.items()}
    return dict(
        # One copy of the prompt's cache per sample: decode steps write each row's own slots
        # (the slot engine shares a prompt's pages between its samples instead).
        cache=_repeat_cache(out.cache, expand),
        last=_repeat(out.hidden[:, -1], expand),  # token 0 is picked from its logits
        start=_repeat(jnp.sum(attention_mask, axis=1).astype(jnp.int32) + deltas, expand),
        keys=row_keys(rng, b // g, g),
        pools=pools,
        limits=limits,
    )


def decode(graphdef, params, carry: dict, decode_weights=None, *, cfg: SamplingConfig):
    """A rollout's second program (traceable): every row's decode steps from `prefill`'s
    carry. Returns (SampleOutput, the carry with the cache as the steps left it: jit it with
    the carry donated and the cache is updated in place)."""
    if "pages" in carry:
        return engine.decode_slots(graphdef, params, carry, decode_weights, cfg=cfg)
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    keys, pools, n = carry["keys"], carry["pools"], cfg.max_new_tokens
    forms = _decode_forms(model, cfg, keys.shape[0], decode_weights)
    # token 0 is picked from the prefill's last logits; each decode step then feeds token i
    # and picks token i+1 from the new logits, so no [B, V] array is carried between steps
    tok, lp = _pick(_logits(model, forms, carry["last"]), keys, 0, cfg)
    layers = model.config.text.num_hidden_layers if pools is not None else 0
    state = _loop_state(carry["cache"], tok, lp, n, cfg, layers)
    step = functools.partial(
        _decode_step, model, forms, cfg, keys, carry["start"], pools, limits=carry["limits"]
    )
    # `check_every` steps per while iteration (a fixed-trip inner loop): the done flag is read
    # once per chunk, which on GPUs saves a device-to-host sync per token.
    k = _chunk(n, cfg.check_every)
    s = jax.lax.while_loop(
        lambda s: (s["i"] < n) & ~jnp.all(s["done"]),
        lambda s: jax.lax.fori_loop(0, k, lambda _, s: step(s), s),
        state,
    )
    ended = jnp.any(jnp.isin(s["tokens"], eos_ids(cfg)) & (s["mask"] > 0), axis=1)
    out = SampleOutput(
        tokens=s["tokens"],
        logprobs=s["logprobs"],
        mask=s["mask"],
        truncated=~ended,  # no EOS: ran to max_new_tokens or to the row's limit
        steps=s["i"],
        vision_mass=s.get("vmass"),
        text_mass=s.get("xmass"),
    )
    return out, dict(carry, cache=s["cache"])


def _repeat(x: jax.Array, g: int) -> jax.Array:
    """Each row (leading axis) repeated g times in a row (prompt-major)."""
    return x if g == 1 else jnp.repeat(x, g, axis=0)


def _repeat_cache(cache: KVCache, g: int) -> KVCache:
    """The prefill's per-layer cache of R prompts as R * g rows."""
    if g == 1:
        return cache
    k = tuple(_repeat(x, g) for x in cache.k)
    v = tuple(_repeat(x, g) for x in cache.v)
    return KVCache(k=k, v=v, key_mask=_repeat(cache.key_mask, g), index=cache.index)


def _loop_state(cache, tok, lp, n: int, cfg: SamplingConfig, layers: int = 0) -> dict:
    """The decode loop's carry after the prefill: the cache, the picked first token and its
    log-prob [B], and the outputs so far; with `layers`, the attention masses [L, B, N]."""
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
    if layers:
        state["vmass"] = jnp.zeros((layers, b, n), jnp.float32)
        state["xmass"] = jnp.zeros((layers, b, n), jnp.float32)
    return state


def abstract_loop_state(model_config, rows: int, prompt_len: int, cfg: SamplingConfig, dtype):
    """Shapes of the decode loop's carry for `rows` prompts of `prompt_len` tokens (the cache
    holds prompt_len + max_new_tokens positions, per layer as `sample` makes it), for
    `decode_step`."""
    n = cfg.max_new_tokens

    def make():
        cache = KVCache.init(model_config.text, rows, prompt_len + n, dtype)
        tok, lp = jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.float32)
        return _loop_state(cache, tok, lp, n, cfg)

    return jax.eval_shape(make)


def decode_step(graphdef, params, state: dict, start, rng, *, cfg: SamplingConfig) -> dict:
    """One decode step of `sample`'s loop as a program of its own (feed a token, write the
    cache, pick the next), with the stored weights: for pricing a step ahead of time
    (`jaxvrl.aot`); `sample` runs the same `_decode_step` inside its loop, on the parameters
    cast once to the compute dtype (`compute_params`: give them so cast, as the loop reads
    them)."""
    model = nnx.merge(graphdef, compute_params(graphdef, params))
    stored = dataclasses.replace(cfg, decode_layout="model")
    rows = state["done"].shape[0]
    forms = _decode_forms(model, stored, rows, None)
    return _decode_step(model, forms, cfg, row_keys(rng, rows, 1), start, None, state)


def _chunk(n: int, most: int) -> int:
    """Largest divisor of n that is <= most (so chunks never run past max_new_tokens)."""
    return max(d for d in range(1, max(1, min(n, most)) + 1) if n % d == 0)


def _decode_step(model, forms, cfg: SamplingConfig, keys, start, pools, s: dict, limits=None):
    """Write token i (picked at the previous step), feed it (one cache write), pick token i+1.

    Rows already done emit pad with mask 0 and logprob 0; a row whose limit (`limits` int[B],
    or None) is i + 1 is done after token i.
    """
    i = s["i"]
    b = s["done"].shape[0]
    live = ~s["done"]
    tok = jnp.where(live, s["next_tok"], cfg.pad_token_id)
    eos = eos_ids(cfg)
    pos = jnp.broadcast_to((start + i)[None, :, None], (3, b, 1))
    out = model.forward(
        tok[:, None],
        jnp.ones((b, 1), jnp.int32),
        pos,
        cache=s["cache"],
        pools=pools,
        return_logits=False,
        forms=forms,
    )
    logits = _logits(model, forms, out.hidden[:, 0])
    next_tok, next_lp = _pick(logits, keys, i + 1, cfg)
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
    if pools is not None:
        # masses of the query fed at step i (token i), the one that predicts token i+1
        new["vmass"] = s["vmass"].at[:, :, i].set(out.vision_mass[:, :, 0])
        new["xmass"] = s["xmass"].at[:, :, i].set(out.text_mass[:, :, 0])
    return new


def _transposed_decode(cfg: SamplingConfig) -> bool:
    if cfg.decode_layout not in ("auto", "model", "transposed"):
        raise ValueError(f"decode_layout must be auto, model or transposed: {cfg.decode_layout!r}")
    if cfg.decode_layout == "auto":
        return sharding.target_platform() == "cpu"
    return cfg.decode_layout == "transposed"


def _prepare(graphdef, rows: int, params, reuse, *, cfg: SamplingConfig):
    """The decode weights for `rows` rows where the layout asks for them, else None."""
    if not _transposed_decode(cfg):
        return None
    return cpu_decode.prepare(nnx.merge(graphdef, params), rows, reuse)


def _decode_forms(model, cfg: SamplingConfig, rows: int, weights: DecodeWeights | None):
    """What decode steps use in place of the model's own modules, chosen here only: in
    programs compiled for the CPU (the mesh in context decides), the CPU cached attention,
    and with the transposed layout the decode weights (given, or prepared here); elsewhere
    None (the model's own layers)."""
    cpu = sharding.target_platform() == "cpu"
    if _transposed_decode(cfg):
        if weights is None:
            weights = cpu_decode.prepare(model, rows)
        elif weights.packed != cpu_decode.uses_kernel(rows, model.dtype):
            raise ValueError(
                f"decode_weights were prepared for {'at most' if weights.packed else 'more than'}"
                f" {cpu_kernels.MAX_ROWS} rows, this call has {rows}: prepare them for its rows "
                "(Sampler.decode_weights)"
            )
    else:
        weights = None
    if weights is None and not cpu:
        return None
    return cpu_decode.DecodeForms(weights, cpu_attention=cpu)


def _logits(model, forms, hidden: jax.Array) -> jax.Array:
    """float32[B, V] of a decode step: the decode weights' head where there is one, else the
    model's own head."""
    out = None if forms is None else forms.head(hidden)
    return model.logits(hidden) if out is None else out


class Sampler:
    """`sample` jitted for one model structure and sampling config, in one layout (mesh and
    compute dtype: `layout.py`); it owns its compiled programs (one per batch, prompt length
    and patch-bucket shape: `compiles()`).

        sampler = Sampler(graphdef, cfg, mesh, dtype="bfloat16")
        ready = sampler.prepare(params)  # once per rollout phase: LoRA merged, cast, resharded
        weights = sampler.decode_weights(ready, rows, reuse=weights)  # None off the CPU
        out = sampler(ready, ids, mask, positions, deltas, rng, images=..., pools=...,
                      decode_weights=weights, num_samples=G)

    Calls take the policy's parameters as they are (prepared on each call) or `prepare`d
    ones (`RolloutParams`, for every call of a phase); a sampler with the same layout (the
    greedy one) takes those too. On one device, without LoRA and in the model's dtype,
    `prepare` returns the parameters themselves.

    With num_samples=G the R given prompts are prefilled once each and sampled G times
    (B = R * G output rows, prompt-major; see `sample`); rows that are already repeated
    sample the same tokens with `prefill_once=False`, or as G = 1 calls of their own.

    The decode weights (on the CPU: the text decoder's and LM head's weights as rows, or
    packed for the CPU kernels) are an explicit pytree that the caller keeps and passes back
    as `reuse` for the next set of parameters: the packed buffer is then written in place
    rather than faulted in afresh (4 KiB pages: 40-60 ms for the 155 MB LM head of a 152k x
    256 model, about 1 s for Qwen2.5-0.5B's 2 GB). Without them a call prepares its own.
    With `mesh` (the rollout mesh: `layout.rollout_mesh`), programs are traced and run under
    it (activation constraints and the KV cache follow the rows' sharding and the tensor
    axis; CPU forms only on a one-device CPU mesh); dtype: the compute dtype of sampling
    (None: the model's).
    """

    def __init__(self, graphdef, cfg: SamplingConfig, mesh=None, dtype=None):
        self.graphdef, self.cfg, self.mesh = graphdef, cfg, mesh
        self.layout = Layout(mesh, None if dtype is None else jnp.dtype(dtype).name)
        self.prepare = Preparer(graphdef, self.layout)
        # a call runs two programs: the prefill, then the decode loop (the carry donated: the
        # loop writes the cache in place); `lower` gives the two as one program
        self._prefill = jax.jit(
            functools.partial(prefill, cfg=cfg),
            static_argnums=0,
            static_argnames=("num_samples", "prefill_once"),
        )
        self._decode = jax.jit(
            functools.partial(decode, cfg=cfg), static_argnums=0, donate_argnums=2
        )
        self._sample = jax.jit(
            functools.partial(sample, cfg=cfg),
            static_argnums=0,
            static_argnames=("num_samples", "prefill_once"),
        )
        self._prepare = jax.jit(
            functools.partial(_prepare, cfg=cfg), static_argnums=(0, 1), donate_argnums=3
        )

    def _mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def __call__(self, params, input_ids, *args, **kwargs) -> SampleOutput:
        return self.timed(params, input_ids, *args, **kwargs)[0]

    def timed(self, params, *args, decode_weights=None, **kwargs) -> tuple[SampleOutput, dict]:
        """`__call__`, and the seconds its two programs took: {"prefill_s", "decode_s"} (each
        waited for: the decode loop starts once the prefill is done; compiling included)."""
        ready = self.prepare(params)
        with self._mesh():
            t0 = time.perf_counter()
            carry = jax.block_until_ready(
                self._prefill(ready.graphdef, ready.params, *args, **kwargs)
            )
            t1 = time.perf_counter()
            out, _ = self._decode(ready.graphdef, ready.params, carry, decode_weights)
            out = jax.block_until_ready(out)
        return out, {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1}

    def decode_weights(self, params, rows: int, reuse: DecodeWeights | None = None):
        """The decode weights of `params` (as they are or prepared) for calls of `rows` rows,
        or None where decode steps use the model's own weights (programs for accelerators).
        `reuse` (the previous result) is donated: its buffer takes the new weights."""
        ready = self.prepare(params)
        with self._mesh():
            return self._prepare(ready.graphdef, rows, ready.params, reuse)

    def decode_rows(self, rows: int, prefill_once: bool = True) -> int:
        """The rows a call's decode steps run for `rows` output rows (what `decode_weights`
        are prepared for): its slots where it has them, else every row."""
        if self.cfg.slots and prefill_once:
            return min(rows, self.cfg.slots)
        return rows

    def compiles(self) -> int:
        """Prefill programs compiled so far (a run logs it: one per shape; each has its
        decode program)."""
        return self._prefill._cache_size()

    def lower(self, params, input_ids, *args, **kwargs):
        """The sampling program lowered for these (abstract) arguments, without running or
        keeping anything: for compiling it ahead of time (`jaxvrl.aot`)."""
        ready = self.prepare(params)
        with self._mesh():
            return self._sample.lower(ready.graphdef, ready.params, input_ids, *args, **kwargs)


def row_vision_inputs(pixel_values, grid_thw, input_ids, token_id, cfg, patch_bucket=None):
    """Per-row VisionInputs (leading axis B) from packed HF-style inputs, or None.

    Images are assigned to rows in order of their pad tokens (`token_id`) in input_ids int[B, P];
    every row is padded to the same number of patches: the largest row's, rounded up to a
    multiple of `patch_bucket` (default: the merge unit). Running the tower per row costs
    B * N^2 attention rather than (B * N)^2 for the packed layout.
    """
    if pixel_values is None:
        return None
    vcfg = cfg.vision
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pv = np.asarray(pixel_values)
    patches = np.prod(grid, axis=-1)
    tokens = patches // vcfg.merge_unit
    row_tokens = np.sum(np.asarray(input_ids) == token_id, axis=1)
    row = np.searchsorted(np.cumsum(row_tokens), np.cumsum(tokens) - tokens, side="right")
    if np.any(np.bincount(row, tokens, minlength=len(row_tokens)) != row_tokens):
        raise ValueError(f"grid_thw {grid.tolist()} does not match the pad tokens per row")
    row_patches = np.bincount(row, patches, minlength=len(row_tokens)).astype(np.int64)
    bucket = patch_bucket or vcfg.merge_unit
    if bucket % vcfg.merge_unit:
        raise ValueError(f"patch_bucket {bucket} must be a multiple of {vcfg.merge_unit}")
    n = max(bucket, -(-int(row_patches.max()) // bucket) * bucket)
    start = np.cumsum(patches) - patches
    rows = []
    for b in range(len(row_tokens)):
        items = np.flatnonzero(row == b)
        sel = [pv[start[i] : start[i] + patches[i]] for i in items]
        pvb = np.concatenate(sel) if sel else np.zeros((0, pv.shape[1]), pv.dtype)
        rows.append(vision_inputs(pvb, grid[items].reshape(-1, 3), vcfg, num_patches=n))
    return jax.tree.map(jnp.asarray, stack_vision_inputs(rows))


def generation_config(
    model_config,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids=(),
    pad_token_id: int = 0,
    decode_layout: str = "auto",
) -> SamplingConfig:
    """The SamplingConfig `generate` samples with: these settings, and the model's image/video
    pad and vision start/end tokens suppressed."""
    cfg_m = model_config
    if eos_token_ids is None:
        eos_token_ids = ()
    eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
    return SamplingConfig(
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
        decode_layout=decode_layout,
    )


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
    patch_bucket: int | None = None,
    decode_layout: str = "auto",
    sampler: Sampler | None = None,
    decode_weights: DecodeWeights | None = None,
    num_samples: int = 1,
    prefill_once: bool = True,
) -> SampleOutput:
    """Sample completions for left-padded prompts int[R, P] (numpy or jax arrays): R *
    num_samples rows, each prompt prefilled once (`sample`; prefill_once=False: the rows are
    already repeated, each prefilled).

    Greedy when temperature == 0. Image/video pad and vision start/end tokens are never
    sampled. Vision inputs are HF-processor style (packed pixel_values [N, C*T*P*P] with
    grid_thw [I, 3]); they are laid out per row and padded to a multiple of `patch_bucket`
    patches per row, so calls with different images compile once per bucket (with the same
    `sampler`). decode_layout: see `SamplingConfig.decode_layout`. sampler: a `Sampler` made
    for the same model and the config these arguments give (`generation_config`), to reuse
    its compiled programs across calls (default: a new one, compiled for this call);
    decode_weights: its `decode_weights` for these parameters and rows, kept by the caller.
    """
    cfg_m = model.config
    cfg = generation_config(
        cfg_m,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        decode_layout=decode_layout,
    )
    graphdef, params = nnx.split(model)
    if sampler is None:
        sampler = Sampler(graphdef, cfg)
    elif sampler.cfg != cfg or sampler.graphdef != graphdef:
        raise ValueError(
            f"generate: the sampler was made for {sampler.cfg}, this call asks for {cfg} "
            "(or another model structure)"
        )
    ids = np.asarray(input_ids)
    mask = np.asarray(attention_mask)
    pos, deltas = get_rope_index(
        ids, mask, cfg_m, image_grid_thw, video_grid_thw, second_per_grid_ts
    )
    images = row_vision_inputs(
        pixel_values, image_grid_thw, ids, cfg_m.image_token_id, cfg_m, patch_bucket
    )
    videos = row_vision_inputs(
        pixel_values_videos, video_grid_thw, ids, cfg_m.video_token_id, cfg_m, patch_bucket
    )
    rng = jax.random.key(0) if rng is None else rng
    pools = None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()}
    return sampler(
        params,
        jnp.asarray(ids),
        jnp.asarray(mask),
        jnp.asarray(pos),
        jnp.asarray(deltas),
        rng,
        images=images,
        videos=videos,
        pools=pools,
        decode_weights=decode_weights,
        num_samples=num_samples,
        prefill_once=prefill_once,
    )
