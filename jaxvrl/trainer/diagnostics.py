"""Where a model's attention goes, for the pictures of the run logs: a diagnostic pass over a
few logged rollout rows, outside the train step's program (its own jitted program, compiled
once per shape), and what the pictures need of it on the host.

The pass runs the model's forward with `key_queries` (the positions that predict the
completion's tokens): per layer, each key's heads-averaged attention probabilities summed
over those queries, float32[L, b, S] (dense with "xla", blocked over the forward's
log-sum-exps otherwise). The image and video tokens' masses are laid out on each frame's
merged-patch grid; the frames are rebuilt from the normalised patches. Where the run has a
perturbed pass (TPRL), the same rows run again on the blackened image, which also gives each
token's visual dependency (perception score) and, with perception filtering, its mask.
The pass runs after the step's update: its masses and scores are the updated policy's, on a
blackening of its own (a key from the run's seed and the step), while the VGR weights shown
are the train step's own.

The pass runs on this process's first rows and only in single-process runs (the params of a
multi-process run are split over hosts; there the pictures are skipped, with one warning).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl import models, rl
from jaxvrl.models.positions import attention_pools
from jaxvrl.rl.attention import layer_indices
from jaxvrl.trainer.passes import RolloutBatch, completion_hidden, perturbed_vision
from jaxvrl.trainer.rollout import Rollout

BANDS = ("all", "early", "middle", "late")  # rl.attention.LAYER_SETS: what MDI reads


@functools.partial(jax.jit, static_argnums=0)
def _pass(graphdef, params, batch: RolloutBatch, vision):
    """-> (key masses float32[L, b, S], entropy float32[b, N], log-probs float32[b, N] of the
    completion tokens at temperature 1) with `vision` = (images, videos) in place of the
    batch's."""
    images, videos = vision
    model = nnx.merge(graphdef, params)
    n = batch.completion_length
    queries = (
        jnp.zeros(batch.input_ids.shape, bool).at[:, -n - 1 : -1].set(batch.completion_mask > 0)
    )
    out = model.forward(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        images=images,
        videos=videos,
        key_queries=queries,
        return_logits=False,
    )
    hidden = out.hidden[:, -n - 1 : -1]
    tokens = batch.input_ids[:, -n:]

    def row(args):  # one row's [N, V] logits at a time
        h, t = args
        logp = jax.nn.log_softmax(model.logits(h), axis=-1)
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return ent, jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0]

    ent, logp = jax.lax.map(row, (hidden, tokens))
    return out.vision_mass, ent, logp


@functools.partial(jax.jit, static_argnums=0)
def _pool_pass(graphdef, params, batch: RolloutBatch):
    """-> (A_V, A_X) float32[L, b, N]: each completion token's attention masses over the
    batch's pools per layer, as the train step's passes compute them."""
    _, out = completion_hidden(nnx.merge(graphdef, params), batch, pools=True)
    return out.vision_mass, out.text_mass


def _shapes(*trees) -> tuple:
    """What a compiled program is specific to: the trees' structure, shapes and dtypes."""
    leaves, tree = jax.tree.flatten(trees)
    return tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


