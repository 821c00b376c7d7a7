"""Jitted KV-cache sampler: prefill the prompt (vision tower once), then a `lax.while_loop`
over decode steps that stops once every row has finished (checked every `check_every` steps).

Two entry points: `generate(model, ids, mask, ...)` on host arrays (HF-processor-style vision
inputs), and `make_sampler(graphdef, cfg)`, the jitted `sample` over precomputed positions and
VisionInputs that the trainer calls with its own patch buckets.

Shapes: B rows, P prompt length (left-padded), N = max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxvrl.models.qwen2_5_vl import KVCache, get_rope_index, stack_vision_inputs, vision_inputs
from jaxvrl.models.qwen2_5_vl.layers import GatedMLP
from jaxvrl.models.qwen2_5_vl.text import Attention
from jaxvrl.parallel import sharding
from jaxvrl.sampling import cpu_kernels, rules
from jaxvrl.sampling.rules import NEG_INF


@struct.dataclass
class SampleOutput:
    """tokens int32[B, N] (pad after the end); logprobs float32[B, N] of the sampled tokens
    under logits / temperature (the full distribution, before top-k/top-p; temperature 0
    uses 1); mask float32[B, N] 1 up to and including the first EOS; truncated bool[B] (no
    EOS within N); vision_mass / text_mass float32[L, B, N] when pools were given; steps
    int32[]: decode steps run (< N when every row ended early); decode_buffer: the flat
    buffer the decode weights were packed into for the CPU kernels (`make_sampler` keeps it
    for the next call and returns None here)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    truncated: jax.Array
    steps: jax.Array | None = None
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None
    decode_buffer: jax.Array | None = None


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


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering; removed entries get NEG_INF. float32[B, V]."""
    return rules.top_p_filter(rules.top_k_filter(logits, top_k), top_p)


def _filters(cfg: SamplingConfig, vocab: int) -> bool:
    """Whether top-k or top-p filtering changes the distribution."""
    return 0 < cfg.top_k < vocab or cfg.top_p < 1.0


def _pick(logits, key, cfg: SamplingConfig):
    """Sample (or argmax) one token per row; returns (tokens int32[B], logprobs float32[B]).

    On one CPU device, greedy picks and unfiltered draws (no top-k, top-p) are one kernel
    each (`cpu_kernels.greedy_pick`, `categorical_pick`: the same inverse-CDF method and
    uniform numbers as `rules.categorical`). Otherwise suppressed ids are masked by a scatter
    of B x |ids| entries rather than a pass over V (the CPU decode step is a handful of
    passes over [B, V] besides the LM head); their logits are kept aside so that the
    log-prob's normaliser still covers them.
    """
    if logits.dtype == jnp.float32 and cpu_kernels.usable():
        if cfg.temperature <= 0:
            return cpu_kernels.greedy_pick(logits, cfg.suppress_token_ids)
        if not _filters(cfg, logits.shape[-1]):
            u = rules.uniform_per_row(key, logits.shape[0])
            return cpu_kernels.categorical_pick(logits, u, cfg.suppress_token_ids, cfg.temperature)
    temp = cfg.temperature if cfg.temperature > 0 else 1.0
    x = logits / temp if temp != 1.0 else logits
    masked = None
    if cfg.suppress_token_ids:
        ids = jnp.asarray(cfg.suppress_token_ids, jnp.int32)
        masked = x[:, ids]
        x = x.at[:, ids].set(NEG_INF)
    if cfg.temperature <= 0:
        tok = rules.first_argmax(x)
    else:
        tok = rules.categorical(key, filter_logits(x, cfg.top_k, cfg.top_p))
    # The log-prob is that of the model's full distribution, so that it equals what a
    # teacher-forced forward pass (the trainer's old log-prob) computes.
    return tok, rules.token_logprob(x, tok, 1.0, masked)


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
    decode_buffer=None,
) -> SampleOutput:
    """Traceable sampling core (jit it with `cfg` static; see `make_sampler`).

    input_ids, attention_mask: int[B, P] left-padded; position_ids int32[3, B, P] and deltas
    int32[B] from `get_rope_index`; images/videos: VisionInputs (packed or per row);
    pools: optional {"vision","text","prompt"} bool[B, P] for per-token attention masses;
    decode_buffer: float32[`decode_buffer_size`] to pack the decode weights into (donate it:
    its contents are overwritten), or None (a fresh one, returned in the output).
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
    # token 0 is picked from the prefill's last logits; each decode step then feeds token i
    # and picks token i+1 from the new logits, so no [B, V] array is carried between steps
    packer = None
    if _transposed_decode(cfg):
        packer = _Packer(b, model.dtype, decode_buffer)
        model = _with_transposed_weights(model, packer)  # the prefill above used the stored kernels
    tok, lp = _pick(_logits(model, out.hidden[:, -1]), jax.random.fold_in(rng, 0), cfg)
    layers = model.config.text.num_hidden_layers if pools is not None else 0
    state = _loop_state(out.cache, tok, lp, n, cfg, layers)
    start = jnp.sum(attention_mask, axis=1).astype(jnp.int32) + deltas  # next position
    step = functools.partial(_decode_step, model, cfg, rng, start, pools)
    # `check_every` steps per while iteration (a fixed-trip inner loop): the done flag is read
    # once per chunk, which on GPUs saves a device-to-host sync per token.
    k = _chunk(n, cfg.check_every)
    s = jax.lax.while_loop(
        lambda s: (s["i"] < n) & ~jnp.all(s["done"]),
        lambda s: jax.lax.fori_loop(0, k, lambda _, s: step(s), s),
        state,
    )
    return SampleOutput(
        tokens=s["tokens"],
        logprobs=s["logprobs"],
        mask=s["mask"],
        truncated=~s["done"],
        steps=s["i"],
        vision_mass=s.get("vmass"),
        text_mass=s.get("xmass"),
        decode_buffer=None if packer is None else packer.buf,
    )


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
    holds prompt_len + max_new_tokens positions), for `decode_step`."""
    n = cfg.max_new_tokens

    def make():
        cache = KVCache.init(model_config.text, rows, prompt_len + n, dtype)
        tok, lp = jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.float32)
        return _loop_state(cache, tok, lp, n, cfg)

    return jax.eval_shape(make)


def decode_step(graphdef, params, state: dict, start, rng, *, cfg: SamplingConfig) -> dict:
    """One decode step of `sample`'s loop as a program of its own (feed a token, write the
    cache, pick the next), with the stored weights: for pricing a step ahead of time
    (`jaxvrl.aot`); `sample` runs the same `_decode_step` inside its loop."""
    model = nnx.merge(graphdef, params)
    return _decode_step(model, cfg, rng, start, None, state)


def _chunk(n: int, most: int) -> int:
    """Largest divisor of n that is <= most (so chunks never run past max_new_tokens)."""
    return max(d for d in range(1, max(1, min(n, most)) + 1) if n % d == 0)


def _decode_step(model, cfg: SamplingConfig, rng, start, pools, s: dict) -> dict:
    """Write token i (picked at the previous step), feed it (one cache write), pick token i+1.

    Rows already done emit pad with mask 0 and logprob 0.
    """
    i = s["i"]
    b = s["done"].shape[0]
    live = ~s["done"]
    tok = jnp.where(live, s["next_tok"], cfg.pad_token_id)
    eos = jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)
    pos = jnp.broadcast_to((start + i)[None, :, None], (3, b, 1))
    out = model.forward(
        tok[:, None],
        jnp.ones((b, 1), jnp.int32),
        pos,
        cache=s["cache"],
        pools=pools,
        return_logits=False,
    )
    logits = _logits(model, out.hidden[:, 0])
    next_tok, next_lp = _pick(logits, jax.random.fold_in(rng, i + 1), cfg)
    new = dict(
        s,
        i=i + 1,
        cache=out.cache,
        next_tok=next_tok,
        next_lp=next_lp,
        done=s["done"] | jnp.isin(tok, eos),
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


def _rows_by_weight(w_rows: jax.Array, x: jax.Array) -> jax.Array:
    """x [..., K] times w_rows [N, K] -> [..., N].

    XLA's forms, for where the CPU kernel does not apply: for K <= _PRODUCT_MAX_K, sum_k
    w_rows[n, k] * x[m, k] as a product and a reduction over k, the middle axis of [N, K, M]
    (XLA's CPU backend runs it 1.2-1.4x faster than an M = B matmul); above it (w_rows @
    x^T)^T. Either way a barrier keeps XLA from folding the transpose back into the
    computation, which on the CPU re-packs the whole weight every call (the matmul) or makes
    the reduction's output [M, N] (the product), both much slower.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] <= _PRODUCT_MAX_K:
        y = jnp.sum(w_rows[:, :, None] * x2.T[None], axis=1)
    else:
        y = w_rows @ x2.T
    y = jax.lax.optimization_barrier(y).T
    return y.reshape(x.shape[:-1] + (w_rows.shape[0],))


