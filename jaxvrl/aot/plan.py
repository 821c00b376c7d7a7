"""The main job's programs as shapes on a TPU slice's mesh, ready to compile.

`Plan.build(config, "v5p-16")` makes what `jaxvrl.train` makes — the model (abstract: no
weights), the sharded train state (`runtime.abstract_train_state`), the jitted train step
(`runtime.jit_train_step`), the rollout sampler (`trainer.setup.sampling_config`, `Sampler`) —
and the run's batch shapes, on a mesh (`config.mesh`) over the slice's abstract devices.
`Plan.compile(name)` lowers and compiles one program with the XLA TPU compiler.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxvrl import models
from jaxvrl.aot.report import (
    Report,
    analyse,
    out_of_memory,
    per_device_bytes,
    temporaries_from_dump,
)
from jaxvrl.config import ConfigError, set_values
from jaxvrl.data.from_config import builtin_task
from jaxvrl.data.processor import smart_resize
from jaxvrl.models import moe
from jaxvrl.models.attention import resolve
from jaxvrl.models.cache import KEY_AXES
from jaxvrl.parallel import runtime, topology
from jaxvrl.parallel.sharding import leaf_name, logical_to_spec, row_shards
from jaxvrl.sampling import Sampler, prefill_mesh, static, steps
from jaxvrl.trainer import packing, setup
from jaxvrl.trainer.build import init_train_state, step_config
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.step import build_train_step


def model_config(c) -> tuple[str, object]:
    """(name, config) of `model.preset` (a published config.json shipped with the package) or
    of `model.path`'s config.json (no weights are read)."""
    preset = c.model.get("preset")
    if preset:
        path = os.path.join(models.PRESETS, f"{preset.lower()}.json")
        if not os.path.exists(path):
            known = ", ".join(models.preset_names())
            raise ConfigError(f"config.model.preset={preset!r}: unknown; known: {known}")
        with open(path) as f:
            return preset, models.config_from_hf(json.load(f), source=path)
    if not c.model.path:
        return "embedded tiny model", models.load_config(builtin_task(c).checkpoint)
    return c.model.path, models.load_config(c.model.path)


TEXT_ROOM = 32  # prompt tokens left for text beside the image


