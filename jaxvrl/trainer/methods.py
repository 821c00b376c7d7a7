"""The token methods: what shapes the policy loss token by token, one `Term` each in the table
`TOKEN_METHODS`, which the train step iterates instead of naming each method.

The step's settings (`StepConfig.of`) read every config key the table declares and switch on
the entries whose `on` says so (`StepConfig.terms`). The experience phase (or the loss pass,
when it sees the whole batch) runs the shaping kinds in table order; the loss adds the "loss"
kind's terms in table order. What an entry reads decides which no-grad passes run:
"aug_logp" the perturbed-image pass, "vision_mass" / "text_mass" the attention masses,
"ref_logp" the reference pass.

Add a token method:

1. write `fn(cols, opts) -> (array, metrics)` (jnp; the RL math itself goes to jaxvrl/rl);
2. add one `Term(name, kind, reads, fn, keys, on)` to TOKEN_METHODS, `on` usually
   `flag("group.enable_x")`;
3. declare each of its keys in configs/base.py (one line with its rule and comment).

Nothing else changes. A test or a plugin trains with another table through
`StepConfig.of(c, table=TOKEN_METHODS + (Term(...),))`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp

from jaxvrl import rl

KINDS = ("column", "mask", "weight", "advantage", "loss")
SHAPING_KINDS = ("column", "mask", "weight", "advantage")  # computed from the old policy


def flag(key: str) -> Callable[[Mapping], bool]:
    """`on` of a term switched on by the boolean config key `key`."""
    return lambda opts: bool(opts[key])


@dataclasses.dataclass(frozen=True)
class Term:
    """One token method. name: its name (a column's name for the entries below it); kind: one
    of KINDS; reads: the columns fn needs; fn(cols, opts) -> (array, metrics); keys: the
    dotted config keys fn and on read; on(opts) -> bool: whether the config switches it on
    (None for a column: on when an entry switched on reads it).

    What fn returns, by kind: "column" float32[B, N], read by later entries by its name;
    "mask" float32[B, N] in {0, 1}, the step's masks combined by `rl.union_token_mask`,
    multiplying the per-token policy loss (its denominator keeps every completion token);
    "weight" float32[B, N], the step's weights multiplied together, weighing the loss's
    numerator and denominator; "advantage" float32[B], a factor on each row's advantages;
    "loss" float32[], added to the policy loss.

    cols, by name: the batch's "completion_mask", "has_image" and "pools" (None where the
    batch has none); the outputs of the no-grad passes that ran (`experience.Passes`:
    "old_logp", "entropy", "aug_logp" (none for a batch without images), "vision_mass",
    "text_mass", "ref_logp"); the columns computed so far; in the loss, "logp", "entropy"
    and "ref_logp" of the policy being trained (with gradients). An entry whose reads are
    not all there is skipped for that batch. opts: the values of `keys`, by key (a term
    reads no other setting). metrics: scalars logged under their names."""

    name: str
    kind: str
    reads: tuple[str, ...]
    fn: Callable
    keys: tuple[str, ...] = ()
    on: Callable[[Mapping], bool] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"token method {self.name!r}: kind {self.kind!r} not in {KINDS}")
        if (self.on is None) != (self.kind == "column"):
            raise ValueError(f"token method {self.name!r}: `on` is for every kind but column")

    def opts(self, options: Mapping) -> dict:
        """The values of this term's keys, from all the step's options."""
        return {k: options[k] for k in self.keys}

    def __call__(self, cols: Mapping, options: Mapping):
        """(array, metrics) of this batch, or None when one of its reads is missing."""
        if any(name not in cols for name in self.reads):
            return None
        return self.fn(cols, self.opts(options))


def active(table: tuple[Term, ...], options: Mapping) -> tuple[Term, ...]:
    """The entries of `table` the config switches on, with the columns they read (table
    order)."""
    chosen = {t.name for t in table if t.on is not None and t.on(t.opts(options))}
    needed = {r for t in table if t.name in chosen for r in t.reads}
    for t in reversed(table):  # a column may read the columns above it
        if t.kind == "column" and t.name in needed:
            chosen.add(t.name)
            needed.update(t.reads)
    return tuple(t for t in table if t.name in chosen)


def _token_mean(x, mask):
    return jnp.sum(x * mask) / jnp.maximum(mask.sum(), 1)


def shape(terms: tuple[Term, ...], cols: dict, options: Mapping, adv):
    """Run the shaping kinds of `terms` in order -> (advantages, token mask or None, token
    weights or None, metrics)."""
    mask = cols["completion_mask"]
    cols = dict(cols)
    masks, weights, metrics = [], [], {}
    for term in terms:
        if term.kind not in SHAPING_KINDS:
            continue
        out = term(cols, options)
        if out is None:
            continue
        value, term_metrics = out
        metrics.update(term_metrics)
        if term.kind == "column":
            cols[term.name] = value
        elif term.kind == "mask":
            masks.append(value)
        elif term.kind == "weight":
            weights.append(value)
        else:  # "advantage": a factor per row
            adv = adv * (value if adv.ndim == 1 else value[:, None])
    token_mask = rl.union_token_mask(*masks)
    if token_mask is not None:
        metrics["perception_token_fraction"] = _token_mean(token_mask, mask)
    weight = None
    for w in weights:
        weight = w if weight is None else weight * w
    return adv, token_mask, weight, metrics


def loss_terms(terms: tuple[Term, ...], cols: Mapping, options: Mapping, loss):
    """The policy loss plus the "loss" kind's terms of `terms`, in order -> (loss, metrics)."""
    metrics = {}
    for term in terms:
        out = term(cols, options) if term.kind == "loss" else None
        if out is not None:
            loss, metrics = loss + out[0], {**metrics, **out[1]}
    return loss, metrics