# The product-and-reduce form is used up to this K. A 151936-row LM head at B = 8 on two AVX2
# cores, median of 30 (product vs matmul): K = 128 7.1 vs 9.5 ms, 256 12.1 vs 13.7, 512 23.0
# vs 21.5, 896 41.8 vs 33.8.
_PRODUCT_MAX_K = 384


class _Packer:
    """Where decode weights go for the CPU kernel: one after another into one flat float32
    buffer (`cpu_kernels.pack_into`), given (`buf`, reused from call to call) or made here.
    `enabled` is False where the kernel does not apply (`cpu_kernels.applies`). Nothing is
    packed until `buf` is first asked for, so tracing the swap only counts `size`."""

    def __init__(self, rows: int, dtype, buf=None):
        self.enabled = cpu_kernels.applies(rows, dtype or jnp.float32)
        self.size = 0
        self.pending = []  # (w, offset, columns) until `buf` is first asked for
        self._buf = buf

    def add(self, w, columns: bool) -> int:
        """The offset of w (rows [N, K], or columns [K, N] with `columns`) in `buf`."""
        k, n = w.shape if columns else w.shape[::-1]
        offset = self.size
        self.size += cpu_kernels.packed_size(n, k)
        self.pending.append((w, offset, columns))
        return offset

    @property
    def buf(self):
        """The buffer with every weight added so far packed in it."""
        if self.pending:
            if self._buf is None:
                self._buf = cpu_kernels.empty(self.size)
            elif self._buf.shape != (self.size,):
                raise ValueError(
                    f"decode_buffer {self._buf.shape} does not hold the decode weights "
                    f"({self.size} floats; see decode_buffer_size)"
                )
            for w, offset, columns in self.pending:
                self._buf = cpu_kernels.pack_into(self._buf, w, offset, columns=columns)
            self.pending = []
        return self._buf


