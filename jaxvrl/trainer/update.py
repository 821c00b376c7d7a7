"""The update phase of the train step: `epochs` x `mini_batches` policy updates over one rollout
batch, with its experience (old log-probs, advantages, masks, weights) held fixed.

The updates run as one `lax.scan` inside the step's program. Each reads its rows of the batch
(`update_order`), accumulates the gradient of the loss over `micro_batches` with the
mini-batch's own denominators (so the micro-batch losses add up to the mini-batch's), then
applies optax; the critic's clipped value loss is minimised on the same rows. With LoRA only
the adapters are differentiated and updated. A non-finite loss or gradient skips that update
(counted in metrics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxvrl import rl
from jaxvrl.models import lora, moe
from jaxvrl.trainer import critic as critic_lib
from jaxvrl.trainer import methods, offload
from jaxvrl.trainer.experience import Experience, Extras, Passes, Rows, shaping
from jaxvrl.trainer.passes import (
    RolloutBatch,
    batch_rows,
    completion_hidden,
    micro_split,
    router_mismatch,
    router_tokens,
    split_rows,
    take_rows,
)
from jaxvrl.trainer.state import StepConfig, TrainState, join, split_trainable


@struct.dataclass
class MicroInputs:
    """What the loss reads for one micro-batch besides its rows of the batch: their
    experience rows, the micro-batch's share of the mini-batch's denominator (`share`, with
    the token weights: the policy loss's and the loss terms'), its share of the completion tokens
    (`token_share`: the token means logged add up over micro-batches), its LoRA dropout key,
    and with the critic on the shared backbone the global token count."""

    rows: Rows
    share: jax.Array
    dropout_key: jax.Array | None = None
    vf_total: jax.Array | None = None
    token_share: jax.Array | None = None  # None: `share`


@struct.dataclass
class LossMetrics:
    """A micro-batch loss's metrics, by how micro-batches combine them: `sums` (token means
    scaled by the share: they add up), `maxima` (combined by max), `old_sums` (token sums of
    the entropy and KL, when no old-policy pass reported them) and `extras` (the in-loss
    shaping's advantages and weights, one micro-batch)."""

    sums: dict
    maxima: dict
    old_sums: dict | None = None
    extras: Extras | None = None


def update_order(rng, rows: int, epochs: int, mini_batches: int) -> jax.Array:
    """int32[epochs * mini_batches, rows // mini_batches]: the batch rows each update reads,
    in update order, for the step's `rng`.

    The first epoch walks the rows in order (mini-batches of whole groups); each later epoch e
    walks a permutation of the rows drawn from fold_in(fold_in(rng, 2), e). Rows, not groups,
    are shuffled: advantages and every group statistic are fixed before the first update.
    With one mini-batch every epoch reads all rows in order (the order would only change the
    float rounding)."""
    key = jax.random.fold_in(rng, 2)
    ident = jnp.arange(rows, dtype=jnp.int32)
    perms = [ident]
    for e in range(1, epochs):
        shuffled = jax.random.permutation(jax.random.fold_in(key, e), rows).astype(jnp.int32)
        perms.append(ident if mini_batches == 1 else shuffled)
    return jnp.stack(perms).reshape(epochs * mini_batches, rows // mini_batches)


def _denominator(mode: str, mask, weights):
    """What `mode` divides by on these rows; micro-batch losses are rescaled by their share of
    the mini-batch's denominator, so their sum is exactly the mini-batch's loss."""
    if mode == "token-mean":
        return jnp.sum(mask if weights is None else mask * weights)
    return jnp.sum(jnp.any(mask > 0, axis=-1)).astype(jnp.float32)


def _loss(trainable, frozen, graphdef, mb: RolloutBatch, aux: MicroInputs, cfg, head=None):
    """(loss of one micro-batch, already scaled by its share of the mini-batch's
    denominator, LossMetrics). With `head` (critic on the shared backbone) plus
    value_loss_coef * the clipped value loss. With actor.router_aux_loss_coef > 0 (a model
    with sparse layers) plus coef * the experts' load-balancing loss over the micro-batch's
    real tokens (`moe.load_balancing_loss`, metric `router_aux_loss`), scaled by the share
    like the policy loss terms: the micro-batches' losses add up to the share-weighted mean
    of theirs, not to one loss over the mini-batch's tokens (its expert counts and
    probabilities are token means, whose product does not split over micro-batches)."""
    model = nnx.merge(graphdef, join(trainable, frozen))
    rows = aux.rows
    if aux.dropout_key is not None:  # LoRA dropout, in the gradient pass only
        lora.set_dropout_key(model, aux.dropout_key)
    in_loss = cfg.shaping_in_loss
    router_coef = cfg.actor.router_aux_loss_coef
    pools = in_loss and cfg.needs_attention
    # the sampler's routes replayed (actor.routing_replay), or compared with this pass's
    # where no old-policy pass did (train/router_mismatch)
    routing = "replay" if cfg.actor.routing_replay else "fresh" if cfg.old_pass else "compare"
    load = model.expert_capacity > 0  # pairs past it dropped: counted
    comp, out = completion_hidden(
        model, mb, pools=pools, router=router_coef > 0, routing=routing, load=load
    )
    grad_entropy = cfg.grad_entropy  # a loss term reads it
    want_entropy = grad_entropy or not cfg.old_pass
    logp, entropy = comp.logprobs(
        model,
        cfg.temperature,
        entropy=("grad" if grad_entropy else "value") if want_entropy else "none",
    )
    mask = mb.completion_mask
    sg = jax.lax.stop_gradient
    # one update without an old-policy pass: the old policy is this one, exactly
    old_logp = sg(logp) if rows.old_logp is None else rows.old_logp
    adv, token_mask, weights = rows.advantages, rows.token_mask, rows.token_weights
    shaping_metrics = {}
    if in_loss:  # the whole batch is here: shape it from this pass's own quantities (the
        # policy's before this update, also where the sampler's log-probs are an older one's)
        local = Passes(
            old_logp=sg(logp), entropy=sg(entropy), aug_logp=rows.aug_logp, ref_logp=rows.ref_logp
        )
        if cfg.needs_attention:
            local = local.replace(vision_mass=sg(out.vision_mass), text_mass=sg(out.text_mass))
        adv, token_mask, weights, shaping_metrics = shaping(mb, local, cfg, adv)
    if rows.is_weights is not None:  # rollout correction: on the per-token terms, like a mask
        w = rows.is_weights
        token_mask = w if token_mask is None else token_mask * w
    loss, metrics = rl.policy_loss(
        logp,
        old_logp,
        adv,
        mask,
        clip_ratio_low=cfg.actor.clip_ratio_low,
        clip_ratio_high=cfg.actor.clip_ratio_high,
        clip_ratio_dual=cfg.actor.clip_ratio_dual,
        loss_agg_mode=cfg.actor.loss_agg_mode,
        token_mask=token_mask,
        token_weights=weights,
        horizon=cfg.rollout.max_new_tokens,  # the completion axis may be cut to the batch
    )
    metrics = {"pg_loss": loss, **metrics}
    # the loss terms of the token methods (KL loss, entropy bonus and penalty, ...)
    # with token weights (VGR) the terms aggregate over m * w too: the weights scale the loss
    # mask, as the VGR designs apply them (EasyR1's and TRL's KL loss read that mask)
    term_mask = mask if weights is None else mask * weights
    cols = {"completion_mask": term_mask, "has_image": mb.has_image, "pools": mb.pools}
    cols["logp"] = logp
    if want_entropy:
        cols["entropy"] = entropy
    if rows.ref_logp is not None:
        cols["ref_logp"] = rows.ref_logp
    zero = jnp.zeros((), loss.dtype)
    terms, term_metrics = methods.loss_terms(cfg.terms, cols, dict(cfg.options), zero)
    if out.router_logits is not None:
        top_k = model.config.text.num_experts_per_tok
        router = moe.load_balancing_loss(out.router_logits, top_k, router_tokens(mb))
        loss = loss + router_coef * router
        metrics["router_aux_loss"] = router
    if out.route_mismatch is not None and not cfg.old_pass:
        metrics["router_mismatch"] = router_mismatch(out.route_mismatch, mb)
    if out.expert_dropped is not None:  # the share of pairs, over the sparse layers
        metrics["expert_dropped"] = jnp.mean(out.expert_dropped)
    scale = aux.share
    loss = (loss + terms) * scale
    # the loss's parts add up as the loss does; the token means by each micro-batch's tokens
    parts = {k: metrics.pop(k) for k in ("pg_loss", "router_aux_loss") if k in metrics}
    tokens = scale if aux.token_share is None else aux.token_share
    metrics = jax.tree.map(lambda x: x * tokens, metrics)
    metrics.update(jax.tree.map(lambda x: x * scale, {**parts, **term_metrics}))
    log_ratio = jnp.clip(sg(logp) - old_logp, -20.0, 20.0)
    maxima = {"ratio_max": jnp.max(jnp.where(mask > 0, jnp.exp(log_ratio), 0.0))}
    extras = old_sums = None
    if in_loss:  # one micro-batch: share = 1, nothing to rescale
        metrics.update(shaping_metrics)
        extras = Extras(adv, weights)
    if not cfg.old_pass:  # token sums of what the old pass would have given, for the metrics
        old_sums = {"entropy": jnp.sum(sg(entropy) * mask)}
        if rows.ref_logp is not None:
            kl = rl.kl_penalty(sg(logp), rows.ref_logp, cfg.actor.kl_loss_type)
            old_sums["kl"] = jnp.sum(kl * mask)
    if head is not None:
        values = comp.per_row(critic_lib.head_values(comp.hidden, head))
        vf, vmets = critic_lib.value_loss_terms(
            values, rows.old_values, rows.returns, mask, cfg.critic.cliprange_value, aux.vf_total
        )
        loss = loss + cfg.critic.value_loss_coef * vf
        metrics.update(vmets)
    return loss, LossMetrics(metrics, maxima, old_sums, extras)


def _accumulate(grad_fn, params, micro_xs):
    """Sum of (loss, metrics) and gradients of grad_fn(params, *xs) over the micro-batches;
    LossMetrics' maxima are combined by their maximum, any other metrics added."""
    first = jax.tree.map(lambda x: x[0], micro_xs)
    mets0 = jax.eval_shape(lambda: grad_fn(params, *first)[0][1])
    mets0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mets0)

    def combine(acc, new):
        if isinstance(acc, LossMetrics):
            summed = jax.tree.map(jnp.add, acc.replace(maxima={}), new.replace(maxima={}))
            return summed.replace(maxima=jax.tree.map(jnp.maximum, acc.maxima, new.maxima))
        return jax.tree.map(jnp.add, acc, new)

    def body(carry, xs):
        (loss, mets), grads = grad_fn(params, *xs)
        g_acc, l_acc, m_acc = carry
        return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss, combine(m_acc, mets)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss, mets), _ = jax.lax.scan(body, (zeros, jnp.zeros(()), mets0), micro_xs)
    return grads, loss, mets


