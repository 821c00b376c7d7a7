"""What a decode step of either engine is made of: the sampling settings (`SamplingConfig`),
the output (`SampleOutput`), each row's key (`row_keys`), the step's logits (`logits`, through
the decode forms that `decode_forms` chooses) and the token pick (`pick`).

The static sampler (`static.py`: every row decoded at once) and the slots engine
(`engine.py`: slots that refill over a paged cache) both import this module and nothing of
each other, so that they draw the same tokens: row b's token i comes from its own key folded
with i, whatever the engine, the batch or the mesh.

Shapes: B rows, V vocabulary, E end-of-sequence ids.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxvrl.models import moe
from jaxvrl.models.cached_attention import PAGED
from jaxvrl.parallel import sharding
from jaxvrl.sampling import rules
from jaxvrl.sampling.cpu import decode as cpu_decode
from jaxvrl.sampling.cpu import kernels as cpu_kernels
from jaxvrl.sampling.cpu.decode import DecodeWeights
from jaxvrl.sampling.rules import NEG_INF


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a rollout samples; frozen and hashable: the programs' static setting."""

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
    # as the matmul's row operand: faster M = B matmuls on XLA's CPU backend, measured in
    # bench/RESULTS.md, at the cost of a second copy of those weights during the call),
    # "auto" (transposed in programs compiled for the CPU: the mesh in context decides, not
    # the host).
    decode_layout: str = "auto"
    # Rows decoded at once (`engine.py`): 0 decodes every row of a call together until the
    # longest ends (the static sampler); S > 0 decodes S rows, each ended row's slot taken by
    # the next waiting one, over a paged KV cache whose pages hold `page_size` positions
    # (a prompt's pages shared by its samples). The same completions either way.
    slots: int = 0
    page_size: int = 16
    # Halvings of a call's decode rows (`widths`; `Sampler` runs them): once no row waits,
    # each time half of the rows (slots) or fewer still run, the loop goes on at half of them
    # (a program of its own), so the long tail's steps carry only about the rows that run;
    # never below `narrow_to` rows (a step of fewer costs about the same: the weights' read).
    # 0: every step at all rows.
    narrow: int = 0
    narrow_to: int = 8
    # How decode steps attend over the KV cache: "auto" (the form of the devices the program
    # is compiled for, `DECODE_KERNELS`: the CPU form on the CPU, the Pallas kernel on TPUs,
    # dense elsewhere) or a name of `jaxvrl.models.cached_attention.IMPLEMENTATIONS`
    # ("dense": XLA's einsums around a masked softmax; "tpu": the Pallas TPU kernel,
    # `jaxvrl.models.cached_kernels`). The same completions, log-probs and masses, to
    # rounding. The static sampler's cache keeps its keys positions-minor for the CPU form
    # and positions second-minor for the others (`key_layout`).
    decode_attention: str = "auto"
    # Also return each sampled token's entropy (of softmax(logits / temperature), the full
    # distribution, as the trainer's passes compute it): a trainer whose old-policy
    # quantities come from the sampler reads them instead of recomputing them.
    entropies: bool = False
    # Also return each token's routes through a mixture of experts' sparse layers (the
    # experts each router chose, prompt and completion: `SampleOutput.routes`), for a
    # training pass to replay or compare (models without experts: none).
    routes: bool = False

    def __post_init__(self):
        # id lists as tuples: the config is hashed as the programs' static setting
        for name in ("eos_token_ids", "suppress_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))


@struct.dataclass
class SampleOutput:
    """tokens int32[B, N] (pad after the end); logprobs float32[B, N] of the sampled tokens
    under logits / temperature (the full distribution, before top-k/top-p; temperature 0
    uses 1); mask float32[B, N] 1 up to and including the first EOS; truncated bool[B] (no
    EOS within N); vision_mass / text_mass float32[L, B, N] when pools were given: token
    i's masses are those of the query that predicts it (the last prompt token's for token 0,
    token i-1's after), as a teacher-forced pass's at the completion's predictors; steps
    int32[]: decode steps run (< N when every row ended early); entropies float32[B, N] of
    the distributions the tokens were drawn from (under logits / temperature, 0 on padding)
    with `SamplingConfig.entropies`; ended bool[B] the rows that ended (EOS or their last
    token), or None (every row did): a slots call stopped by its groups leaves the others
    part-way, their tokens so far under `mask`; routes int[B, P + N, L', k] with
    `SamplingConfig.routes` (a model with L' sparse layers of top-k experts): the experts
    each sparse layer's router chose for every prompt position (P, left-padded as given) and
    completion token (0 after the end), in `moe.route_dtype`, else None."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    truncated: jax.Array
    steps: jax.Array | None = None
    vision_mass: jax.Array | None = None
    text_mass: jax.Array | None = None
    entropies: jax.Array | None = None
    ended: jax.Array | None = None
    routes: jax.Array | None = None


def records_routes(model, cfg: SamplingConfig) -> bool:
    """Whether a call records routes: asked, and the model has sparse layers."""
    return cfg.routes and any(moe.sparse_layers(model.config.text))


def step_routes(model, routes: jax.Array, rows: int) -> jax.Array:
    """A forward's recorded routes [L', rows * T, k] as [rows, T, L', k] in the compact
    dtype (`moe.route_dtype`)."""
    dtype = moe.route_dtype(model.config.text.num_experts)
    per_row = routes.reshape(routes.shape[0], rows, -1, routes.shape[-1])
    return jnp.moveaxis(per_row, 0, 2).astype(dtype)


def last_query_masses(out, repeat: int = 1) -> tuple[jax.Array, jax.Array]:
    """(A_V, A_X) float32[rows, L] of a prefill's last query (`out`: the forward's output with
    pools; left-padded prompts end at the last position), the one that predicts a row's
    first token; each row repeated `repeat` times in a row (prompt-major)."""
    masses = (out.vision_mass[:, :, -1].T, out.text_mass[:, :, -1].T)
    return masses if repeat == 1 else tuple(jnp.repeat(x, repeat, axis=0) for x in masses)


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering; removed entries get NEG_INF. float32[B, V]."""
    return rules.top_p_filter(rules.top_k_filter(logits, top_k), top_p)


