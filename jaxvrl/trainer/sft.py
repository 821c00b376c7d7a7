"""Supervised fine-tuning step (cross-entropy on target tokens), used to make the embedded
default checkpoint follow the answer format before RL."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def sft_loss(model, input_ids, attention_mask, position_ids, loss_mask, images=None, videos=None):
    """Mean cross-entropy of tokens where loss_mask (float32[B, T]) is 1; logits at t predict
    token t+1, so loss_mask marks the *predicted* tokens."""
    out = model.forward(input_ids, attention_mask, position_ids, images=images, videos=videos)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    tok_logp = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    m = loss_mask[:, 1:]
    return -jnp.sum(tok_logp * m) / jnp.maximum(jnp.sum(m), 1.0)


def make_sft_step(tx: optax.GradientTransformation):
    """step(model, optimizer, batch) -> loss; updates model and optimizer in place."""

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(m):
            return sft_loss(
                m,
                batch["input_ids"],
                batch["attention_mask"],
                batch["position_ids"],
                batch["loss_mask"],
                batch.get("images"),
                batch.get("videos"),
            )

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return step