@dataclasses.dataclass
class AttentionMaps:
    """The diagnostic pass and its host layout for a model (`graphdef`, config `mcfg`).
    samples: rows per call (0: off); black_prob > 0: also the blackened image; top_p > 0: the
    perception mask of those scores (the run's perception filtering)."""

    graphdef: object
    mcfg: object
    samples: int = 4
    black_prob: float = 0.0
    top_p: float = 0.0
    # the pass compiled per input shapes (`prepare`): futures of jax's Compiled programs
    programs: dict = dataclasses.field(default_factory=dict, repr=False)
    # the token ids `attention_pools` reads (`jaxvrl.data.prompts.pool_token_ids`), for the
    # per-layer statistics of rows whose batch has no pools; None: those rows have none
    pool_tokens: dict | None = None

    @classmethod
    def build(cls, graphdef, mcfg, samples: int, step_cfg, pool_tokens=None) -> AttentionMaps:
        """From the train step's settings: the perturbed pass where the run has one."""
        perturbed = step_cfg.needs_perturbed
        perception = any(t.name == "perception_mask" for t in step_cfg.terms)
        top_p = step_cfg.option("tprl.top_p_perception_tokens") if perception else 0.0
        return cls(
            graphdef,
            mcfg,
            samples,
            float(step_cfg.tprl.black_prob) if perturbed else 0.0,
            float(top_p),
            pool_tokens=pool_tokens,
        )

    def __call__(self, params, rollout: Rollout, token_weights=None, rng=None) -> list[dict]:
        """params: the policy's (on `graphdef`); rollout: this process's (its samples are
        drawn as the markdown logs' are: kept or filtered); token_weights: float[B, N] (VGR)
        or None. Returns per sample {"kept": in the batch or filtered, "frames", "maps":
        {"clean"|"perturbed": {band: grids}}, "tokens" int[n], "values": {name: float[n]},
        "layers": {"mdi"|"aei_vision": float[L]}}; [] when off, multi-process or no image."""
        got = self._rows(rollout)
        if got is None:
            return []
        drawn, rows = got
        b = len(drawn)
        masses, ent, logp = jax.device_get(self._run(params, rows, (rows.images, rows.videos)))
        variants = {"clean": masses}
        values = {"entropy": ent}
        mask = np.asarray(rows.completion_mask)
        if self.black_prob > 0:  # rows with vision inputs only (`_rows`)
            rng = jax.random.key(0) if rng is None else rng
            black = models.processor(self.mcfg).black
            aug = perturbed_vision(rows, rng, self.black_prob, black)
            aug = jax.tree.map(np.asarray, jax.device_get(aug))
            masses_aug, _, logp_aug = jax.device_get(self._run(params, rows, aug))
            variants["perturbed"] = masses_aug
            score = rl.visual_dependency(logp_aug, logp, mask)
            values["perception score"] = score
            if self.top_p > 0:
                values["perception mask"] = rl.top_p_token_mask(score, mask, self.top_p)
            frames_aug = aug
        else:
            frames_aug = None
        if token_weights is not None:  # a filtered sample (not in the batch) has none
            weights = [None if not d.kept else np.asarray(token_weights)[d.row] for d in drawn]
            values = {"VGR weight": weights, **values}
        layers = self.layer_balance(params, rows, masses.shape[0])
        return [
            dict(
                self._sample(rows, r, variants, values, frames_aug),
                layers={k: v[:, r] for k, v in layers.items()},
                kept=drawn[r].kept,
            )
            for r in range(b)
            if self._has_vision(rows, r)
        ]

    def _rows(self, rollout: Rollout) -> tuple[list, RolloutBatch] | None:
        """(the samples drawn: `Rollout.drawn_batch`, kept or filtered, as the markdown
        logs' samples; their host rows); None when none is."""
        if not self.samples or jax.process_count() > 1:
            return None
        drawn, rows = rollout.drawn_batch(self.samples)
        if not drawn or rows is None:
            return None
        per_row = [x.pixel_values.ndim == 3 for x in (rows.images, rows.videos) if x is not None]
        if not per_row or not all(per_row):  # no vision input, or packed patches
            return None
        return drawn, jax.tree.map(np.asarray, rows)

    def prepare(self, params, rollout: Rollout, executor) -> None:
        """Compile the passes for `rollout`'s drawn rows on `executor` (a thread beside the
        train step) from the params' shapes and shardings, so that the call after the step
        finds them compiled: the compile overlaps the step instead of adding to the run's
        time. Programs compile at the caller's default matmul precision."""
        drawn = self._rows(rollout)
        if drawn is None:
            return
        rows = drawn[1]
        self._submit(executor, _pass, params, rows, (rows.images, rows.videos))
        pooled = self._pooled(rows)
        if pooled is not None:
            self._submit(executor, _pool_pass, params, pooled)

    def _submit(self, executor, fn, params, *args) -> None:
        key = (fn.__name__, _shapes(params, *args))
        if key in self.programs:
            return
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        )
        precision = jax.config.jax_default_matmul_precision

        def compile_program():
            with jax.default_matmul_precision(precision):
                return fn.lower(self.graphdef, shapes, *args).compile()

        self.programs[key] = executor.submit(compile_program)

    def _call(self, fn, params, *args):
        """fn's program that `prepare` compiled for these shapes, else jit's, on the args."""
        program = self.programs.get((fn.__name__, _shapes(params, *args)))
        if program is None:
            return fn(self.graphdef, params, *args)
        return program.result()(params, *args)

    def _run(self, params, rows: RolloutBatch, vision):
        """The pass with `vision` = (images, videos) in place of the rows'."""
        return self._call(_pass, params, rows, vision)

    def _pooled(self, rows: RolloutBatch) -> RolloutBatch | None:
        """The rows with attention pools: the batch's, else made by `attention_pools` from
        `pool_tokens`; None where neither is."""
        if rows.pools is not None:
            return rows
        if self.pool_tokens is None:
            return None
        prompt = rows.input_ids.shape[1] - rows.completion_length
        pools = attention_pools(rows.input_ids, rows.attention_mask, prompt, **self.pool_tokens)
        return rows.replace(pools=pools)

    def _has_vision(self, rows: RolloutBatch, r: int) -> bool:
        ids = np.asarray(rows.input_ids[r])
        return bool(np.any(np.isin(ids, self._vision_ids())))

    def _vision_ids(self):
        ids = [self.mcfg.image_token_id]
        if getattr(self.mcfg, "video_token_id", None) is not None:
            ids.append(self.mcfg.video_token_id)
        return ids

    def _sample(self, rows: RolloutBatch, r, variants, values, vision_aug) -> dict:
        n = int(np.asarray(rows.completion_mask[r]).sum())
        ids = np.asarray(rows.input_ids[r])
        which, token_id, inputs = 0, self.mcfg.image_token_id, rows.images
        if inputs is None or not np.any(ids == token_id):
            which, token_id, inputs = 1, self.mcfg.video_token_id, rows.videos
        frames, order = self.frames(inputs, r)
        shown = {"clean": frames}
        if vision_aug is not None:  # the perturbed (images, videos)
            shown["perturbed"] = self.frames(vision_aug[which], r)[0]
        maps = {}
        for name, masses in variants.items():
            if name not in shown:
                continue
            at = masses[:, r][:, ids == token_id]  # [L, tokens] in processor order
            maps[name] = {
                band: self.grids(at[layer_indices(at.shape[0], band)].mean(0), order)
                for band in BANDS
            }
        return {
            "frames": shown,
            "maps": maps,
            "tokens": ids[-rows.completion_length :][:n],
            "values": {
                k: np.asarray(v[r], np.float64)[:n] for k, v in values.items() if v[r] is not None
            },
        }

    def frames(self, inputs, r: int) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
        """Row r's frames float[h, w, 3] in [0, 1] from its normalised patches (the first of
        each temporal pair), and each frame's merged grid (gh, gw), in processor order."""
        proc = models.processor(self.mcfg)
        p, tp, m = proc.patch_size, proc.temporal_patch_size, proc.merge_size
        pv = np.asarray(inputs.pixel_values[r], np.float32)
        pos = np.asarray(inputs.rot_pos[r])
        seg = np.asarray(inputs.full_segments[r])
        mean, std = np.asarray(proc.image_mean), np.asarray(proc.image_std)
        frames, order = [], []
        for f in np.unique(seg[seg >= 0]):
            at = seg == f
            h, w = int(pos[at, 0].max()) + 1, int(pos[at, 1].max()) + 1
            img = np.zeros((h * p, w * p, 3), np.float32)
            patches = pv[at].reshape(-1, 3, tp, p, p)[:, :, 0].transpose(0, 2, 3, 1)
            for (y, x), patch in zip(pos[at], patches):
                img[y * p : (y + 1) * p, x * p : (x + 1) * p] = patch * std + mean
            frames.append(np.clip(img, 0.0, 1.0))
            order.append((h // m, w // m))
        return frames, order

    @staticmethod
    def grids(masses: np.ndarray, order) -> list[np.ndarray]:
        """The vision tokens' masses float[tokens] (processor order) cut into frame grids."""
        out, start = [], 0
        for gh, gw in order:
            out.append(np.asarray(masses[start : start + gh * gw]).reshape(gh, gw))
            start += gh * gw
        return out

    def layer_balance(self, params, rows: RolloutBatch, layers: int) -> dict:
        """Per layer, each row's sequence MDI and AEI of the vision pool, as the run's
        attention statistics define them (`rl.attention_metrics` over that layer alone: each
        completion token's masses renormalised over the prompt, averaged over the tokens;
        the pools of the batch, else of `attention_pools`): float[L, b] each; NaN for a row
        without a pool, or for every row where no pools can be made (no `pool_tokens`)."""
        b = rows.input_ids.shape[0]
        pooled = self._pooled(rows)
        if pooled is None:
            return {k: np.full((layers, b), np.nan) for k in ("mdi", "aei_vision")}
        a_v, a_x = jax.device_get(self._call(_pool_pass, params, pooled))
        n = a_v.shape[-1]
        tile = lambda x: np.tile(np.asarray(x), (layers,) + (1,) * (np.ndim(x) - 1))  # noqa: E731
        # each layer's rows as rows of one layer: [L, b, N] -> [1, L * b, N]
        stats = rl.attention_metrics(
            a_v.reshape(1, layers * b, n),
            a_x.reshape(1, layers * b, n),
            tile(np.sum(pooled.pools["vision"], -1)),
            tile(np.sum(pooled.pools["text"], -1)),
            tile(rows.completion_mask),
        )
        return {
            k: np.asarray(stats[k], np.float64).reshape(layers, b) for k in ("mdi", "aei_vision")
        }
