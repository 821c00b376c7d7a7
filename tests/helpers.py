"""Shared pieces of the trainer and parallel tests: the step's settings from configs/base.py
and a hand-made rollout batch on the tiny HF checkpoint (tests/models/hf_tiny.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import base
from jaxvrl.config import set_values, validate
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.trainer.rollout import assemble
from jaxvrl.trainer.state import StepConfig, TrainState
from tests.models import hf_tiny as T

G = 2  # completions per prompt
N = 5  # completion length
GRIDS = ([[1, 4, 4]], [[1, 2, 6]], [[1, 2, 4]], [[1, 4, 2]])  # each prompt's image, in turn


def batch_sharding(mesh, ndim: int) -> jax.sharding.NamedSharding:
    """An array of `ndim` axes with its rows (axis 0) split over (data, fsdp), the rest
    replicated: how the step's batch lies on the mesh."""
    rows = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    spec = jax.sharding.PartitionSpec(rows, *([None] * (ndim - 1)))
    return jax.sharding.NamedSharding(mesh, spec)


def step_config(values=None) -> StepConfig:
    """The step settings of configs/base.py with G completions per prompt, token-mean
    aggregation (the tests' reference losses) and `values` (dotted keys) set, rules checked."""
    c = base.get_config()
    set_values(c, {"rollout.num_generations": G, "actor.loss_agg_mode": "token-mean"})
    set_values(c, values or {})
    validate(c, "the test's values")
    return StepConfig.of(c)


def make_prompts(model, prompts: int = 2, seed=0, pools: bool = False) -> dict:
    """`prompts` x G left-padded rows, each prompt with its own image (per-row vision layout):
    the sampler's inputs (numpy leaves, rows first; position_ids int[3, B, P]); with `pools`,
    the attention pools. seed: an int or a numpy Generator to draw from."""
    rng = np.random.default_rng(seed)
    rows, vis, grids = [], [], []
    for i in range(prompts):
        g = GRIDS[i % len(GRIDS)]
        p = T.prompt(rng, images=g, text_len=(3, 6))
        pv = T.patches(rng, g)
        for _ in range(G):
            rows.append(p)
            grids.append(g)
            vis.append(q.vision_inputs(pv, g, model.config.vision, num_patches=16))
    ids, mask = T.left_pad(rows, length=26)  # one prompt bucket for every seed
    pos, deltas = q.get_rope_index(ids, mask, model.config, np.concatenate(grids))
    out = dict(
        input_ids=ids.astype(np.int32),
        attention_mask=mask.astype(np.int32),
        position_ids=np.asarray(pos, np.int32),
        deltas=np.asarray(deltas, np.int32),
        images=q.stack_vision_inputs(vis),
    )
    if pools:
        out["pools"] = q.attention_pools(ids, mask, ids.shape[1], **T.POOL_IDS)
    return out


def make_batch(
    model,
    prompts: int = 2,
    seed: int = 0,
    rewards=None,
    old_logprobs=None,
    pools: bool = True,
    completion_seed: int | None = None,
    host: bool = False,
):
    """A RolloutBatch of `make_prompts` rows with random completions of N tokens (the second
    row ends after 3 tokens, the last after 1), random rewards (unless given) and the
    attention pools (unless pools=False). The
    completions are drawn after the prompts from one generator, or from `completion_seed`'s.
    host: numpy leaves (else jax arrays)."""
    rng = np.random.default_rng(seed)
    p = make_prompts(model, prompts, rng, pools)
    if completion_seed is not None:
        rng = np.random.default_rng(completion_seed)
    b = p["input_ids"].shape[0]
    tokens = rng.integers(20, 280, (b, N))
    comp = np.ones((b, N), np.float32)
    comp[1, 3:] = 0  # an EOS at position 2
    comp[-1, 1:] = 0
    rewards = rng.normal(size=b) if rewards is None else rewards
    batch = assemble(
        p["input_ids"],
        p["attention_mask"],
        p["position_ids"],
        p["deltas"],
        tokens,
        comp,
        rewards,
        np.ones(b, bool),
        images=p["images"],
        pools=p.get("pools"),
        old_logprobs=old_logprobs,
    )
    return batch if host else jax.tree.map(jnp.asarray, batch)


def init_state(model, tx):
    _, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.array, params)  # a private copy: the step donates it
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnums=(1, 3))  # compiled once per shape (gradients too)
@functools.partial(jax.jit, static_argnums=(1, 3))
def reference_logp(params, graphdef, batch, temperature):
    """(log-probs of the completion tokens [B, N], entropies [B, N]) from full logits (one
    program per model structure, batch shape and temperature)."""
    model = nnx.merge(graphdef, params)
    out = model.forward(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        images=batch.images,
        videos=batch.videos,
    )
    logits = out.logits[:, -N - 1 : -1] / temperature
    logp = jax.nn.log_softmax(logits, -1)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return jnp.take_along_axis(logp, batch.input_ids[:, -N:, None], -1)[..., 0], ent


def metrics_adv(batch):
    """GRPO advantages of the batch's rows: the magnitude of the policy loss's terms."""
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    return (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