def image_grid(c, vcfg) -> np.ndarray:
    """grid_thw [1, 3] of the largest image a row may hold: a square of data.max_image_side
    pixels resized like the processor (so within data.max_pixels), smaller where its tokens
    would leave less than TEXT_ROOM tokens of data.max_prompt_length for text (longer
    prompts are skipped by the data pipeline, never trained on)."""
    factor = vcfg.patch_size * vcfg.spatial_merge_size
    side = c.data.max_image_side
    while True:
        h, w = smart_resize(side, side, factor, c.data.min_pixels, c.data.max_pixels)
        tokens = (h // factor) * (w // factor)
        if tokens + TEXT_ROOM <= c.data.max_prompt_length or h <= factor:
            break
        side = min(h, w) - factor
    if tokens + TEXT_ROOM > c.data.max_prompt_length:
        raise ConfigError(
            f"data.max_prompt_length={c.data.max_prompt_length} cannot hold an image "
            f"({tokens} tokens at the least) and {TEXT_ROOM} tokens of text"
        )
    return np.array([[1, h // vcfg.patch_size, w // vcfg.patch_size]])


def completion_lengths(spec: str, rows: int, max_new_tokens: int, seed: int = 0) -> np.ndarray:
    """int[rows] completion lengths drawn (seed `seed`) from `spec`:
    "lognormal:median=M,sigma=S" (rounded, within 1 .. max_new_tokens: the tail piles up at
    the maximum, as truncated completions do), or a file of lengths (whitespace-separated
    integers, e.g. a run's response lengths), drawn from with replacement."""
    rng = np.random.default_rng(seed)
    if spec.startswith("lognormal:"):
        try:
            kv = dict(part.split("=", 1) for part in spec.split(":", 1)[1].split(","))
            median, sigma = float(kv.pop("median")), float(kv.pop("sigma"))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--lengths={spec!r}: want lognormal:median=M,sigma=S") from e
        if kv or median <= 0 or sigma < 0:
            raise ConfigError(f"--lengths={spec!r}: want lognormal:median=M,sigma=S")
        drawn = np.round(rng.lognormal(np.log(median), sigma, rows))
    else:
        if not os.path.exists(spec):
            raise ConfigError(f"--lengths={spec}: no such file (or lognormal:median=M,sigma=S)")
        with open(spec) as f:
            try:
                pool = np.array([int(x) for x in f.read().split()])
            except ValueError as e:
                raise ConfigError(f"{spec}: not whitespace-separated integers ({e})") from e
        if not len(pool):
            raise ConfigError(f"{spec}: holds no lengths")
        drawn = rng.choice(pool, rows)
    return np.clip(drawn, 1, max_new_tokens).astype(np.int64)


def _abstract(x, sharding=None):
    dtype = {np.dtype(np.int64): jnp.int32, np.dtype(np.float64): jnp.float32}.get(
        np.dtype(x.dtype), x.dtype
    )
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


def _with_shardings(tree, mesh, rows: int):
    """ShapeDtypeStructs of `tree` carrying the batch's shardings (rows over data x fsdp)."""
    shardings = runtime.batch_shardings(tree, mesh, rows=rows)
    return jax.tree.map(lambda x, s: _abstract(x, s), tree, shardings)


def _in_decoder(name: str, model_config) -> bool:
    """Whether the parameter `name` is one a decode step multiplies by: the text decoder's
    layers and the LM head (an embedding lookup reads only the fed tokens' rows; a tied
    table is the head)."""
    tied = bool(model_config.tie_word_embeddings)
    return not name.startswith("visual.") and (tied or "embed_tokens" not in name)


def decoder_params(params, model_config):
    """The parameters a decode step multiplies by (`_in_decoder`)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [x for path, x in flat if _in_decoder(leaf_name(path), model_config)]


def active_count(params, model_config, decoder: bool = False) -> int:
    """Parameters one token multiplies by (of the decode step's, `decoder`): each whole, but
    a mixture of experts' expert kernels k / E of theirs (a token runs k of the E experts).
    What model FLOPs and MFU count."""
    t = model_config.text
    share = t.num_experts_per_tok / t.num_experts if t.num_experts else 1.0
    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = leaf_name(path)
        if not decoder or _in_decoder(name, model_config):
            n = math.prod(x.shape)
            total += n * share if ".experts." in f".{name}" else n
    return round(total)


def decode_shardings(state, mesh):
    """Shardings of the decode loop's carry as the sampler lays it out on `mesh`: rows over
    (data, fsdp), and the KV cache's keys [B, K, H, S] (or [B, K, S, H]) and values
    [B, K, S, H] also over the tensor axis by KV head (the attention layers' constraint)."""
    rows = state["done"].shape[0]
    out = runtime.batch_shardings(state, mesh, rows=rows)
    cache = state["cache"]
    axes = {"k": KEY_AXES[cache.key_layout], "v": KEY_AXES["BKSH"]}
    for field, ax in axes.items():
        leaves = getattr(cache, field)
        specs = tuple(NamedSharding(mesh, logical_to_spec(ax, x.shape, mesh)) for x in leaves)
        out["cache"] = dataclasses.replace(out["cache"], **{field: specs})
    return out


@dataclasses.dataclass
class Plan:
    c: object
    slice: topology.Slice
    mesh: jax.sharding.Mesh
    model_name: str
    model: models.Model  # abstract
    init: runtime.ShardedInit  # abstract state and reference params with their shardings
    rows: int  # global rows of a step: prompts_per_step x G x hosts
    grid: np.ndarray | None  # [1, 3]: the largest image a row holds; None: a text-only model
    # int[rows] each row's completion length (`completion_lengths`); None: max_new_tokens
    lengths: np.ndarray | None = None

    @classmethod
    def build(cls, c, slice_name: str, lengths: str | None = None) -> Plan:
        """The plan of config `c` on slice `slice_name`; lengths: a completion-length
        distribution (`completion_lengths`), None: every completion max_new_tokens long."""
        s = topology.parse(slice_name)
        # the train step's chips: all of them, or those rollout.devices leaves it
        train, _ = setup.device_split(c, topology.tpu_devices(s))
        mesh = runtime.mesh_from_config(c.mesh, devices=train)
        setup.check_rows(c, mesh, processes=s.hosts)
        name, mcfg = model_config(c)
        setup.check_model_settings(c, mcfg)
        dtype, param_dtype = models.DTYPES[c.model.dtype], models.DTYPES[c.model.param_dtype]
        model = nnx.eval_shape(
            lambda: models.Model(
                mcfg,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=nnx.Rngs(0),
                scan_layers=c.model.scan_layers,
            )
        )
        model.set_remat_policy(c.model.remat_policy)
        model.set_attention(c.model.attention)  # "auto": resolved for the slice's devices
        model.set_expert_capacity(c.model.expert_capacity)
        offload = setup.check_offload(c, mesh)
        init = runtime.abstract_train_state(init_train_state, model, mesh, c, offload=offload)
        rows = c.prompts_per_step * c.rollout.num_generations * s.hosts
        grid = None if mcfg.vision is None else image_grid(c, mcfg.vision)  # None: text only
        n = c.rollout.max_new_tokens
        drawn = None if lengths is None else completion_lengths(lengths, rows, n)
        return cls(c, s, mesh, name, model, init, rows, grid, drawn)

    # ------------------------------------------------------------------ shapes
    @functools.cached_property
    def rollout(self) -> tuple:
        """(mesh, dtype) of the samplers: `rollout.mesh` over the slice's devices and
        `rollout.dtype` resolved for them (None: model.dtype), as `jaxvrl.train` makes them."""
        text = self.model.config.text
        chips = setup.sampling_devices(self.c, self.mesh, topology.tpu_devices(self.slice))
        return setup.rollout_layout(self.c, chips, text, processes=self.slice.hosts)

    @property
    def prompt_mesh(self):
        """The mesh the sampler takes its prompts on: its prefill's (`Sampler.prefill_mesh`)."""
        return prefill_mesh(self.rollout[0], self.c.rollout.mesh.sequence)

    def sampler(self, cfg=None) -> Sampler:
        """The rollout sampler of the run, in the rollout's layout."""
        mesh, dtype = self.rollout
        cfg = cfg or self.sampling_config()
        return Sampler(self.init.model_graphdef, cfg, mesh, dtype, self.c.rollout.mesh.sequence)

    @functools.cached_property
    def decode_kernel(self) -> bool:
        """Whether the rollout's decode steps attend through the Pallas kernel (as
        `rollout.decode_attention` resolves on the rollout's devices)."""
        with jax.set_mesh(self.rollout[0]):
            return steps.cached_attention(self.sampling_config()) == "tpu"

    @property
    def attention(self) -> str:
        """model.attention as the slice's programs run it ("auto" is splash on TPUs; the
        vision tower's window blocks run the banded dense form with any but xla, its
        full-attention blocks flash in place of cudnn)."""
        name = self.c.model.attention
        impl = resolve(name, "tpu")
        text = name if impl == name else f"{name}: {impl}"
        if impl == "xla":
            return text
        full = "flash" if impl == "cudnn" else impl
        if self.model.config.vision is None:
            return text
        if not self.model.config.vision.windowed:
            return text + f" (vision tower: {full} in every block)"
        return text + f" (vision tower: banded windows, {full} full blocks)"

    @property
    def prompt_len(self) -> int:
        b = self.c.data.prompt_bucket
        return -(-self.c.data.max_prompt_length // b) * b

    @property
    def new_tokens(self) -> int:
        return self.c.rollout.max_new_tokens

    @functools.cached_property
    def params_count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.init.state.params))

    @functools.cached_property
    def active_params(self) -> int:
        """Parameters a token multiplies by (`active_count`: a mixture of experts' k of E)."""
        return active_count(self.init.state.params, self.model.config)

    def _images(self, rows: int):
        if self.grid is None:
            return None
        vcfg = self.model.config.vision
        patches = int(np.prod(self.grid))
        pv = np.zeros((patches, vcfg.patch_dim), np.float32)
        row = models.vision_inputs(self.model.config, pv, self.grid, patches)
        return jax.tree.map(lambda x: np.broadcast_to(x, (rows,) + x.shape), row)

    def _image_words(self) -> str:
        if self.grid is None:
            return " of text"
        tokens = int(np.prod(self.grid)) // self.model.config.vision.merge_unit
        return f" holding an image of grid {self.grid[0].tolist()} ({tokens} tokens)"

    def _routes(self, rows: int, length: int):
        """The rollout's routes [rows, length, L', k] where the run records them, else None."""
        text = self.model.config.text
        if not setup.records_routes(self.c, self.model.config):
            return None
        shape = (rows, length, sum(moe.sparse_layers(text)), text.num_experts_per_tok)
        return np.zeros(shape, moe.route_dtype(text.num_experts))

    def _pools(self, length: int, rows: int) -> dict:
        return {k: np.zeros((rows, length), bool) for k in ("vision", "text", "prompt")}

    @property
    def sampler_prompts(self) -> int:
        """The rows the sampler prefills: each prompt once (`num_samples` = G), or all the
        step's rows where the mesh's row shards do not divide the prompts (as the rollout,
        `trainer.rollout.sample_completions`, falls back to repeated rows)."""
        prompts = self.rows // self.c.rollout.num_generations
        return prompts if prompts % row_shards(self.prompt_mesh) == 0 else self.rows

    def prompts(self, pools: bool, rows: int | None = None) -> dict:
        """The sampler's inputs for `rows` prompts (default: the step's rows): the collated
        prompt batch's arrays, abstract and sharded over the rollout mesh's rows."""
        b, p = rows or self.rows, self.prompt_len
        tree = dict(
            input_ids=np.zeros((b, p), np.int32),
            attention_mask=np.ones((b, p), np.int32),
            position_ids=self._positions(b, p),
            deltas=np.zeros((b,), np.int32),
            images=self._images(b),
            pools=self._pools(p, b) if pools else None,
        )
        return _with_shardings(tree, self.prompt_mesh, b)

    def _positions(self, b: int, p: int) -> np.ndarray:
        """The model family's positions of b prompts of p tokens (their shape is what
        matters here)."""
        return np.asarray(models.continue_positions(self.model.position_rank, np.zeros(b), p))

    @property
    def step_config(self):
        """The train step's settings, actor.shaping_source resolved for the slice."""
        return step_config(self.c, self.mesh)

    @property
    def completions(self) -> np.ndarray:
        """int[rows]: each row's completion length (all max_new_tokens without `lengths`)."""
        n = self.new_tokens
        return np.full(self.rows, n) if self.lengths is None else self.lengths

    @property
    def real_tokens(self) -> int:
        """Tokens of the step's rows that are not padding: full prompts and the completions."""
        return int(self.rows * self.prompt_len + self.completions.sum())

    def batch(self, cfg=None):
        """The train step's RolloutBatch, abstract and sharded, fitted to the completion
        lengths as the run fits it (`trainer.packing.fit_batch`: the completion axis cut,
        and with actor.padding_free the packing plan of these lengths) for step settings
        `cfg` (default: the run's, made once)."""
        return self._batch if cfg is None else self._fitted_batch(cfg)

    @functools.cached_property
    def _batch(self):
        return self._fitted_batch(self.step_config)

    def _fitted_batch(self, cfg):
        b, p = self.rows, self.prompt_len
        comp = self.completions
        n = packing.completion_bucket(int(comp.max()), self.new_tokens)
        mask = (np.arange(n)[None] < comp[:, None]).astype(np.float32)
        batch = assemble(
            np.zeros((b, p), np.int32),
            np.ones((b, p), np.int32),
            self._positions(b, p),
            np.zeros((b,), np.int32),
            np.zeros((b, n), np.int32),
            mask,
            np.zeros((b,), np.float32),
            np.ones((b,), bool),
            pools=self._pools(p, b) if cfg.needs_attention else None,
            old_logprobs=np.zeros((b, n), np.float32),  # the sampler's, as the rollout gives
            old_entropy=np.zeros((b, n), np.float32) if cfg.sampler_shaping else None,
            routes=self._routes(b, p + n),
            masses=self._sampled_masses(b, n)
            if cfg.sampler_shaping and cfg.needs_attention
            else None,
        )
        batch = dataclasses.replace(batch, images=self._images(b))
        plan = packing.plan_batch(p + comp, comp, p + n, jax.random.key(0), cfg, self.mesh)
        batch = batch.replace(**plan)
        return _with_shardings(batch, self.mesh, self.rows)

    def _sampled_masses(self, b: int, n: int):
        """The sampler's attention masses (A_V, A_X) a batch carries for the token weights."""
        layers = self.model.config.text.num_hidden_layers
        return (np.zeros((b, layers, n), np.float32),) * 2

    def _rng(self, mesh=None):
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(
            key.shape, key.dtype, sharding=runtime.replicated(mesh or self.mesh)
        )

    @functools.cached_property
    def _sampling_config(self):
        """(config, why): with rollout.slots=auto a slot per row where none would fit the
        chip's memory share (a run stops at start; here the programs are compiled anyway,
        `why` says so)."""
        mesh, hbm = self.rollout[0], topology.hbm_bytes(self.slice)
        kw = dict(mesh=mesh, processes=self.slice.hosts)
        try:
            return setup.sampling_config(self.c, self.model.config, hbm=hbm, **kw), ""
        except ConfigError as e:
            return setup.sampling_config(self.c, self.model.config, hbm=0, **kw), str(e)

    def sampling_config(self):
        """The rollout's SamplingConfig as `jaxvrl.train` makes it on the slice's devices."""
        return self._sampling_config[0]

    # ------------------------------------------------------------------ programs
    def compile(self, name: str) -> Report:
        builders = {
            "train_step": self._train_step,
            "sampler": self._sampler,
            "decode_step": self._decode_step,
        }
        if name not in builders:
            raise ValueError(f"unknown program {name!r}; known: {', '.join(builders)}")
        lower, model_flops, breakdown, bound = builders[name]()
        return self._compile(name, lower, model_flops / self.mesh.size, breakdown, bound)

    def _compile(self, name, lower, model_flops, breakdown, bound=None) -> Report:
        """Compile with XLA's buffer assignment dumped to a scratch directory (the only place
        that names the temporaries when the compiler runs out of HBM)."""
        with tempfile.TemporaryDirectory(prefix="jaxvrl-aot-") as dump:
            opts = {"xla_dump_to": dump, "xla_dump_hlo_pass_re": "^$"}
            t0 = time.perf_counter()
            try:
                with setup.matmul_precision(self.c.model.matmul_precision):  # as the run traces it
                    lowered = lower()
                compiled = lowered.compile(compiler_options=opts)
            except Exception as e:  # jax raises JaxRuntimeError; OOM is RESOURCE_EXHAUSTED
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                secs = time.perf_counter() - t0
                largest = temporaries_from_dump(dump)
                return out_of_memory(
                    name, str(e), secs, self.slice, model_flops, breakdown, largest
                )
            secs = time.perf_counter() - t0
        return analyse(name, compiled, secs, self.slice, model_flops, breakdown, bound)

    def _train_step(self, micro_batches: int | None = None):
        cfg = self.step_config
        if micro_batches:
            cfg = cfg.with_values({"optim.micro_batches": micro_batches})
        i = self.init
        step = runtime.jit_train_step(
            build_train_step(i.graphdef, i.tx, cfg), self.mesh, i.state_shardings, i.ref_shardings
        )
        batch = self.batch(cfg if micro_batches else None)
        st = i.state
        breakdown = {
            "params": per_device_bytes(st.params),
            "optimizer": per_device_bytes((st.opt_state, st.critic_opt_state)),
            "critic": per_device_bytes(st.critic_params),
            "reference": per_device_bytes(i.ref_params),
            "batch": per_device_bytes(batch),
        }
        for part in setup.check_offload(self.c, self.mesh):  # in host memory, not HBM
            breakdown[f"host: {part}"] = breakdown.pop(part)
        flops = 6.0 * self.active_params * self.real_tokens  # MFU counts real tokens
        lower = lambda: step.lower(st, i.ref_params, batch, self._rng())  # noqa: E731
        return lower, flops, breakdown, None

    def _sampler(self):
        sampler = self.sampler()
        pools = "mdi" in self.c.reward.funcs or self.step_config.needs_attention
        prompts = self.sampler_prompts
        p = self.prompts(pools, prompts)
        params = self.init.state.params  # the trainer's: `prepare` puts them in the layout
        ready = sampler.prepare(params)
        g = self.c.rollout.num_generations

        def lower():
            return sampler.lower(
                ready,
                p["input_ids"],
                p["attention_mask"],
                p["position_ids"],
                p["deltas"],
                self._rng(sampler.mesh),
                images=p["images"],
                pools=p["pools"],
                num_samples=g,
                prefill_once=prompts * g == self.rows,
            )

        breakdown = {"params": per_device_bytes(ready.params), "prompts": per_device_bytes(p)}
        # one prefill per prompt, then every row's decode steps
        tokens = prompts * self.prompt_len + self.rows * self.new_tokens
        flops = 2.0 * self.active_params * tokens
        return lower, flops, breakdown, None

    @functools.cached_property
    def steps_at(self) -> dict:
        """The decode steps `decode_step_at` compiled, by rows."""
        return {}

    def decode_step_at(self, rows: int) -> Report:
        """The decode step compiled for `rows` rows (a narrowed slots loop's width), once."""
        if rows not in self.steps_at:
            lower, flops, breakdown, bound = self._decode_step(rows)
            self.steps_at[rows] = self._compile(
                "decode_step", lower, flops / self.mesh.size, breakdown, bound
            )
        return self.steps_at[rows]

    def _decode_step(self, rows: int | None = None):
        sampler = self.sampler()
        mesh = sampler.mesh
        rows = rows or self.rows
        ready = sampler.prepare(self.init.state.params)  # as the sampler's loop reads them
        dtype = nnx.merge(ready.graphdef, ready.params).dtype
        with jax.set_mesh(mesh):  # the cache's layout follows the rollout's devices
            state = static.abstract_loop_state(
                self.model.config, rows, self.prompt_len, sampler.cfg, dtype
            )
        state = jax.tree.map(lambda x, s: _abstract(x, s), state, decode_shardings(state, mesh))
        start = _with_shardings(np.zeros((rows,), np.int32), mesh, rows)
        # the carry is donated, as the loop updates it in place (else the step copies the cache)
        step = functools.partial(static.decode_step, ready.graphdef, cfg=sampler.cfg)
        fn = jax.jit(step, donate_argnums=1)

        def lower():
            with jax.set_mesh(mesh):
                return fn.lower(ready.params, state, start, self._rng(mesh))

        cache = per_device_bytes(state["cache"])
        weights = per_device_bytes(decoder_params(ready.params, self.model.config))
        bound = (weights + cache) / topology.bandwidth(self.slice)
        breakdown = {"params": per_device_bytes(ready.params), "kv_cache": cache}
        flops = 2.0 * self._decoder_params * rows
        return lower, flops, breakdown, bound

    @functools.cached_property
    def _decoder_params(self) -> int:
        """Parameters a decode step's token multiplies by (`active_count`)."""
        return active_count(self.init.state.params, self.model.config, decoder=True)

    def suggest_micro_batches(self, failed: Report) -> int | None:
        """The smallest optim.micro_batches whose train step fits, trying first the count at
        which the temporaries of `failed` (the configured step), shrinking with the rows per
        micro-batch, would leave room beside the arguments; then larger ones."""
        shards = row_shards(self.mesh)
        m0 = self.c.optim.micro_batches
        room = max(failed.hbm_bytes - failed.argument_bytes - failed.output_bytes, 1)
        start = max(m0 + 1, math.ceil(m0 * failed.peak_temp_bytes / room))
        for m in range(start, self.rows + 1):
            if self.rows % m or (self.rows // m) % shards:
                continue
            lower, flops, breakdown, _ = self._train_step(micro_batches=m)
            r = self._compile("train_step", lower, flops / self.mesh.size, breakdown)
            print(f"  micro_batches={m}: {r.peak_bytes / 2**30:.2f} GiB per device", flush=True)
            if r.fits:
                return m
        return None

    def suggest_sequence(self, lengths: str | None = None) -> dict | None:
        """Settings that split every row's tokens over more chips until the train step fits:
        mesh.sequence doubled (taken from mesh.fsdp), with the micro-batch count that leaves
        each device group one row of a micro-batch; None when none fits (or fsdp is odd)."""
        fsdp, seq = self.mesh.shape["fsdp"], self.mesh.shape["sequence"]
        updates = self.step_config.mini_batches
        while fsdp % 2 == 0:
            fsdp, seq = fsdp // 2, seq * 2
            groups = self.mesh.shape["data"] * fsdp * self.mesh.shape["expert"]
            m = max(self.rows // updates // groups, 1)
            values = {"mesh.fsdp": fsdp, "mesh.sequence": seq, "optim.micro_batches": m}
            if self._fits_with(values, lengths):
                return values
        return None

    def suggest_offload(self, lengths: str | None = None) -> dict | None:
        """Host offload the train step fits with: actor.offload_optimizer=true (the optimizer
        state in host memory, streamed through the chips a layer at a time), then with
        model.remat_policy=offload too (each layer's saved input there); only settings the
        config has not set."""
        values = {}
        if not self.c.actor.offload_optimizer:
            values["actor.offload_optimizer"] = True
            if self._fits_with(values, lengths):
                return values
        if self.c.model.remat_policy != "offload":
            values["model.remat_policy"] = "offload"
            if self._fits_with(values, lengths):
                return values
        return None

    def _fits_with(self, values: dict, lengths: str | None) -> bool:
        """Whether the train step fits with the config's `values` changed (printed)."""
        c = set_values(copy.deepcopy(self.c), values)
        try:
            plan = Plan.build(c, self.slice.name, lengths)
        except ConfigError as e:
            print(f"  {as_flags(values)}: {e}", flush=True)
            return False
        r = plan.compile("train_step")
        print(f"  {as_flags(values)}: {r.peak_bytes / 2**30:.2f} GiB per device", flush=True)
        return r.fits

    def _decode_words(self) -> str:
        words = "dense (XLA)"
        if self.decode_kernel:
            words = (
                "tpu (the Pallas kernel, priced by XLA from its cost estimate: the whole cache, "
                "the queries and outputs it reads)"
            )
        slots, ps = self.sampling_config().slots, self.c.rollout.page_size
        if slots:  # the sampler program is the slots engine's; decode_step the static one's
            why = self._sampling_config[1]
            return f"{words}; {slots} slots over pages of {ps} (rollout.slots)" + (
                f" although a run would stop: {why}" if why else ""
            )
        return f"{words}; the static sampler (rollout.slots=0)"

    def describe(self) -> str:
        m = self.model.config
        active = ""
        if self.active_params != self.params_count:  # MFU counts these
            active = f" ({self.active_params / 1e9:.2f}B active per token)"
        shape = " x ".join(f"{k} {v}" for k, v in self.mesh.shape.items())
        cfg = self.step_config
        updates = cfg.mini_batches  # per epoch; each reads rows / updates rows
        micro_rows = self.rows // updates // cfg.micro_batches
        shards = row_shards(self.mesh)
        warn = ""
        if micro_rows % shards:
            warn = (
                f"\nwarning: a micro-batch of {micro_rows} rows does not split over the "
                f"{shards} chips of mesh.data x mesh.fsdp x mesh.expert, so each chip computes all of them: "
                "fewer optim.micro_batches (or more rows) put fewer rows on each chip"
            )
        rmesh, rdtype = self.rollout
        rshape = " x ".join(f"{k} {v}" for k, v in rmesh.shape.items() if k != "fsdp")
        return (
            (
                f"{topology.describe(self.slice)}; mesh {shape}; rollout mesh {rshape}, "
                f"{rdtype or self.c.model.dtype}, decode attention {self._decode_words()}\n"
                f"model {self.model_name}: {self.params_count / 1e9:.2f}B params{active} "
                f"({self.c.model.param_dtype} weights, {self.c.model.dtype} compute, remat "
                f"{self.c.model.remat_policy}, attention {self.attention}), text "
                f"{m.text.num_hidden_layers} layers\n"
                f"step: {self.rows} rows ({self.c.prompts_per_step} prompts x "
                f"{self.c.rollout.num_generations} x {self.slice.hosts} hosts), prompt "
                f"{self.prompt_len} tokens{self._image_words()}, completion "
                f"{self.new_tokens}; {updates} mini-batch(es) x {self.c.actor.ppo_epochs} epoch(s) "
                f"of updates, {self.c.optim.micro_batches} micro-batch(es) of {micro_rows} rows each"
            )
            + self._fit_words()
            + warn
        )

    def _fit_words(self) -> str:
        """How the batch is fitted to the completion lengths (`batch`)."""
        comp, cfg = self.completions, self.step_config
        b = self.batch()
        words = (
            f"\ncompletions: median {int(np.median(comp))}, max {int(comp.max())} of "
            f"{self.new_tokens} (real tokens {self.real_tokens:,} of "
            f"{self.rows * (self.prompt_len + self.new_tokens):,}); "
            f"{b.completion_length} completion columns"
        )
        if cfg.actor.padding_free:
            words += (
                f", packed: {b.pack_buffers} buffer(s) of {b.pack_length} per micro-batch "
                f"and device group ({b.pack_groups} groups) in the experience passes, "
                f"{b.update_pack[0]} of {b.update_pack[1]} in the updates"
            )
        if b.micro_batches:
            words += f"; {b.micro_batches} micro-batch(es) (actor.dynamic_batching)"
        return words + f"; shaping from the {cfg.actor.shaping_source}"


def as_flags(values: dict) -> str:
    """Dotted settings as the command line's --config flags."""
    return " ".join(f"--config.{k}={v}" for k, v in values.items())