class _RowsLinear(nnx.Module):
    """A linear layer for decode steps with its weight as rows [out, in], or in the CPU
    kernel's panels at its offset of `packer`'s buffer; `of(*lins)` stacks nnx.Linear layers
    that share their input into one ([sum of outs, in]) and returns their outputs as a tuple."""

    def __init__(self, w, bias=None, sizes=None, *, packer: _Packer | None = None, columns=False):
        """w: the weight as rows [out, in], or as columns [in, out] (an nnx.Linear kernel)
        with `columns`."""
        self.dtype = w.dtype
        self.n_out = int(w.shape[1] if columns else w.shape[0])
        self.sizes = tuple(sizes or (self.n_out,))
        self.packer = packer if packer is not None and packer.enabled else None
        if self.packer is not None:
            self.offset = self.packer.add(w, columns)
            self.kernel = None
        else:
            self.kernel = nnx.Variable(w.T if columns else w)
        self.bias = None if bias is None else nnx.Variable(bias)

    @classmethod
    def of(cls, *lins: nnx.Linear, packer: _Packer | None = None):
        dtype = lins[0].dtype or lins[0].kernel[...].dtype
        sizes = tuple(int(lin.kernel.shape[1]) for lin in lins)
        kernels = [lin.kernel[...].astype(dtype) for lin in lins]
        w = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels, axis=1)
        bias = None
        if any(lin.bias is not None for lin in lins):
            parts = [
                jnp.zeros((n,), dtype) if lin.bias is None else lin.bias[...]
                for lin, n in zip(lins, sizes)
            ]
            bias = jnp.concatenate(parts).astype(dtype)
        return cls(w, bias, sizes, packer=packer, columns=True)

    def __call__(self, x: jax.Array):
        if self.packer is not None:
            x2 = x.reshape(-1, x.shape[-1])
            y = cpu_kernels.rows_by_weight(self.packer.buf, x2, self.n_out, self.offset)
            y = y.reshape(x.shape[:-1] + (self.n_out,)).astype(self.dtype)
        else:
            y = _rows_by_weight(self.kernel[...], x.astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...]
        if len(self.sizes) == 1:
            return y
        return tuple(jnp.split(y, np.cumsum(self.sizes)[:-1], axis=-1))