def eos_ids(cfg: SamplingConfig) -> jax.Array:
    """int32[E]: the ids that end a row (-1, no token, where there are none)."""
    return jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)


def typed_key(rng: jax.Array) -> jax.Array:
    """`rng` as a typed key: a legacy uint32[2] key (`jax.random.PRNGKey`) is wrapped as the
    default implementation's key, which jax defines to draw what `jax.random.key` of the same
    seed draws."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    return jax.random.wrap_key_data(rng)


def row_keys(rng: jax.Array, prompts: int, samples: int) -> jax.Array:
    """key[prompts * samples]: row p * samples + g's key, rng (a typed or legacy key) folded
    with p then g. A row's draws (`pick`: this key folded with the token index) depend on
    neither how many rows a call holds nor how they are laid out (one prefill per prompt or
    repeated rows)."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    per_prompt = fold(typed_key(rng), jnp.arange(prompts))
    return jax.vmap(fold, in_axes=(0, None))(per_prompt, jnp.arange(samples)).reshape(-1)


def pick(logits: jax.Array, keys: jax.Array, index, cfg: SamplingConfig):
    """(tokens int32[B], logprobs float32[B], entropies float32[B] or None): `pick_token`,
    with `SamplingConfig.entropies` the entropy of softmax(logits / temperature) too."""
    tok, lp = pick_token(logits, keys, index, cfg)
    if not cfg.entropies:
        return tok, lp, None
    temp = cfg.temperature if cfg.temperature > 0 else 1.0
    return tok, lp, rules.token_entropy(logits, temp)


def pick_token(logits: jax.Array, keys: jax.Array, index, cfg: SamplingConfig):
    """Sample (or argmax) token `index` of each row of float32[B, V], row b with its key
    keys[b] (`row_keys`); returns (tokens int32[B], logprobs float32[B]).

    On one CPU device, greedy picks and unfiltered draws (no top-k, top-p) are one kernel
    each (`cpu_kernels.greedy_pick`, `categorical_pick`: the same inverse-CDF method and
    uniform numbers as `rules.categorical_from_uniform`). Otherwise suppressed ids are masked
    by a constant bool[V] that XLA fuses into the passes reading the logits, not scattered
    into logits split over a tensor axis (what that cost a TPU decode step: docs/scaling.md).
    The log-prob's normaliser covers the suppressed ids too (the unmasked logits).
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


def _filters(cfg: SamplingConfig, vocab: int) -> bool:
    """Whether top-k or top-p filtering changes the distribution."""
    return 0 < cfg.top_k < vocab or cfg.top_p < 1.0


def _suppressed(ids: tuple[int, ...], vocab: int) -> jax.Array:
    """bool[V], a constant of the program: True at the ids (those inside the vocabulary)."""
    mask = np.zeros((vocab,), bool)
    mask[[i for i in ids if 0 <= i < vocab]] = True
    return jnp.asarray(mask)


def transposed_decode(cfg: SamplingConfig) -> bool:
    """Whether decode steps multiply by [out, in] copies of the weights
    (`SamplingConfig.decode_layout`; "auto": in programs compiled for the CPU)."""
    if cfg.decode_layout not in ("auto", "model", "transposed"):
        raise ValueError(f"decode_layout must be auto, model or transposed: {cfg.decode_layout!r}")
    if cfg.decode_layout == "auto":
        return sharding.target_platform() == "cpu"
    return cfg.decode_layout == "transposed"


def cached_attention(cfg: SamplingConfig) -> str:
    """The cached attention decode steps run on the devices the program is compiled for:
    `cfg.decode_attention`, or with "auto" "cpu" (the CPU form) on the CPU and
    `DECODE_KERNELS`' (else "dense") elsewhere."""
    if cfg.decode_attention != "auto":
        return cfg.decode_attention
    platform = sharding.target_platform()
    return "cpu" if platform == "cpu" else DECODE_KERNELS.get(platform, "dense")