# -- the terms ----------------------------------------------------------------------------


def _visual_dependency(cols, opts):
    mask = cols["completion_mask"]
    score = rl.visual_dependency(cols["aug_logp"], cols["old_logp"], mask)
    return score, {"sensitivity_score_mean": _token_mean(score, mask)}


def _perception_mask(cols, opts):
    top_p = opts["tprl.top_p_perception_tokens"]
    score, mask = cols["visual_dependency"], cols["completion_mask"]
    chosen = rl.top_p_token_mask(score, mask, top_p)
    # the mean visual dependency of the tokens the mask keeps and of those it leaves out
    metrics = {
        "low_var_kl_mean_selected": _token_mean(score, chosen * mask),
        "low_var_kl_mean_rejected": _token_mean(score, (1 - chosen) * mask),
    }
    return chosen, metrics


def _trajectory_scaling(cols, opts):
    # rows without an image have no visual dependency: alpha = 1, left out of the mean
    alpha = rl.trajectory_scaling(
        cols["visual_dependency"],
        cols["completion_mask"],
        opts["tprl.trajectory_scaling_min"],
        row_mask=cols["has_image"],
    )
    return alpha, {"scaling_factor_mean": jnp.mean(alpha)}


def _entropy_mask(cols, opts):
    return rl.entropy_token_mask(
        cols["entropy"],
        cols["completion_mask"],
        opts["tprl.top_p_entropy_tokens"],
        scope=opts["tprl.entropy_filter_scope"],
    ), {}


def _vgr_weights(cols, opts):
    mask, pools = cols["completion_mask"], cols["pools"]
    vgr = rl.per_token_vgr(
        cols["vision_mass"],
        cols["text_mass"],
        pools["vision"].sum(-1),
        pools["text"].sum(-1),
        layer_set=opts["vgr.layer_set"],
        last_k=opts["vgr.token_weight_last_k_layers"],
    )
    weights = rl.vgr_token_weights(
        vgr,
        mask,
        clip=opts["vgr.token_weight_clip"],
        smooth_sigma=opts["vgr.token_weight_smooth_sigma"],
        has_image=cols["has_image"],
    )
    return weights, {"token_weight_mean": _token_mean(weights, mask)}


AGG = ("actor.loss_agg_mode", "rollout.max_new_tokens")  # how a loss term aggregates tokens


