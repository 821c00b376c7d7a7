"""The PPO critic: a value head (Linear hidden -> 1) on a Qwen2.5-VL backbone.

The backbone has the policy's graph and starts from the policy's initial weights. Its trained
part lives in TrainState.critic_params["backbone"] (every weight for full fine-tuning, only
the adapters with LoRA, whose frozen base weights are the policy's: no second copy). With
critic.share_backbone the head reads the policy's own hidden states: the value loss (times
value_loss_coef) joins the policy loss, and the critic optimizer holds the head only.
Values are taken where the logits are: the hidden state before each completion token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxvrl import rl
from jaxvrl.trainer.passes import RolloutBatch, completion_hidden


def init_head(hidden_size: int, seed: int = 0) -> dict:
    """{"kernel": float32[D, 1] ~ N(0, 0.02), "bias": float32[1] zeros} (HF's score head init)."""
    k = jax.random.normal(jax.random.key(seed), (hidden_size, 1), jnp.float32) * 0.02
    return {"kernel": k, "bias": jnp.zeros((1,), jnp.float32)}


def make_optimizer(lr: float, grad_clip: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(lr, weight_decay=0.0))


def init_params(trainable, hidden_size: int, seed: int = 0, share_backbone: bool = False):
    """The critic's trained params: a copy of the policy's initial trainable part (none with a
    shared backbone) and the value head."""
    head = init_head(hidden_size, seed)
    if share_backbone:
        return {"head": head}
    return {"backbone": jax.tree.map(jnp.array, trainable), "head": head}


def values(graphdef, backbone, head: dict, batch: RolloutBatch) -> jax.Array:
    """V(s_t) before each completion token: float32[B, N]. `backbone` is the full State."""
    model = nnx.merge(graphdef, backbone)
    comp = completion_hidden(model, batch)[0]
    return comp.per_row(head_values(comp.hidden, head))


def head_values(hidden: jax.Array, head: dict) -> jax.Array:
    """hidden float[B, N, D] -> values float32[B, N]."""
    h = hidden.astype(jnp.float32)
    return jnp.einsum("BND,DO->BNO", h, head["kernel"])[..., 0] + head["bias"][0]


def value_loss_terms(v, old_values, returns, mask: jax.Array, clip: float, total):
    """Clipped value loss of one micro-batch over the global token count `total` (so
    micro-batch losses add up to the batch's) and its metrics weighted by the token share.
    v, old_values, returns: float32[b, N]."""
    vf, metrics = rl.value_loss(
        v,
        old_values,
        returns,
        mask,
        clip_range=clip,
        loss_agg_mode="token-mean",
        denominator=total,
    )
    share = jnp.sum(mask > 0) / jnp.maximum(total, 1.0)
    return vf, {"vf_loss": vf, **jax.tree.map(lambda x: x * share, metrics)}


def loss(
    critic_params: dict,
    frozen,
    graphdef,
    mb: RolloutBatch,
    old_values,
    returns,
    clip: float,
    coef: float,
    total_tokens,
):
    """coef * clipped value loss of one micro-batch, token-mean over the global token count
    (so micro-batch losses add up to the batch's). old_values, returns: float32[b, N]."""
    backbone = critic_params["backbone"]
    full = backbone if frozen is None else nnx.merge_state(backbone, frozen)
    v = values(graphdef, full, critic_params["head"], mb)
    mask = mb.completion_mask
    vf, metrics = value_loss_terms(v, old_values, returns, mask, clip, total_tokens)
    return coef * vf, metrics