def reads_pages(cfg: SamplingConfig) -> bool:
    """Whether the slots engine's decode steps, on the devices the program is compiled for,
    read each slot's pages where they lie (a paged kernel) rather than gathering every page
    of the tables into the dense form at each step."""
    return cached_attention(cfg) in PAGED


def key_layout(cfg: SamplingConfig) -> str:
    """The static sampler's cache keys' layout (`KVCache.key_layout`): positions minor where
    the CPU form reads them as they lie, else second-minor (on accelerators' (8, 128) tiles a
    positions-minor key pads each step's one new position to 128, docs/scaling.md)."""
    return "BKHS" if cached_attention(cfg) == "cpu" else "BKSH"


def widths(rows: int, groups: int, cfg: SamplingConfig) -> list[int]:
    """The decode rows a call's loop runs at: `rows` (its slots, or every row), then up to
    `cfg.narrow` halvings, each rounded up to a multiple of the rollout's row groups
    `groups`, while it shrinks and keeps at least `cfg.narrow_to` rows."""
    out = [rows]
    for _ in range(cfg.narrow):
        half = -(-(out[-1] // 2) // groups) * groups
        if not max(cfg.narrow_to, 1) <= half < out[-1]:
            break
        out.append(half)
    return out


def decode_forms(model, cfg: SamplingConfig, rows: int, weights: DecodeWeights | None):
    """What decode steps use in place of the model's own modules, chosen here only, by the
    devices the program is compiled for (the mesh in context decides): the cached
    attention's implementation (`cfg.decode_attention`; "auto": the CPU form on the CPU,
    `DECODE_KERNELS`' elsewhere), and with the transposed layout the decode weights (given,
    or prepared here); None where the model's own layers and dense attention run."""
    cached = cached_attention(cfg)
    cpu = cached == "cpu"
    if transposed_decode(cfg):
        if weights is None:
            weights = cpu_decode.prepare(model, rows)
        elif weights.packed and not cpu_decode.uses_kernel(rows, model.dtype):
            raise ValueError(  # unpacked weights serve any rows (a narrowed loop's too)
                f"decode_weights were packed for at most {cpu_kernels.MAX_ROWS} rows, this call "
                f"has {rows}: prepare them for its rows (Sampler.decode_weights)"
            )
    else:
        weights = None
    if weights is None and cached == "dense":
        return None
    return cpu_decode.DecodeForms(weights, cpu_attention=cpu, cached="dense" if cpu else cached)


# the cached attention `decode_attention="auto"` takes on each platform besides the CPU (its
# own form) and "dense": on TPUs the Pallas kernel, which keeps the scores on chip and reads
# only the written blocks of the cache (with the keys positions second-minor, the 7B decode
# step is priced 7-11% lower than the dense form's, docs/scaling.md). Not on GPUs: there the
# slots engine through the Pallas Triton kernel ("gpu") decoded at 0.80x the static sampler's
# tokens/s with XLA's dense form (bf16, 0.5B, 64 and 256 rows on an H200: bench/RESULTS.md)
DECODE_KERNELS: dict[str, str] = {"tpu": "tpu"}


def logits(model, forms, hidden: jax.Array) -> jax.Array:
    """float32[B, V] of a decode step from hidden [B, D]: the decode weights' head where there
    is one, else the model's own head."""
    out = None if forms is None else forms.head(hidden)
    return model.logits(hidden) if out is None else out
