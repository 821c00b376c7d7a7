"""A sparse mixture-of-experts feed-forward block (Qwen3-MoE, Qwen2-MoE), as transformers
computes it.

A router Linear(D, E) (no bias) scores the E experts of each token; their softmax, in
float32, keeps the top k, renormalised to sum 1 where `norm_topk_prob`; each kept expert is a
gated MLP down(act(gate(x)) * up(x)) of width F, and the token's output is the weighted sum
of its k experts' outputs, plus, where `shared_expert_intermediate_size` > 0 (Qwen2-MoE), a
shared expert's: a dense gated MLP every token runs, scaled by sigmoid(Linear(D, 1)(x)).
Decoder layer i is sparse where `(i + 1) % decoder_sparse_step == 0` and i is not in
`mlp_only_layers` (`sparse_layers`); the others keep the dense MLP of `intermediate_size`.

The experts run behind one seam, `EXPERTS[name](x, weights, experts, kernels, act)`:
"ragged" (the default) sorts the N * k (token, expert) pairs by expert and runs each
projection as one grouped matmul over all experts (`jax.lax.ragged_dot`, group sizes the
experts' counts); "dense" (the reference) runs every expert on every token, weighted by the
sparse routing weights. Both take `Experts.kernels` (QLoRA's dequantized). Qwen3-VL-MoE's
checkpoints fuse gate and up (`experts.gate_up_proj`, gate's F columns first): `fused_gate_up`
keeps that kernel [E, D, 2F] (`Experts.gate_up_proj`), one grouped matmul, its output split.

The block also gives its router logits float32[N, E] (`load_balancing_loss`: transformers'
auxiliary loss) and its routes, which a training pass may replay (`SparseMoE.apply`; Rollout
Routing Replay, arXiv 2510.11370: experts recorded, weights from the live router).

Letters: N tokens (B * T), D model dim, E experts, F expert width, k experts per token.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxvrl.config import ConfigError
from jaxvrl.models.config import TextConfig
from jaxvrl.models.layers import GatedMLP, activation, linear
from jaxvrl.parallel.sharding import row_axes, sequence_split

# config.json keys of a mixture-of-experts decoder (a text family's with `moe`, Qwen3-VL-MoE's
# text_config); transformers writes num_experts as num_local_experts
MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
)
# config.json's width of a block's shared expert (Qwen2-MoE; 0: none), read where the
# family has one
SHARED_EXPERT_KEY = "shared_expert_intermediate_size"


def config_fields(d: dict, source: str, shared_expert: bool = False) -> dict:
    """TextConfig's mixture-of-experts fields from config.json `d` (defaults applied), with
    `shared_expert` also the shared expert's width (SHARED_EXPERT_KEY)."""
    d = d | ({"num_experts": d["num_local_experts"]} if "num_local_experts" in d else {})
    kw = {k: d[k] for k in MOE_KEYS}
    if shared_expert:
        kw[SHARED_EXPERT_KEY] = d[SHARED_EXPERT_KEY]
        if not isinstance(kw[SHARED_EXPERT_KEY], int) or kw[SHARED_EXPERT_KEY] < 0:
            raise ConfigError(
                f"{source}: {SHARED_EXPERT_KEY} must be a non-negative integer, got "
                f"{kw[SHARED_EXPERT_KEY]!r}"
            )
    kw["mlp_only_layers"] = tuple(int(i) for i in kw["mlp_only_layers"] or ())
    kw["norm_topk_prob"] = bool(kw["norm_topk_prob"])
    kw["router_aux_loss_coef"] = float(kw["router_aux_loss_coef"])
    if kw["num_experts"] and not 1 <= kw["num_experts_per_tok"] <= kw["num_experts"]:
        raise ConfigError(
            f"{source}: num_experts_per_tok {kw['num_experts_per_tok']} must be in "
            f"[1, num_experts = {kw['num_experts']}]"
        )
    if kw["decoder_sparse_step"] < 1:
        raise ConfigError(f"{source}: decoder_sparse_step must be positive")
    return kw


