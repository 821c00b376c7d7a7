"""Sampling's front: which engine runs a call, its programs, `Sampler` and `generate`.

Two engines, chosen in one place (`uses_slots`: `SamplingConfig.slots`, with each prompt
prefilled once): the static sampler (`static.py`, every row decoded at once over a dense KV
cache) and the slots engine (`engine.py`, slots that refill over a paged cache). Both draw
the same tokens with the same pieces (`steps.py`). A call runs two programs, `prefill` then
`decode` (the carry donated: the cache is updated in place); `sample` traces both as one.

The programs are module-level `jax.jit`s whose static arguments are the model structure (the
nnx graphdef) and the settings (`SamplingConfig`, frozen and hashable): jax's own cache keeps
one compiled program per structure, settings, argument shapes and mesh, which every
`Sampler` and every `generate` call reuses; nothing compiled is kept here. Programs
compiled for the CPU take their decode steps' forms from `sampling.cpu`
(`steps.decode_forms`), with weights in an explicit `DecodeWeights` the caller may keep.

Two entry points: `generate(model, ids, mask, ...)` on host arrays (HF-processor-style vision
inputs), and `Sampler(graphdef, cfg)` over precomputed positions and VisionInputs, which the
trainer calls with its own patch buckets.

Groups: `sample(..., num_samples=G)` prefills each of R prompts once (vision tower included)
and decodes B = R * G rows; every row draws with its own key (`steps.row_keys`).

Shapes: B rows, P prompt length (left-padded), N = max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl.models import rope_index, stack_vision_inputs, vision_inputs, vision_token_ids
from jaxvrl.parallel.sharding import row_shards
from jaxvrl.sampling import engine, static, steps
from jaxvrl.sampling.cpu import decode as cpu_decode
from jaxvrl.sampling.cpu.decode import DecodeWeights
from jaxvrl.sampling.layout import Layout, Preparer, onto, prefill_mesh
from jaxvrl.sampling.steps import SampleOutput, SamplingConfig

Carry = static.StaticCarry | engine.SlotsCarry


def uses_slots(cfg: SamplingConfig, prefill_once: bool) -> bool:
    """Whether a call runs the slots engine (`engine.py`): `cfg.slots` set and each prompt
    prefilled once; else the static sampler (`static.py`). The only place that chooses."""
    return bool(cfg.slots) and prefill_once


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
    groups=None,
    need=None,
    prompt_of=None,
    order=None,
) -> SampleOutput:
    """Traceable sampling core: `prefill`, then `decode` (jit it with `cfg`, `num_samples`,
    `prefill_once` static: `sample_program`; `Sampler` runs the two as programs of their
    own). Samples `num_samples` (G) completions of each of the R given rows.

    input_ids, attention_mask: int[R, T] left-padded; position_ids (the family's positions
    [..., R, T]) and deltas int32[R] from `jaxvrl.models.rope_index`; rng: a key (typed, or a legacy uint32[2] one);
    images/videos: VisionInputs (packed or per row); pools: optional {"vision","text",
    "prompt"} bool[R, T] for per-token attention masses; decode_weights: the decode steps'
    weights prepared for the decode rows (`Sampler.decode_weights`), or None: made here where
    the layout asks for them (see `SamplingConfig.decode_layout`).

    prefill_once: the R rows are R distinct prompts; the vision tower and the prefill run once
    per prompt and their cache, positions, pools and last hidden state are repeated to B =
    R * G rows (prompt-major: row p * G + g is prompt p's sample g). Otherwise the R rows are
    already repeated (B = R, each prompt's G rows adjacent) and each is prefilled: the same
    rows and per-row keys (`steps.row_keys`), so the same tokens, at G times the prefill's
    cost.

    limits: optional int[B], the most tokens each output row may have (default: every row
    max_new_tokens); a row that reaches its limit without EOS ends truncated.

    groups int[B] (each output row's group, -1: none) and need int[]: the call stops once
    `need` groups have ended whole, the other rows part-way (`SampleOutput.ended`; partial
    rollouts continue them later). prompt_of int[B]: the prompt each output row samples (any
    number per prompt; None: num_samples each, prompt-major); order int[B]: the rows in the
    order they start (None: row 0 first). These: the slots engine only.
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
        groups=groups,
        need=need,
        prompt_of=prompt_of,
        order=order,
    )
    return decode(graphdef, params, carry, decode_weights, cfg=cfg, prefill_once=prefill_once)[0]


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
    groups=None,
    need=None,
    prompt_of=None,
    order=None,
) -> Carry:
    """A rollout's first program (traceable; the arguments are `sample`'s): the vision tower
    and the prompts' prefill, as the carry `decode` starts from: the static sampler's
    (`static.prefill`) or, where `uses_slots`, the slots engine's (`engine.prefill_slots`)."""
    args = (graphdef, params, input_ids, attention_mask, position_ids, deltas, rng)
    kw = dict(cfg=cfg, images=images, videos=videos, pools=pools, limits=limits)
    if uses_slots(cfg, prefill_once):
        more = dict(groups=groups, need=need, prompt_of=prompt_of, order=order)
        return engine.prefill_slots(*args, num_samples=num_samples, **more, **kw)
    if groups is not None or prompt_of is not None or order is not None:
        raise ValueError("sampling: a call that stops by groups needs slots (SamplingConfig.slots)")
    return static.prefill(*args, num_samples=num_samples, prefill_once=prefill_once, **kw)


def decode(
    graphdef,
    params,
    carry: Carry,
    decode_weights: DecodeWeights | None = None,
    *,
    cfg: SamplingConfig,
    prefill_once: bool = True,
    pause_at: int = 0,
) -> tuple[SampleOutput, Carry]:
    """A rollout's second program (traceable): every row's decode steps from `prefill`'s
    carry (made with the same `cfg` and `prefill_once`). Returns (SampleOutput, the carry
    with the cache as the steps left it: jit it with the carry donated and the cache is
    updated in place). pause_at: see `engine.decode_slots` and `static.decode`."""
    if uses_slots(cfg, prefill_once):
        return engine.decode_slots(
            graphdef, params, carry, decode_weights, cfg=cfg, pause_at=pause_at
        )
    return static.decode(graphdef, params, carry, decode_weights, cfg=cfg, pause_at=pause_at)


def prepare_decode_weights(graphdef, rows: int, params, reuse, *, cfg: SamplingConfig):
    """The decode weights for `rows` rows where the layout asks for them, else None."""
    if not steps.transposed_decode(cfg):
        return None
    return cpu_decode.prepare(nnx.merge(graphdef, params), rows, reuse)


# The programs, shared by every sampler: the model structure (argument 0) and the settings
# are static, so jax's cache tells programs apart by them and by the arguments' shapes.
_HOW = ("cfg", "num_samples", "prefill_once")
prefill_program = jax.jit(prefill, static_argnums=0, static_argnames=_HOW)
decode_program = jax.jit(
    decode, static_argnums=0, static_argnames=("cfg", "prefill_once", "pause_at"),
    donate_argnums=2,
)  # fmt: skip
sample_program = jax.jit(sample, static_argnums=0, static_argnames=_HOW)
decode_weights_program = jax.jit(
    prepare_decode_weights, static_argnums=(0, 1), static_argnames="cfg", donate_argnums=3
)


def _shapes(tree) -> tuple:
    """A hashable summary of a call's arguments: their structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)


class Sampler:
    """Sampling for one model structure and sampling config, in one layout (mesh and compute
    dtype: `layout.py`). It holds no compiled programs: its calls run the module's
    (`prefill_program`, `decode_program`), compiled by jax once per shape for every sampler
    of the same structure, config and mesh.

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
    rather than faulted in afresh (what that saves: bench/RESULTS.md, sampler). Without them
    a call prepares its own. With `mesh` (the rollout mesh: `layout.rollout_mesh`), programs
    are traced and run under it (activation constraints and the KV cache follow the rows'
    sharding and the tensor axis; CPU forms only on a one-device CPU mesh); dtype: the
    compute dtype of sampling (None: the model's).

    sequence: the devices each prompt's prefill splits its tokens over (sequence parallelism;
    1: none). The prefill then runs on `layout.prefill_mesh(mesh, sequence)` (the mesh's data
    groups joined `sequence` at a time, the same devices) and hands its carry to the decode
    steps, on `mesh`, in place; prompt lengths that `sequence` divides split evenly.
    """

    def __init__(self, graphdef, cfg: SamplingConfig, mesh=None, dtype=None, sequence: int = 1):
        self.graphdef, self.cfg, self.mesh = graphdef, cfg, mesh
        self.layout = Layout(mesh, None if dtype is None else jnp.dtype(dtype).name)
        if sequence != 1 and mesh is None:
            raise ValueError(f"a prefill split over {sequence} devices needs a rollout mesh")
        self.prefill_mesh = None if mesh is None else prefill_mesh(mesh, sequence)
        self.prepare = Preparer(graphdef, self.layout)
        self._seen: set = set()  # the argument shapes of this sampler's calls (`compiles`)

    def _mesh(self, mesh=None):
        mesh = mesh or self.mesh
        return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

    def __call__(self, params, input_ids, *args, **kwargs) -> SampleOutput:
        return self.timed(params, input_ids, *args, **kwargs)[0]

    def timed(
        self,
        params,
        *args,
        decode_weights: DecodeWeights | None = None,
        num_samples: int = 1,
        prefill_once: bool = True,
        **kwargs,
    ) -> tuple[SampleOutput, dict]:
        """`__call__`, and the seconds its two programs took: {"prefill_s", "decode_s"} (each
        waited for: the decode loop starts once the prefill is done; compiling included)."""
        ready = self.prepare(params)
        self._seen.add((_shapes((args, kwargs)), num_samples, prefill_once))
        how = dict(cfg=self.cfg, prefill_once=prefill_once)
        t0 = time.perf_counter()
        with self._mesh(self.prefill_mesh):
            params, args, kwargs = onto((ready.params, args, kwargs), self.prefill_mesh)
            carry = prefill_program(
                ready.graphdef, params, *args, num_samples=num_samples, **how, **kwargs
            )
            carry = jax.block_until_ready(onto(carry, self.mesh))
        t1 = time.perf_counter()
        with self._mesh():
            out, work = self._decode(ready, carry, decode_weights, how)
            out = jax.block_until_ready(out)
        times = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1}
        return out, times if work is None else dict(times, decode_work=work)

    def _decode(self, ready, carry, decode_weights, how) -> tuple[SampleOutput, float | None]:
        """The decode loop; with `cfg.narrow`, at fewer rows (slots) each time no row waits
        and half of them or fewer run (`steps.widths`: a program per row count, each step's
        matmuls carrying only those rows; the slots engine's outputs are every work row's
        already, the static sampler's are merged back by row): -> (out, the rows x steps
        it ran, or None without narrowing)."""
        args = (ready.graphdef, ready.params)
        slots = uses_slots(self.cfg, how["prefill_once"])
        rows = carry.keys.shape[0]
        ladder = steps.widths(
            min(self.cfg.slots, rows) if slots else rows, row_shards(self.mesh), self.cfg
        )
        if len(ladder) == 1:
            return decode_program(*args, carry, decode_weights, **how)[0], None
        whole, work, done = None, 0, 0
        for i, width in enumerate(ladder):
            if i:
                carry = (engine.narrow_slots if slots else static.narrow_rows)(carry, width)
            pause = ladder[i + 1] if i + 1 < len(ladder) else 0
            out, carry = decode_program(*args, carry, decode_weights, pause_at=pause, **how)
            if whole is not None and not slots:  # the narrowed rows' outputs, in their rows
                out = static.merge_rows(whole, out, carry.loop["rows"])
            whole = out
            ran = int(jax.device_get(out.steps))  # replicated on every process
            work, done = work + width * (ran - done), ran
            if not (pause and bool(jax.device_get(carry.loop["paused"]))):
                break
        return whole, float(work)

    def decode_weights(self, params, rows: int, reuse: DecodeWeights | None = None):
        """The decode weights of `params` (as they are or prepared) for calls of `rows` rows,
        or None where decode steps use the model's own weights (programs for accelerators).
        `reuse` (the previous result) is donated: its buffer takes the new weights."""
        ready = self.prepare(params)
        with self._mesh():
            return decode_weights_program(ready.graphdef, rows, ready.params, reuse, cfg=self.cfg)

    def decode_rows(self, rows: int, prefill_once: bool = True) -> int:
        """The rows a call's decode steps run for `rows` output rows (what `decode_weights`
        are prepared for): its slots where it has them, else every row."""
        if uses_slots(self.cfg, prefill_once):
            return min(rows, self.cfg.slots)
        return rows

    def compiles(self) -> int:
        """The distinct argument shapes (with num_samples and prefill_once) this sampler has
        been called with: the programs it needs, a prefill and a decode program each (a run
        logs it: one per shape). jax compiles each once per process, for whichever sampler
        of the same structure, config and mesh asks first."""
        return len(self._seen)

    def lower(self, params, input_ids, *args, **kwargs):
        """The sampling program lowered for these (abstract) arguments, without running or
        keeping anything: for compiling it ahead of time (`jaxvrl.aot`). With the prefill
        split over a sequence axis (`sequence`), the prefill program on its mesh: the decode
        steps run as a program of their own, on the rollout mesh."""
        ready = self.prepare(params)
        if self.prefill_mesh is not self.mesh:
            with self._mesh(self.prefill_mesh):
                params, input_ids, args, kwargs = onto(
                    (ready.params, input_ids, args, kwargs), self.prefill_mesh
                )
                return prefill_program.lower(
                    ready.graphdef, params, input_ids, *args, cfg=self.cfg, **kwargs
                )
        with self._mesh():
            return sample_program.lower(
                ready.graphdef, ready.params, input_ids, *args, cfg=self.cfg, **kwargs
            )


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
        rows.append(vision_inputs(cfg, pvb, grid[items].reshape(-1, 3), n))
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
    routes: bool = False,
) -> SamplingConfig:
    """The SamplingConfig `generate` samples with: these settings, and the model's image/video
    pad and vision start/end tokens suppressed (those it has)."""
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
        suppress_token_ids=vision_token_ids(cfg_m),
        decode_layout=decode_layout,
        routes=routes,
    )


# The decode weights of the last `generate` call per model structure, config and rows, with
# weak references to the parameter arrays they were packed from: a later call with the same
# arrays (the same model, not updated since) takes them instead of packing afresh; the entry
# goes when one of those arrays does.
_GENERATE_WEIGHTS: dict = {}


def _kept_decode_weights(sampler: Sampler, params, rows: int) -> DecodeWeights | None:
    key = (sampler.graphdef, sampler.cfg, sampler.mesh, rows)
    leaves = jax.tree.leaves(params)
    kept = _GENERATE_WEIGHTS.get(key)
    if kept is not None:
        refs, weights = kept
        same = len(refs) == len(leaves) and all(r() is x for r, x in zip(refs, leaves))
        if same and weights.packed == _packs(weights, rows):
            return weights
    weights = sampler.decode_weights(params, rows)
    if weights is None:  # decode steps use the model's own weights (accelerator layouts)
        return None

    def forget(_ref, key=key):
        if _GENERATE_WEIGHTS.get(key, (None,))[0] is refs:
            del _GENERATE_WEIGHTS[key]

    try:
        refs = [weakref.ref(x, forget) for x in leaves]
    except TypeError:  # a leaf without weak references (a numpy array): nothing is kept
        return weights
    _GENERATE_WEIGHTS[key] = (refs, weights)
    return weights


def _packs(weights: DecodeWeights, rows: int) -> bool:
    """Whether weights like these are packed for the CPU kernel now (it may have been
    switched off since they were packed)."""
    dtypes = [slot.dtype for slot in weights.slots.values()]
    return bool(dtypes) and cpu_decode.uses_kernel(rows, jnp.dtype(dtypes[0]))


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
    routes: bool = False,
) -> SampleOutput:
    """Sample completions for left-padded prompts int[R, P] (numpy or jax arrays): R *
    num_samples rows, each prompt prefilled once (`sample`; prefill_once=False: the rows are
    already repeated, each prefilled).

    Greedy when temperature == 0. Rows end only at `eos_token_ids` (default none: every row
    runs max_new_tokens; unlike transformers' generate, the model's own EOS is not assumed:
    pass it, e.g. `jaxvrl.trainer.setup.stop_token_ids`). Image/video pad and vision
    start/end tokens are never sampled. Vision inputs are HF-processor style (packed
    pixel_values [N, C*T*P*P] with grid_thw [I, 3]); they are laid out per row and padded
    to a multiple of `patch_bucket` patches per row, so calls with different images compile
    once per bucket (the programs are jax's, shared by every call: `sampler.py`). rng: a typed key (`jax.random.key`) or a
    legacy uint32[2] one (`jax.random.PRNGKey`, the same draws for the same seed); default
    key(0). decode_layout: see `SamplingConfig.decode_layout`. sampler: a `Sampler` made for
    the same model and the config these arguments give (`generation_config`), whose
    `compiles` counts these calls' shapes (default: a new one); decode_weights: its
    `decode_weights` for these parameters and rows, kept by the caller. routes: a model with
    mixture-of-experts layers also returns every token's routes (`SampleOutput.routes`: the
    experts each sparse layer chose), which `Model.forward(routes=..., replay_routes=True)`
    replays.
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
        routes=routes,
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
    pos, deltas = rope_index(cfg_m, ids, mask, image_grid_thw, video_grid_thw, second_per_grid_ts)
    images = videos = None
    if pixel_values is not None:
        images = row_vision_inputs(
            pixel_values, image_grid_thw, ids, cfg_m.image_token_id, cfg_m, patch_bucket
        )
    if pixel_values_videos is not None:
        videos = row_vision_inputs(
            pixel_values_videos, video_grid_thw, ids, cfg_m.video_token_id, cfg_m, patch_bucket
        )
    rng = jax.random.key(0) if rng is None else rng
    pools = None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()}
    if decode_weights is None:
        rows = sampler.decode_rows(len(ids) * (num_samples if prefill_once else 1), prefill_once)
        decode_weights = _kept_decode_weights(sampler, params, rows)
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