def _apply(tx, grads, opt_state, params, ok, host: bool = False, clip: float | None = None):
    """optax update where `ok`, else the old params and optimizer state. host: the optimizer
    state lives in host memory (actor.offload_optimizer) and is streamed through the devices
    a layer at a time (`offload.streamed_update`; clip: the global-norm clip `tx` begins
    with)."""
    if host:
        return offload.streamed_update(tx, grads, opt_state, params, ok, clip)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return offload.pick(ok, new_params, params), offload.pick(ok, new_opt, opt_state)


def _advance_schedule(opt_state, where):
    """The optimizer state with its learning-rate schedule's update count one on where
    `where` (Adam's moments and bias-correction count stay, as torch's skipped
    optimizer.step() leaves them)."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731

    def bump(x):
        if not is_schedule(x):
            return x
        return x._replace(count=x.count + jnp.asarray(where).astype(x.count.dtype))

    return jax.tree.map(bump, opt_state, is_leaf=is_schedule)


def _critic_update(graphdef, cparams, copt, frozen, mb: RolloutBatch, rows: Rows, cfg):
    """Critic gradient over the micro-batches of these rows and its optax update (skipped if
    non-finite)."""
    m = cfg.micro_batches
    total = jnp.sum(mb.completion_mask > 0).astype(jnp.float32)
    targets = split_rows((rows.old_values, rows.returns), m)

    def fn(cp, mb, a):
        return critic_lib.loss(
            cp,
            frozen,
            graphdef,
            mb,
            *a,
            cfg.critic.cliprange_value,
            cfg.critic.value_loss_coef,
            total,
        )

    grad_fn = jax.value_and_grad(fn, has_aux=True)
    grads, loss, mets = _accumulate(grad_fn, cparams, (micro_split(mb, m), targets))
    norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    ctx = critic_lib.make_optimizer(cfg.critic.lr, cfg.critic.grad_clip)
    off = cfg.actor.offload_optimizer
    ok = finite & (total > 0)  # padding groups alone: no update
    cparams, copt = _apply(ctx, grads, copt, cparams, ok, off, cfg.critic.grad_clip)
    mets = dict(mets, critic_grad_norm=norm, critic_nonfinite=(~finite).astype(jnp.int32))
    return cparams, copt, mets


def _head_update(cparams, copt, g_head, cfg: StepConfig, tokens):
    """The shared-backbone critic: only the value head is the critic optimizer's (no update
    without completion `tokens`)."""
    norm = optax.tree.norm(g_head)
    finite = jnp.isfinite(norm)
    ctx = critic_lib.make_optimizer(cfg.critic.lr, cfg.critic.grad_clip)
    off = cfg.actor.offload_optimizer
    ok = finite & (tokens > 0)
    head, opt = _apply(ctx, {"head": g_head}, copt, cparams, ok, off, cfg.critic.grad_clip)
    return head, opt, {"critic_grad_norm": norm, "critic_nonfinite": (~finite).astype(jnp.int32)}


def _policy_grads(graphdef, step, trainable, frozen, xs, head, cfg: StepConfig):
    """(grads of the trainable params, grads of the shared value head or None, loss,
    metrics) over the micro-batches xs = (batch, aux). A separate critic's warm-up (before
    step `critic_warmup_steps`) skips the computation."""
    if head is not None:
        grad_fn = jax.value_and_grad(
            lambda p, mb, a: _loss(p[0], frozen, graphdef, mb, a, cfg, head=p[1]), has_aux=True
        )
        (grads, g_head), loss, mets = _accumulate(grad_fn, (trainable, head), xs)
        return grads, g_head, loss, mets
    grad_fn = jax.value_and_grad(
        lambda p, mb, a: _loss(p, frozen, graphdef, mb, a, cfg), has_aux=True
    )
    run = lambda: _accumulate(grad_fn, trainable, xs)  # noqa: E731
    if not (cfg.has_critic and cfg.critic.warmup_steps > 0):
        grads, loss, mets = run()
        return grads, None, loss, mets
    # during the warm-up the policy's loss and metrics read 0 (policy_updated = 0)
    shapes = jax.eval_shape(run)
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)  # noqa: E731
    grads, loss, mets = jax.lax.cond(step >= cfg.critic.warmup_steps, run, zeros)
    return grads, None, loss, mets


def _micro_aux(mb: RolloutBatch, rows: Rows, keys, cfg: StepConfig) -> MicroInputs:
    """The loss's per-micro-batch inputs [m, b/m, ...]: the experience rows (the critic's
    targets only for the shared backbone's value loss), each micro-batch's share of the
    mini-batch's denominator, LoRA dropout keys, the shared critic's token count."""
    m, mode = cfg.micro_batches, cfg.actor.loss_agg_mode
    mask, weights = mb.completion_mask, rows.token_weights

    micro_w = None if weights is None else split_rows(weights, m)
    parts = jax.vmap(lambda mk, w: _denominator(mode, mk, w))(split_rows(mask, m), micro_w)
    share = parts / jnp.maximum(_denominator(mode, mask, weights), 1e-8)
    tokens = jax.vmap(jnp.sum)(split_rows(mask > 0, m)).astype(jnp.float32)
    token_share = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    vf_total = None
    if cfg.has_critic and cfg.critic.share_backbone:
        vf_total = jnp.full((m,), jnp.sum(mask > 0), jnp.float32)
    else:
        rows = rows.replace(old_values=None, returns=None)
    return MicroInputs(split_rows(rows, m), share, keys, vf_total, token_share)


def _one_update(graphdef, tx, step, frozen, batch, exp: Experience, cfg: StepConfig):
    """The scan body: carry {trainable, opt, critic, critic_opt}, xs (rows int32[b], LoRA
    dropout keys [m] or None, the rows' packing starts int32[b] or None) -> (carry,
    (metrics, extras or None))."""
    shared = cfg.has_critic and cfg.critic.share_backbone

    def body(carry, xs):
        idx, keys, starts = xs
        if cfg.mini_batches == 1 and starts is None:  # the whole batch in order: no gather
            mb, rows = batch, exp.rows
        else:
            mb, rows = batch_rows(batch, idx), take_rows(exp.rows, idx)
        if starts is not None:  # this update's micro-batches' packing
            buffers, length, completions = batch.update_pack
            mb = mb.replace(
                pack_start=starts,
                pack_buffers=buffers,
                pack_length=length,
                pack_completions=completions,
            )
        aux = _micro_aux(mb, rows, keys, cfg)
        head = carry["critic"]["head"] if shared else None
        xs = (micro_split(mb, cfg.micro_batches), aux)
        grads, g_head, loss, mets = _policy_grads(
            graphdef, step, carry["trainable"], frozen, xs, head, cfg
        )
        extras, old_sums = mets.extras, mets.old_sums
        mets = {**mets.sums, **mets.maxima}
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        warm = step >= cfg.critic.warmup_steps if cfg.has_critic else True
        # a mini-batch of padding groups alone (dynamic sampling short of groups) has nothing
        # to learn: AdamW's momentum and decay would still move the weights
        tokens = jnp.sum(mb.completion_mask > 0)
        ok = finite & warm & (tokens > 0)
        off, clip = cfg.actor.offload_optimizer, cfg.optim.grad_clip
        trainable, opt = _apply(tx, grads, carry["opt"], carry["trainable"], ok, off, clip)
        # a non-finite or empty update is skipped, but the schedule moves on (verl steps its
        # scheduler every step): the step's other updates and the later steps keep their rates
        opt = _advance_schedule(opt, ~ok & warm)
        carry = dict(carry, trainable=trainable, opt=opt)
        mets.update(
            loss=loss,
            grad_norm=grad_norm,
            nonfinite=(~finite).astype(jnp.int32),
            applied=ok.astype(jnp.int32),
            tokens=tokens,
        )
        if old_sums is not None:  # no old-policy pass: this update's pass reports them
            mets.update({k: v / jnp.maximum(tokens, 1) for k, v in old_sums.items()})
        if shared:
            cp, copt, cmets = _head_update(
                carry["critic"], carry["critic_opt"], g_head, cfg, tokens
            )
        elif cfg.has_critic:
            cp, copt, cmets = _critic_update(
                graphdef, carry["critic"], carry["critic_opt"], frozen, mb, rows, cfg
            )
        if cfg.has_critic:
            carry = dict(carry, critic=cp, critic_opt=copt)
            mets.update(cmets)
        return carry, (mets, extras)

    return body


def _combine(per: dict) -> dict:
    """Metrics of the updates [U] -> the step's: means over the updates that had completion
    tokens (a mini-batch of padding groups alone reads 0 everywhere), except clip_frac_last
    (the last such update's), ratio_max (the largest), nonfinite and critic_nonfinite
    (counts), updates (policy updates applied) and policy_updated (whether any was)."""
    applied = per.pop("applied")
    real = (per.pop("tokens") > 0).astype(jnp.float32)
    n = jnp.maximum(real.sum(), 1.0)
    out = {k: jnp.sum(v.astype(jnp.float32) * real) / n for k, v in per.items()}
    last = jnp.max(jnp.where(real > 0, jnp.arange(real.shape[0]), 0))
    out.update(
        clip_frac_last=per["clip_frac"][last],
        ratio_max=jnp.max(per["ratio_max"]),
        nonfinite=jnp.sum(per["nonfinite"]),
        updates=jnp.sum(applied),
    )
    if "critic_nonfinite" in per:
        out["critic_nonfinite"] = jnp.sum(per["critic_nonfinite"])
        out["policy_updated"] = jnp.max(applied)
    return out


def update(graphdef, tx, state: TrainState, exp: Experience, batch: RolloutBatch, rng, cfg):
    """All policy (and critic) updates of one step -> (state, metrics, extras or None: the
    in-loss shaping's advantages and token weights). `rng` orders the rows (`update_order`)
    and draws LoRA dropout (fold_in(rng, 1), then per update u > 0 fold_in(that, u))."""
    trainable, frozen = split_trainable(state.params, cfg)
    u, m = cfg.updates, cfg.micro_batches
    order = batch.update_rows  # the packing plan's (balanced), or:
    if order is None:
        order = update_order(rng, batch.completion_mask.shape[0], cfg.epochs, cfg.mini_batches)
    keys = None
    if cfg.uses_lora:
        k_drop = jax.random.fold_in(rng, 1)
        per_update = [k_drop] + [jax.random.fold_in(k_drop, i) for i in range(1, u)]
        keys = jnp.stack([jax.random.split(k, m) for k in per_update])
    carry = {
        "trainable": trainable,
        "opt": state.opt_state,
        "critic": state.critic_params,
        "critic_opt": state.critic_opt_state,
    }
    starts = batch.update_starts
    batch = batch.replace(update_starts=None, update_rows=None)  # not row arrays
    body = _one_update(graphdef, tx, state.step, frozen, batch, exp, cfg)
    # a loop's carry lives in device memory: with the optimizer state on the host the
    # updates run unrolled, so that only the streamed update brings it in
    unroll = cfg.actor.offload_optimizer or 1
    carry, (per, extras) = jax.lax.scan(body, carry, (order, keys, starts), unroll=unroll)
    metrics = _combine(per)
    new_state = state.replace(
        params=join(carry["trainable"], frozen),
        opt_state=carry["opt"],
        step=state.step + 1,
        skipped=state.skipped + metrics["nonfinite"],
        critic_params=carry["critic"],
        critic_opt_state=carry["critic_opt"],
    )
    metrics["nonfinite_total"] = new_state.skipped  # over the run: the state is checkpointed
    if extras is not None:  # shaping inside the loss pass: one update, rows back in place
        back = jnp.argsort(order[0])
        extras = jax.tree.map(lambda x: jnp.take(x[0], back, axis=0), extras)
    return new_state, metrics, extras