def _agg(x, cols, opts):
    mode, horizon = (opts[k] for k in AGG)
    return rl.agg_loss(x, cols["completion_mask"], mode, horizon=horizon)


def _kl_loss(cols, opts):
    kl = _agg(rl.kl_penalty(cols["logp"], cols["ref_logp"], opts["actor.kl_loss_type"]), cols, opts)
    return opts["actor.kl_loss_coef"] * kl, {"kl_loss": kl}


def _entropy_bonus(cols, opts):
    mode, horizon = (opts[k] for k in AGG)
    h, mask, coef = cols["entropy"], cols["completion_mask"], opts["actor.entropy_coef"]
    bonus = rl.entropy_bonus(h, mask, mode, coef, horizon=horizon)
    return bonus, {"entropy_loss": _agg(h, cols, opts)}


def _entropy_penalty(cols, opts):
    mode, horizon = (opts[k] for k in AGG)
    logp, mask, coef = cols["logp"], cols["completion_mask"], opts["actor.entropy_penalty_coef"]
    penalty = rl.entropy_penalty(logp, mask, mode, coef, horizon=horizon)
    return penalty, {"entropy_penalty": _agg(-logp, cols, opts)}


# The table, in the order the step applies its entries. To add a token method: its fn above,
# one Term here, its keys in configs/base.py (the module's docstring).
TOKEN_METHODS = (
    # per-token visual dependency S_t from the perturbed image (TPRL / VPPO)
    Term("visual_dependency", "column", ("aug_logp", "old_logp"), _visual_dependency),
    # loss only on each row's most image-dependent tokens
    Term(
        "perception_mask",
        "mask",
        ("visual_dependency",),
        _perception_mask,
        ("tprl.enable_perception_filtering", "tprl.top_p_perception_tokens"),
        flag("tprl.enable_perception_filtering"),
    ),
    # TAS: rows whose completion depends more on the image get larger advantages
    Term(
        "trajectory_scaling",
        "advantage",
        ("visual_dependency",),
        _trajectory_scaling,
        ("tprl.enable_trajectory_reweighting", "tprl.trajectory_scaling_min"),
        flag("tprl.enable_trajectory_reweighting"),
    ),
    # loss only on the highest-entropy tokens
    Term(
        "entropy_mask",
        "mask",
        ("entropy",),
        _entropy_mask,
        (
            "tprl.enable_entropy_filtering",
            "tprl.top_p_entropy_tokens",
            "tprl.entropy_filter_scope",
        ),
        flag("tprl.enable_entropy_filtering"),
    ),
    # each token's loss weighed by its vision/text attention (VGR)
    Term(
        "vgr_weights",
        "weight",
        ("vision_mass", "text_mass", "pools"),
        _vgr_weights,
        (
            "vgr.enable_token_weights",
            "vgr.layer_set",
            "vgr.token_weight_last_k_layers",
            "vgr.token_weight_clip",
            "vgr.token_weight_smooth_sigma",
        ),
        flag("vgr.enable_token_weights"),
    ),
    # + kl_loss_coef agg(KL(policy || reference))
    Term(
        "kl_loss",
        "loss",
        ("logp", "ref_logp"),
        _kl_loss,
        ("actor.use_kl_loss", "actor.kl_loss_coef", "actor.kl_loss_type", *AGG),
        lambda o: bool(o["actor.use_kl_loss"] and o["actor.kl_loss_coef"] > 0),
    ),
    # - entropy_coef agg(H): the entropy bonus (the gradient flows through H)
    Term(
        "entropy_bonus",
        "loss",
        ("entropy",),
        _entropy_bonus,
        ("actor.entropy_coef", *AGG),
        flag("actor.entropy_coef"),
    ),
    # + entropy_penalty_coef agg(-logp) (VPPO)
    Term(
        "entropy_penalty",
        "loss",
        ("logp",),
        _entropy_penalty,
        ("actor.use_entropy_penalty", "actor.entropy_penalty_coef", *AGG),
        flag("actor.use_entropy_penalty"),
    ),
)