class _DecodeAttention(Attention):
    """An Attention whose q, k and v projections are one `_RowsLinear`."""

    def __init__(self, attn: Attention, packer: _Packer):
        self.qkv = _RowsLinear.of(attn.q_proj, attn.k_proj, attn.v_proj, packer=packer)
        self.o_proj = attn.o_proj  # swapped by `_with_transposed_weights`
        self.n_heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim

    def project(self, x):
        return self.qkv(x)


class _DecodeMLP(GatedMLP):
    """A GatedMLP whose gate and up projections are one `_RowsLinear`."""

    def __init__(self, mlp: GatedMLP, packer: _Packer):
        self.gate_up_proj = _RowsLinear.of(mlp.gate_proj, mlp.up_proj, packer=packer)
        self.down_proj = mlp.down_proj  # swapped by `_with_transposed_weights`
        self.act = mlp.act

    def gate_up(self, x):
        return self.gate_up_proj(x)


def _plain(*mods) -> bool:
    return all(type(m) is nnx.Linear for m in mods)


def _with_transposed_weights(model, packer: _Packer):
    """The model (merged inside the trace) with the text decoder's plain nnx.Linear layers
    swapped for `_RowsLinear`s (q/k/v and gate/up each fused into one where all of them are
    plain; adapters such as LoRA keep their own path, their base linear swapped) and a
    `decode_head`: the LM head as a `_RowsLinear` (the tied embedding [V, D] is already rows).
    The weights are packed for the CPU kernel into `packer`'s buffer where it is enabled."""

    def swap(module):
        if isinstance(module, nnx.List):
            for c in module:
                swap(c)
            return
        for name, child in list(vars(module).items()):
            if type(child) is nnx.Linear:
                setattr(module, name, _RowsLinear.of(child, packer=packer))
            elif isinstance(child, nnx.Module):
                if type(child) is Attention and _plain(child.q_proj, child.k_proj, child.v_proj):
                    child = _DecodeAttention(child, packer)
                elif type(child) is GatedMLP and _plain(child.gate_proj, child.up_proj):
                    child = _DecodeMLP(child, packer)
                setattr(module, name, child)
                swap(child)

    swap(model.model)
    if model.config.tie_word_embeddings:
        emb = model.model.embed_tokens
        table = emb.embedding[...].astype(emb.dtype or emb.embedding[...].dtype)
        model.decode_head = _RowsLinear(table, packer=packer)
    elif type(model.lm_head) is nnx.Linear:
        model.decode_head = _RowsLinear.of(model.lm_head, packer=packer)
    return model


def _logits(model, hidden: jax.Array) -> jax.Array:
    """float32[B, V] of a decode step: the `decode_head` where `_with_transposed_weights`
    made one, else the model's own head."""
    head = getattr(model, "decode_head", None)
    if head is None:
        return model.logits(hidden)
    return head(hidden.astype(head.dtype)).astype(jnp.float32)