def sparse_layers(cfg: TextConfig) -> tuple[bool, ...]:
    """For each decoder layer, whether its feed-forward is the sparse MoE block (transformers'
    rule: experts exist, (i + 1) % decoder_sparse_step == 0, i not in mlp_only_layers)."""
    step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers)
    return tuple(
        cfg.num_experts > 0 and (i + 1) % step == 0 and i not in dense
        for i in range(cfg.num_hidden_layers)
    )


def scanned_layer_kind(cfg: TextConfig) -> bool:
    """Whether the one stacked layer of a scanned decoder (`model.scan_layers`) is sparse; a
    config that mixes dense and sparse layers is refused (their params differ)."""
    kinds = set(sparse_layers(cfg))
    if len(kinds) > 1:
        raise ConfigError(
            "model.scan_layers=true needs decoder layers alike: this config mixes dense and "
            "sparse (mixture-of-experts) layers (mlp_only_layers / decoder_sparse_step); set "
            "model.scan_layers=false"
        )
    return kinds == {True}


def route(logits: jax.Array, top_k: int, normalize: bool, selected: jax.Array | None = None):
    """Routing of N tokens over E experts from the router's logits [N, E]: (weights
    float32[N, k], experts int32[N, k]). The softmax over the experts is taken in float32; the
    top k are kept (or `selected` int[N, k], a recorded selection, whose weights are then the
    live router's) and, with `normalize`, divided by their sum."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if selected is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        experts = selected
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _gated(project, kernels, act):
    """act(gate) * up of `project`(kernel) for kernels (gate, up, down) or, fused, (gate_up,
    down): one projection by the fused kernel, its output split (the kernel is not)."""
    if len(kernels) == 2:
        h, width = project(kernels[0]), kernels[1].shape[-2]
        return act(h[..., :width]) * h[..., width:]
    return act(project(kernels[0])) * project(kernels[1])


def ragged_experts(x, weights, experts, kernels, act):
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x [N, D] -> [N, D], each
    projection one grouped matmul (`jax.lax.ragged_dot`) over the N * k (token, expert)
    pairs sorted by expert. kernels: (gate [E, D, F], up [E, D, F], down [E, F, D]) or
    (gate_up [E, D, 2F], down); weights [N, k] (x's dtype); experts int[N, k]."""
    down = kernels[-1]
    n, k = experts.shape
    flat = experts.reshape(-1)  # [N*k], pair p = n * k + j
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    sizes = jnp.bincount(flat, length=down.shape[0]).astype(jnp.int32)  # [E]
    xs = x[order // k]  # [N*k, D]
    h = _gated(lambda w: jax.lax.ragged_dot(xs, w, sizes), kernels, act)
    ys = jax.lax.ragged_dot(h, down, sizes)  # [N*k, D], sorted
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to pair order
    return jnp.einsum("NKD,NK->ND", y, weights.astype(y.dtype))


def dense_experts(x, weights, experts, kernels, act):
    """The reference of `ragged_experts`: every expert on every token [E, N, D], summed under
    the sparse routing weights (zero for the experts a token did not pick)."""
    down = kernels[-1]
    h = _gated(lambda w: jnp.einsum("ND,EDF->ENF", x, w), kernels, act)
    y = jnp.einsum("ENF,EFD->END", h, down)
    n = x.shape[0]
    dense = jnp.zeros((n, down.shape[0]), y.dtype)
    dense = dense.at[jnp.arange(n)[:, None], experts].add(weights.astype(y.dtype))  # [N, E]
    return jnp.einsum("END,NE->ND", y, dense)


# name -> experts(x [N, D], weights [N, k], experts int[N, k], kernels, act) -> [N, D]; an
# expert id past the kernels' E contributes nothing (the experts of other devices)
EXPERTS = {"ragged": ragged_experts, "dense": dense_experts}


def expert_parallel(
    run, rows: int, x, weights, experts, kernels, act, capacity: float = 0.0, valid=None
):
    """`run` (an EXPERTS entry) over the mesh being traced for: where its `expert` axis is
    larger than 1, each device holds E / expert of the experts (the kernels' leading axis
    split over it) and runs only those. Returns (y [N, D], dropped: the share of (token,
    expert) pairs left out, float32[], or None where none can be).

    Where the rows (`rows` of the N = rows x T tokens; their T over the sequence axis, where
    it splits them) split over the expert axis, each device
    sends each (token, expert) pair to the device of its expert (an all-to-all of a
    [expert, C, D] buffer), runs its experts on the pairs it received, and sends the outputs
    back, where each token sums its k under its routing weights. C, the pairs a device sends
    each device: all its n k pairs with `capacity` 0 (none is ever dropped), else
    ceil(capacity x n k / expert); a pair past C is dropped (its expert's output left out of
    its token's sum, as GShard and Switch drop). Otherwise every device routes all its
    tokens through its own experts and the partial sums are added over the axis. A tensor
    axis splits each expert's width, as a dense MLP's (its partial sums added too).
    Elsewhere `run` itself. kernels: as `ragged_experts` takes them. valid: None, or bool[N]
    the real tokens (padding neither takes a buffer's place nor counts as dropped; its
    output is 0 where pairs are sent)."""
    mesh = jax.sharding.get_abstract_mesh()
    ep = 1 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]
    e = kernels[-1].shape[0]
    if ep == 1:
        return run(x, weights, experts, kernels, act), None
    if e % ep:
        raise ValueError(f"mesh.expert={ep} does not divide the model's {e} experts")
    split = sequence_split(x.shape[0] // rows)  # a row's tokens over the sequence axis too
    axes = row_axes(rows) + ((split[0],) if split else ())
    tokens = P(axes or None, None)
    # a tensor axis splits each expert's width F (as a dense MLP's): partial sums, added
    tp = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
    width = "tensor" if tp > 1 and kernels[-1].shape[-2] % tp == 0 else None
    if width and len(kernels) == 2:  # a fused gate_up's columns do not split so: split it
        f = kernels[1].shape[-2]
        kernels = (kernels[0][..., :f], kernels[0][..., f:], kernels[1])
    specs = (P("expert", None, width),) * (len(kernels) - 1) + (P("expert", width, None),)
    per_device = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    if "expert" not in axes:
        fn = functools.partial(_summed, run, act, width)
        in_specs = (tokens,) * 3 + (specs,)
        return per_device(fn, in_specs=in_specs, out_specs=tokens)(
            x, weights, experts, kernels
        ), None
    n, k = x.shape[0] // math.prod(mesh.shape[a] for a in axes), experts.shape[1]
    cap = n * k if not capacity else min(n * k, math.ceil(capacity * n * k / ep))
    fn = functools.partial(_dispatched, run, act, cap, tuple(mesh.axis_names), width)
    valid = jnp.ones(x.shape[0], bool) if valid is None else valid.reshape(-1).astype(bool)
    in_specs = (tokens,) * 3 + (specs, P(axes or None))
    return per_device(fn, in_specs=in_specs, out_specs=(tokens, P()))(
        x, weights, experts, kernels, valid
    )


def _summed(run, act, width, x, weights, experts, kernels):
    """Per device: its tokens [n, D] through its own experts only (their columns of the
    `width` axis), summed over the axes."""
    local = kernels[-1].shape[0]
    ids = experts - jax.lax.axis_index("expert") * local
    mine = (ids >= 0) & (ids < local)
    y = run(x, jnp.where(mine, weights, 0), jnp.where(mine, ids, local), kernels, act)
    return jax.lax.psum(y, ("expert", width) if width else "expert")


def _dispatched(run, act, cap: int, names: tuple, width, x, weights, experts, kernels, valid):
    """Per device: its tokens [n, D] and their routes [n, k] to the experts' devices (cap
    pairs each, the real tokens' (`valid` [n]) in token order) and back (see
    `expert_parallel`), the partial sums of the experts' columns on the `width` axis added;
    -> (y [n, D], the share of the mesh's real pairs dropped)."""
    ep, local = jax.lax.axis_size("expert"), kernels[-1].shape[0]
    n, k = experts.shape
    flat = experts.reshape(-1)  # [n * k] pairs, pair p = token p // k
    dest = flat // local
    real = jnp.repeat(valid, k)  # [n * k]: padding's pairs take no place
    pos = jnp.cumsum(jax.nn.one_hot(dest, ep, dtype=jnp.int32) * real[:, None], axis=0) - 1
    pos = jnp.take_along_axis(pos, dest[:, None], axis=1)[:, 0]  # [n * k] within its device
    pos = jnp.where(real, pos, cap)
    kept = pos < cap  # the scatters below drop the others (out of bounds)
    tokens = x[jnp.arange(n * k) // k]
    send = jnp.zeros((ep, cap, x.shape[-1]), x.dtype).at[dest, pos].set(tokens, mode="drop")
    ids = jnp.full((ep, cap), local, jnp.int32).at[dest, pos].set(flat % local, mode="drop")
    got, ids = (jax.lax.all_to_all(a, "expert", 0, 0) for a in (send, ids))
    ones = jnp.ones((ep * cap, 1), weights.dtype)
    y = run(got.reshape(ep * cap, -1), ones, ids.reshape(-1, 1), kernels, act)
    back = jax.lax.all_to_all(y.reshape(ep, cap, -1), "expert", 0, 0)
    pairs = back[dest, jnp.minimum(pos, cap - 1)]  # each pair's expert output
    pairs = jnp.where(kept[:, None], pairs, 0).reshape(n, k, -1)
    # the share over every device's pairs (those of a tensor group counted alike)
    dropped = jax.lax.psum(jnp.sum(real & ~kept, dtype=jnp.float32), names)
    dropped = dropped / jnp.maximum(jax.lax.psum(jnp.sum(real, dtype=jnp.float32), names), 1)
    y = jnp.einsum("NKD,NK->ND", pairs, weights.astype(pairs.dtype))
    return (jax.lax.psum(y, width) if width else y), dropped


class ExpertKernel(nnx.Module):
    """One projection of every expert: kernel [E, in, out] (HF's per-expert
    `experts.{e}.<proj>.weight` [out, in] is index e, transposed; a fused checkpoint's
    `experts.<proj>` [E, out, in] is the kernel with its last two axes swapped)."""

    def __init__(self, experts: int, din: int, dout: int, *, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (experts, din, dout), param_dtype))

    def array(self, dtype) -> jax.Array:
        """The kernel in `dtype` (QLoRA's `lora.QuantExpertKernel` gives its own dequantized)."""
        return self.kernel[...].astype(dtype)


class Experts(nnx.Module):
    """Every expert's gated MLP: gate_proj, up_proj [E, D, F] (or, `fused`, gate_up_proj
    [E, D, 2F], gate's F columns first) and down_proj [E, F, D]."""

    def __init__(
        self, experts: int, dim: int, width: int, *, fused: bool = False, param_dtype, rngs
    ):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        if fused:
            self.gate_up_proj = ExpertKernel(experts, dim, 2 * width, **kw)
        else:
            self.gate_proj = ExpertKernel(experts, dim, width, **kw)
            self.up_proj = ExpertKernel(experts, dim, width, **kw)
        self.down_proj = ExpertKernel(experts, width, dim, **kw)
        self.fused = fused

    def kernels(self, dtype) -> tuple[jax.Array, ...]:
        """(gate [E, D, F], up [E, D, F], down [E, F, D]) or, fused, (gate_up [E, D, 2F],
        down) in `dtype`."""
        down = self.down_proj.array(dtype)
        if self.fused:
            return self.gate_up_proj.array(dtype), down
        return self.gate_proj.array(dtype), self.up_proj.array(dtype), down


class SparseMoE(nnx.Module):
    """The sparse MoE feed-forward of a decoder layer: router `gate` (Linear(D, E), no
    bias), `experts` (gate_proj, up_proj [E, D, F], down_proj [E, F, D]) and, where the
    config has one (`shared_expert_intermediate_size` S > 0), `shared_expert` (a GatedMLP of
    width S, no biases) with its gate `shared_expert_gate` (Linear(D, 1), no bias), else
    None. `implementation`: a name of EXPERTS (part of the graphdef)."""

    def __init__(self, cfg: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = linear(d, e, bias=False, **kw)
        self.experts = Experts(e, d, f, fused=cfg.fused_gate_up, param_dtype=param_dtype, rngs=rngs)
        s = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(d, s, cfg.hidden_act, bias=False, **kw) if s else None
        self.shared_expert_gate = linear(d, 1, bias=False, **kw) if s else None
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act_name = cfg.hidden_act
        self.dtype = dtype
        self.implementation = "ragged"
        # with an expert mesh axis: `expert_parallel`'s capacity (Model.set_expert_capacity)
        self.capacity = 0.0

    def kernels(self) -> tuple[jax.Array, ...]:
        """`Experts.kernels` in the compute dtype."""
        return self.experts.kernels(self.dtype)

    def apply(
        self, x: jax.Array, given: jax.Array | None = None, *, replay: bool = False, valid=None
    ):
        """x [B, T, D] -> (out [B, T, D], {"logits": router logits [B*T, E] in x's dtype,
        "experts": the router's own top-k int32[B*T, k], "mismatch": bool[B*T] whether that
        top-k (as a set) differs from `given`'s, with `given`}). given: None, or a recorded
        selection int[B*T, k] (a rollout's routes); `replay` routes by it (weights from the
        live router, see `route`), else by the router's own top k; with an expert mesh axis
        whose buffers drop pairs (`capacity`), aux also holds "dropped": the share of (token,
        expert) pairs left out, float32[]; valid: None or bool[B, T], the real tokens (the
        padding's pairs take no buffer place there)."""
        b, t, d = x.shape
        xf = x.reshape(b * t, d).astype(self.dtype)
        logits = self.gate(xf)  # [N, E]
        weights, experts = route(logits, self.top_k, self.normalize)
        aux = {"logits": logits, "experts": experts}
        if given is not None:
            given = given.astype(jnp.int32)
            aux["mismatch"] = jnp.any(jnp.sort(experts, -1) != jnp.sort(given, -1), axis=-1)
            if replay:
                weights, experts = route(logits, self.top_k, self.normalize, given)
        weights = weights.astype(logits.dtype)  # as transformers casts them back
        run = EXPERTS[self.implementation]
        kernels, act = self.kernels(), activation(self.act_name)
        out, dropped = expert_parallel(
            run, b, xf, weights, experts, kernels, act, self.capacity, valid
        )
        if dropped is not None:
            aux["dropped"] = dropped
        return self.shared(x, out.reshape(b, t, d)), aux

    def shared(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The experts' output `out` [B, T, D] plus the shared expert's on x [B, T, D],
        sigmoid(shared_expert_gate(x)) * shared_expert(x) (`out` itself without one). It runs
        on every token as the dense MLP does, outside the experts' dispatch: its kernels
        shard like the dense MLP's."""
        if self.shared_expert is None:
            return out
        x = x.astype(self.dtype)
        return out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.apply(x)[0]


def route_dtype(experts: int):
    """The compact integer dtype that holds expert ids below `experts` (recorded routes)."""
    return jnp.uint8 if experts <= 256 else jnp.int16 if experts <= 32768 else jnp.int32


def feed_forward(cfg: TextConfig, sparse: bool, *, dtype, param_dtype, rngs) -> nnx.Module:
    """A decoder layer's feed-forward: the sparse MoE block, or the dense gated MLP."""
    if sparse:
        return SparseMoE(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )  # fmt: skip


def load_balancing_loss(
    router_logits: jax.Array, top_k: int, mask: jax.Array | None = None
) -> jax.Array:
    """transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss):
    E * sum_e f_e * P_e, where over the L layers' tokens f_e is the mean number of top-k
    assignments to expert e per token (the f_e sum to k) and P_e the mean router
    probability of e.

    router_logits: [L, N, E] (each layer's, tokens N = B * T); mask: None or [N] (the
    attention mask flattened; padding counts for neither). Returns float32[]."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, E]
    e = probs.shape[-1]
    _, picked = jax.lax.top_k(probs, top_k)  # [L, N, k]
    counts = jnp.sum(jax.nn.one_hot(picked, e, dtype=jnp.float32), axis=-2)  # [L, N, E]
    w = jnp.broadcast_to(1.0 if mask is None else jnp.asarray(mask, jnp.float32), probs.shape[:-1])
    rows = jnp.sum(w)
    tokens_per_expert = jnp.einsum("LNE,LN->E", counts, w) / rows
    prob_per_expert = jnp.einsum("LNE,LN->E", probs, w) / rows
    return e * jnp.sum(tokens_per_expert * prob_per_expert)