@functools.lru_cache(maxsize=64)
def make_sampler(graphdef, cfg: SamplingConfig):
    """`sample` jitted for one model structure and sampling config: call it like `sample`
    without graphdef and cfg. It compiles once per (batch, prompt length, patch bucket) shape;
    where decode steps use the CPU kernels, the buffer their weights are packed into is kept
    from one call to the next (`release_decode_buffer`)."""
    return _Sampler(graphdef, cfg)


class _Sampler:
    def __init__(self, graphdef, cfg: SamplingConfig):
        self.graphdef, self.cfg = graphdef, cfg
        self.fn = jax.jit(
            functools.partial(sample, graphdef, cfg=cfg), donate_argnames="decode_buffer"
        )
        self.sizes = {}  # (rows, parameter shapes) -> decode_buffer_size

    def __call__(self, params, input_ids, *args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, input_ids))):
            # inside the caller's own jit: no buffer to donate or keep (the program makes one)
            return self.fn(params, input_ids, *args, **kwargs).replace(decode_buffer=None)
        size = self._buffer_size(params, np.shape(input_ids)[0])
        out = self.fn(params, input_ids, *args, decode_buffer=_take_buffer(size), **kwargs)
        if out.decode_buffer is None:
            return out
        _SPARE[:] = [out.decode_buffer]
        return out.replace(decode_buffer=None)

    def _buffer_size(self, params, rows: int) -> int:
        key = (rows, tuple((x.shape, x.dtype) for x in jax.tree.leaves(params)))
        if key not in self.sizes:
            self.sizes[key] = decode_buffer_size(self.graphdef, params, rows, self.cfg)
        return self.sizes[key]

    def _cache_size(self) -> int:
        return self.fn._cache_size()

    def lower(self, params, input_ids, *args, **kwargs):
        """The sampling program lowered for these (abstract) arguments, without running or
        keeping anything: for compiling it ahead of time (`jaxvrl.aot`)."""
        return self.fn.lower(params, input_ids, *args, **kwargs)


# The decode buffer kept between sampler calls (at most one: the last call's). Packing the
# decode weights into a fresh buffer faults in its pages every call (4 KiB each: 40-60 ms for
# the 155 MB LM head of a 152k x 256 model, about 1 s for Qwen2.5-0.5B's 2 GB); a donated
# buffer that already has its pages costs only the copy. The price: one copy of the text
# decoder's weights stays allocated between calls.
_SPARE: list = []


def release_decode_buffer() -> None:
    """Free the decode buffer that samplers keep between calls (one copy of the decoder's
    float32 weights, on the CPU only)."""
    _SPARE.clear()


def _take_buffer(size: int):
    if not size:
        return None
    if _SPARE and _SPARE[0].shape == (size,):
        return _SPARE.pop()
    _SPARE.clear()  # never hold two
    return _empty(size)


@functools.partial(jax.jit, static_argnums=0)
def _empty(size: int):
    return cpu_kernels.empty(size)


def decode_buffer_size(graphdef, params, rows: int, cfg: SamplingConfig) -> int:
    """Floats of the buffer that `sample` packs the decode weights into for `rows` rows per
    step (0 where the CPU kernels do not apply); traces the packing, runs nothing."""
    if not _transposed_decode(cfg):
        return 0
    size = []

    def plan(params):
        model = nnx.merge(graphdef, params)
        packer = _Packer(rows, model.dtype)
        _with_transposed_weights(model, packer)
        size.append(packer.size)  # 0 where not enabled: nothing was added

    jax.eval_shape(plan, params)
    return size[0]


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
) -> SampleOutput:
    """Sample completions for left-padded prompts int[B, P] (numpy or jax arrays).

    Greedy when temperature == 0. Image/video pad and vision start/end tokens are never
    sampled. Vision inputs are HF-processor style (packed pixel_values [N, C*T*P*P] with
    grid_thw [I, 3]); they are laid out per row and padded to a multiple of `patch_bucket`
    patches per row, so calls with different images compile once per bucket. decode_layout:
    see `SamplingConfig.decode_layout`.
    """
    cfg_m = model.config
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
    if eos_token_ids is None:
        eos_token_ids = ()
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
        decode_layout=decode_layout,
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
