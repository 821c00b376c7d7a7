"""Per-token quantities of a policy on a rollout batch: log-probs, entropies, attention masses.

Shapes: B rows, L = P + N tokens (left-padded prompt of P, completion of N), V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec

from jaxvrl.models import (
    Packing,
    ProcessorSettings,
    VisionInputs,
    gather_rows,
    gather_slots,
    positions,
)
from jaxvrl.parallel.sharding import row_axes


@struct.dataclass
class RolloutBatch:
    """What the train step consumes. Arrays live on device; shapes are static per bucket.

    input_ids:       int32[B, L] prompt (left-padded to P) followed by the completion (N).
    attention_mask:  int32[B, L].
    position_ids:    the family's positions int32[..., B, L] (RoPE: [B, L]; M-RoPE: its
                     three axes in front; the completion continues the prompt's deltas).
    completion_mask: float32[B, N] 1 on completion tokens up to and including EOS.
    rewards:         float32[B] total reward per row (rows grouped by prompt, G consecutive).
    images:          packed patches of every row's images, or None.
    pools:           {"vision","text","prompt"} bool[B, L] key pools for attention masses.
    has_image:       bool[B].
    baseline:        float32[B] greedy-completion reward (remax) or zeros.
    old_logprobs:    float32[B, N] the sampler's log-probs of the completion tokens under
                     logits / rollout temperature (0 on padding), or None.
    old_entropy:     float32[B, N] the sampler's entropies of the distributions it drew
                     the completion tokens from (0 on padding), or None.
    old_vision_mass, old_text_mass: float32[B, L, N] the sampler's attention masses of the
                     completion tokens' predictors (A_V, A_X per decoder layer), or None.
    routes:          int[B, L, L', k] the experts the sampler routed each token to in the
                     model's L' sparse layers (top k; 0 on padding), or None.
    pack_order:      int32[B] with padding-free passes (`trainer/packing.py`): the rows in
                     the order the experience passes' micro-batches take them (balanced).
    pack_start:      int32[B]: the first slot of each of those rows in its micro-batch's
                     packed buffers; None: padded passes.
    update_rows, update_starts: int32[updates, B / mini-batches]: the rows each update
                     reads (in place of `update_order`'s, balanced) and their first slots;
                     the step takes them off the batch before splitting rows.
    pack_groups, pack_buffers, pack_length, pack_completions: static: a micro-batch's rows
                     fall into pack_groups groups (one per device holding rows), each packed
                     into pack_buffers buffers of pack_length slots, its real completion
                     tokens (completion_mask) into pack_completions slots for the head.
    micro_batches:   static: the step's micro-batch count (actor.dynamic_batching's choice);
                     0: optim.micro_batches.
    update_pack:     static: (pack_buffers, pack_length, pack_completions) of the updates'
                     micro-batches (fewer rows than the experience passes'), or ().
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    position_ids: jax.Array
    completion_mask: jax.Array
    rewards: jax.Array
    has_image: jax.Array
    baseline: jax.Array
    images: VisionInputs | None = None
    videos: VisionInputs | None = None
    pools: dict | None = None
    old_logprobs: jax.Array | None = None
    old_entropy: jax.Array | None = None
    old_vision_mass: jax.Array | None = None
    old_text_mass: jax.Array | None = None
    routes: jax.Array | None = None
    pack_order: jax.Array | None = None
    pack_start: jax.Array | None = None
    update_rows: jax.Array | None = None
    update_starts: jax.Array | None = None
    pack_groups: int = struct.field(pytree_node=False, default=1)
    pack_buffers: int = struct.field(pytree_node=False, default=0)
    pack_length: int = struct.field(pytree_node=False, default=0)
    pack_completions: int = struct.field(pytree_node=False, default=0)
    micro_batches: int = struct.field(pytree_node=False, default=0)
    update_pack: tuple = struct.field(pytree_node=False, default=())

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def packing(self) -> Packing | None:
        """The `Packing` of these rows (a micro-batch's), or None for padded passes."""
        if self.pack_start is None:
            return None
        return Packing.build(
            self.attention_mask,
            self.pack_start,
            groups=self.pack_groups,
            buffers=self.pack_buffers,
            length=self.pack_length,
        )


def split_rows(tree, m: int):
    """[B, ...] -> [m, B/m, ...] on every array of `tree` (each leading axis is the row)."""
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), tree)


def take_rows(tree, idx: jax.Array):
    """The rows idx int32[b] of every array of `tree` (each leading axis is the row)."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


def _rows_first(batch: RolloutBatch) -> RolloutBatch:
    """The positions' rows moved to axis 0: then every leaf's leading axis is the row."""
    return batch.replace(position_ids=positions.rows_first(batch.position_ids))


def _rows_back(batch: RolloutBatch, lead: int = 0) -> RolloutBatch:
    """`_rows_first` undone, after `lead` leading axes (micro-batches)."""
    return batch.replace(position_ids=positions.rows_back(batch.position_ids, lead))


def micro_split(batch: RolloutBatch, m: int) -> RolloutBatch:
    """A batch of m micro-batches: leaves [m, B/m, ...] (the positions [m, ..., B/m, L])."""
    return _rows_back(split_rows(_rows_first(batch), m), 1)


def interleave_rows(first: RolloutBatch, second: RolloutBatch) -> RolloutBatch:
    """One batch of 2B rows: row 2i is row i of `first`, row 2i + 1 row i of `second` (same
    shapes). Where rows are split over devices, each device keeps the pairs of its own rows."""
    a, b = _rows_first(first), _rows_first(second)
    both = jax.tree.map(lambda x, y: jnp.stack([x, y], 1).reshape((-1,) + x.shape[1:]), a, b)
    return _rows_back(both)


def unpair_rows(x: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """The rows of an interleaved batch's array back apart: (even rows, odd rows) of `axis`."""
    pairs = x.reshape(x.shape[:axis] + (-1, 2) + x.shape[axis + 1 :])
    return jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)


def batch_rows(batch: RolloutBatch, idx: jax.Array) -> RolloutBatch:
    """The rows idx int32[b] of a batch, as a batch of b rows."""
    return _rows_back(take_rows(_rows_first(batch), idx))


@struct.dataclass
class Completions:
    """The final hidden states that predict a batch's completion tokens, and those tokens:
    hidden [R, C, D] and tokens int32[R, C] with R = B rows of C = N tokens, or, for packed
    rows, R device groups of C slots holding each group's real completion tokens (those of
    completion_mask), in order. `per_row` brings per-token values back to [B, N]."""

    hidden: jax.Array
    tokens: jax.Array
    index: jax.Array | None = None  # int32[R, J = rows per group x N]: each token's slot (C: none)
    source: jax.Array | None = None  # int32[R, C]: each slot's token (J: none)
    rows: int = struct.field(pytree_node=False, default=0)

    def per_row(self, x: jax.Array) -> jax.Array:
        """[R, C] per-token values -> [B, N] (0 where a packed row has no such token)."""
        if self.index is None:
            return x
        return gather_rows(x, self.index, self.source).reshape(self.rows, -1)

    def logprobs(self, model, temperature: float, **kw):
        """`completion_logprobs` of these tokens, per row [B, N] (entropy None unless asked)."""
        logp, ent = completion_logprobs(model, self.hidden, self.tokens, temperature, **kw)
        return self.per_row(logp), None if ent is None else self.per_row(ent)


def completion_hidden(
    model,
    batch: RolloutBatch,
    *,
    pools=False,
    router=False,
    routing="fresh",
    load=False,
):
    """Forward the whole sequence; returns (`Completions`: the hidden states whose logits
    predict each completion token, out with the attention masses of those positions
    [L, B, N]). Position t predicts token t+1, so the completion's are [P-1, L-1). With the
    batch's packing the forward runs on the packed real tokens, and the head reads the real
    completion tokens only (`pack_completions` slots per device group). router: out also
    carries the sparse layers' router logits [L', N, E] over the forward's tokens (the
    rows' [B * L], or the packed slots), which `router_tokens` marks real.

    routing (a batch with the sampler's `routes`; else ignored): "fresh" (the routers choose),
    "compare" (they choose, and out.route_mismatch float32[B, L] counts, per token, the
    sparse layers whose choice differs from the sampler's), "replay" (the sparse layers route
    by the sampler's choices, Rollout Routing Replay; route_mismatch counts where the routers
    would have chosen otherwise). load: out.expert_dropped carries each sparse layer's share
    of pairs an expert-parallel dispatch dropped (None where none can be)."""
    if routing not in ("fresh", "compare", "replay"):
        raise ValueError(f"routing must be fresh, compare or replay: {routing!r}")
    given = None if routing == "fresh" else batch.routes
    packing = batch.packing()
    out = model.forward(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        images=batch.images,
        videos=batch.videos,
        pools=batch.pools if pools else None,
        return_logits=False,
        packing=packing,
        router_logits=router,
        routes=given,
        replay_routes=given is not None and routing == "replay",
        record_routes=load,
    )
    n, t = batch.completion_length, batch.input_ids.shape[1]
    if out.route_mismatch is not None:  # [L', N] -> per token, the layers that differ
        count = jnp.sum(out.route_mismatch, axis=0, dtype=jnp.float32)
        count = count.reshape(out.hidden.shape[:2])
        out = out.replace(route_mismatch=count if packing is None else packing.take(count, 0, t))
    tokens = batch.input_ids[:, -n:]
    if packing is None:
        masses = {k: getattr(out, k)[:, :, -n - 1 : -1] for k in ("vision_mass", "text_mass")
                  if getattr(out, k) is not None}  # fmt: skip
        return Completions(out.hidden[:, -n - 1 : -1], tokens), out.replace(**masses)
    cols = (t - n - 1, t - 1)  # the completion's predictors
    masses = {k: packing.take(getattr(out, k), *cols, axis=1) for k in ("vision_mass", "text_mass")
              if getattr(out, k) is not None}  # fmt: skip
    # each device group's real completion tokens, in order, in pack_completions slots: every
    # map below is injective with its inverse at hand, so their gradients are gathers too
    b, g, size = tokens.shape[0], batch.pack_groups, batch.pack_completions
    real = (batch.completion_mask > 0).reshape(g, -1)  # [groups, J = rows per group x N]
    j = real.shape[1]
    index = jnp.where(real, jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, size)  # token -> slot
    local = jnp.arange(j, dtype=jnp.int32)
    source = jax.vmap(lambda i: jnp.full(size, j, jnp.int32).at[i].set(local, mode="drop"))(index)
    buffered = packing.buffers * packing.length  # a group's packed slots
    at = gather_rows(packing.slots(*cols).reshape(g, -1), source, index)
    at = jnp.where(source < j, at, buffered)  # each head slot's packed slot (none: buffered)
    # the inverse: each packed slot's head slot (none: size), through the token it holds
    per_token = jnp.full((b, t), size, jnp.int32).at[:, cols[0] : cols[1]].set(index.reshape(b, n))
    per_token = jnp.pad(per_token.reshape(g, -1), ((0, 0), (0, 1)), constant_values=size)
    reader = jnp.take_along_axis(per_token, packing.src, axis=1)
    hidden = gather_slots(out.hidden, at, reader)  # [groups, size, D]
    tokens = gather_rows(tokens.reshape(g, -1), source, index)
    return Completions(hidden, tokens, index, source, b), out.replace(**masses)


def router_mismatch(counts: jax.Array, batch: RolloutBatch) -> jax.Array:
    """The share of (real token, sparse layer) routes a pass's routers would choose otherwise
    than the sampler did: counts float32[B, L] per token (`Passes.route_mismatch`), over
    the batch's real tokens (prompt and completion) and its L' sparse layers."""
    real = (batch.attention_mask > 0).astype(jnp.float32)
    layers = batch.routes.shape[2]
    return jnp.sum(counts * real) / (layers * jnp.maximum(jnp.sum(real), 1.0))


def router_tokens(batch: RolloutBatch) -> jax.Array:
    """bool[N]: the real tokens among those `completion_hidden`'s forward ran on (its router
    logits' N): the rows' attention mask, or the packed slots that hold a token."""
    packing = batch.packing()
    valid = batch.attention_mask if packing is None else packing.segments
    return valid.reshape(-1) > 0


def paired_packing(both: RolloutBatch) -> RolloutBatch:
    """The packing of `interleave_rows(batch, perturbed)`: row 2i (clean) keeps row i's
    slots, row 2i + 1 (perturbed) takes the same slots in a second set of buffers."""
    if both.pack_start is None:
        return both
    second = (jnp.arange(both.pack_start.shape[0]) % 2) * (both.pack_buffers * both.pack_length)
    return both.replace(
        pack_start=both.pack_start + second,
        pack_buffers=2 * both.pack_buffers,
        pack_completions=2 * both.pack_completions,
    )


# float32 logits one chunk of the head may hold: [B, chunk, V] stays near this size.
_CHUNK_BYTES = 96 << 20


def head_chunk(rows: int, tokens: int, vocab: int) -> int:
    """Tokens per chunk of `completion_logprobs`: [rows, chunk, vocab] float32 ~ 96 MiB."""
    return int(min(tokens, max(1, _CHUNK_BYTES // (4 * rows * vocab))))


def completion_logprobs(
    model,
    hidden: jax.Array,
    tokens: jax.Array,
    temperature: float,
    *,
    entropy: str = "none",
    chunk: int = 0,
):
    """(log pi(token) float32[B, N], entropy float32[B, N] or None) from final hidden states
    [B, N, D], equal to log_softmax(model.logits(hidden) / temperature) at the tokens and its
    entropy (`rl.token_entropy`).

    The vocabulary projection runs over chunks of `chunk` tokens (0: `head_chunk` of the rows
    one device holds) in a `lax.scan`, each under `jax.checkpoint`, so no [B, N, V] array
    exists in the forward or the backward pass; one log-sum-exp serves both outputs. entropy:
    "none" | "value" (no gradient flows through it) | "grad".

    Under a mesh whose row axes (data, fsdp) split the rows, the head runs per device
    (`shard_map` over those axes). Where fsdp splits the rows and the vocabulary, it is
    vocabulary-parallel: each device keeps its 1/fsdp slice of the head's vocabulary, and
    computes that slice's logits for every row of its fsdp group (hidden states all-gathered
    chunk by chunk, [fsdp * B, chunk, D]); the log-sum-exp, the chosen token's logit and the
    entropy's terms are combined over the slices with collectives on [rows, chunk] arrays. No device ever
    holds the whole head or its whole gradient (at 7B: 1.0 GiB of bf16 weights and a 2.0
    GiB float32 gradient per device otherwise), and the hidden states moved instead of the
    weights are fewer bytes at RL lengths. Otherwise (data alone splits the rows, or fsdp
    does not divide the vocabulary) each device runs its rows against the whole head,
    gathered once before the loop and its gradient summed once after it, where the
    compiler would otherwise gather and reduce it in every chunk.
    """
    axes = row_axes(hidden.shape[0])
    if not axes:
        return _chunked_logprobs(model, model.head, hidden, tokens, temperature, entropy, chunk)
    graphdef, head = nnx.split(model.head)
    rows = PartitionSpec(axes)
    vocab = model.config.text.vocab_size
    if "fsdp" in axes and vocab % jax.sharding.get_abstract_mesh().shape["fsdp"] == 0:
        # the vocabulary dimension of every head array (kernel [D, V], embedding [V, D],
        # quantized values and scales) split over fsdp
        head_spec = jax.tree.map(
            lambda x: PartitionSpec(*("fsdp" if n == vocab else None for n in x.shape)), head
        )
        run = functools.partial(_vocab_parallel_logprobs, axis="fsdp")
    else:
        head_spec, run = PartitionSpec(), _chunked_logprobs

    def local(head, hidden, tokens):
        head = nnx.merge(graphdef, head)
        return run(model, head, hidden, tokens, temperature, entropy, chunk)

    return jax.shard_map(
        local, in_specs=(head_spec, rows, rows), out_specs=rows, axis_names=set(axes)
    )(head, hidden, tokens)


def _vocab_parallel_logprobs(model, head, hidden, tokens, temperature, entropy, chunk, axis):
    """Per device, inside `shard_map`: `head` holds this device's slice of the vocabulary
    (the `axis` index-th of its equal parts); hidden [B, N, D] and tokens [B, N] its rows.
    Returns this device's rows' log-probs and entropies."""
    b, n, _ = hidden.shape
    parts = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    width = model.config.text.vocab_size // parts
    # the group's tokens gathered once; its hidden states chunk by chunk inside the loop
    # ([parts * B, chunk, D] at a time: at 16k tokens the whole [parts * B, N, D] is GiBs)
    tokens = jax.lax.all_gather(tokens, axis, tiled=True) - me * width
    mine = (tokens >= 0) & (tokens < width)  # the chosen token lies in this slice
    tokens = jnp.clip(tokens, 0, width - 1)

    def logp_and_entropy(z, t, on):
        # two rounds of collectives per chunk: the rows' max over the whole vocabulary, then
        # one sum of three terms. With the max m and S = sum exp(z - m):
        # lse = m + log S, and the entropy -sum p (z - lse) = sum exp(z - m) (m - z) / S +
        # log S, a sum of non-negative terms as on one device (no cancellation).
        top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(z, axis=-1)), axis)
        gap = top[..., None] - z  # >= 0
        e = jnp.exp(-gap)
        chosen = jnp.where(on, jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0], 0.0)
        spread = None if entropy == "none" else jnp.sum(e * gap, axis=-1)
        total, chosen, spread = jax.lax.psum((jnp.sum(e, axis=-1), chosen, spread), axis)
        logp = chosen - top - jnp.log(total)
        if entropy == "none":
            return logp, None
        ent = spread / total + jnp.log(total)
        return logp, ent if entropy == "grad" else jax.lax.stop_gradient(ent)

    logp, ent = _over_chunks(
        model,
        head,
        hidden,
        (tokens, mine),
        temperature,
        chunk,
        width,
        logp_and_entropy,
        gather=lambda h: jax.lax.all_gather(h, axis, tiled=True),
    )
    own = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, me * b, b)  # noqa: E731
    return own(logp), own(ent)


def _chunked_logprobs(model, head, hidden, tokens, temperature, entropy, chunk):
    def logp_and_entropy(z, t):
        lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0] - lse
        if entropy == "none":
            return logp, None
        lp = z - lse[..., None]  # -sum p log p: a sum of non-negative terms, no cancellation
        lp = lp if entropy == "grad" else jax.lax.stop_gradient(lp)
        return logp, -jnp.sum(jnp.exp(lp) * lp, axis=-1)

    vocab = model.config.text.vocab_size
    return _over_chunks(model, head, hidden, (tokens,), temperature, chunk, vocab, logp_and_entropy)


def _over_chunks(model, head, hidden, per_token, temperature, chunk, vocab, fn, gather=None):
    """fn(logits float32[R, k, vocab] / temperature, *per_token chunks [R, k]) -> (logp, ent
    or None) [R, k], over chunks of k tokens in a `lax.scan`, each under `jax.checkpoint`
    where there are several (one chunk's logits, at most `_CHUNK_BYTES`, are kept instead of
    projected again in the backward pass).
    hidden [B, N, D]; per_token arrays [R, N]: R = B, or with `gather` (a chunk of hidden
    [B, k, D] -> [R, k, D]) the rows it gathers."""
    b, n, d = hidden.shape
    rows = per_token[0].shape[0]
    inv_t = 1.0 / max(temperature, 1e-6)
    k = chunk or head_chunk(rows, n, vocab)
    c = -(-n // k)
    pad = c * k - n
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, c, k, d).swapaxes(0, 1)
    split = lambda x: jnp.pad(x, ((0, 0), (0, pad))).reshape(rows, c, k).swapaxes(0, 1)  # noqa: E731

    def one(h, *xs):
        h = h if gather is None else gather(h)
        return fn(model.logits(h, head) * inv_t, *xs)

    if c > 1:  # else the one chunk's logits are all the backward pass keeps: no re-projection
        one = jax.checkpoint(one, prevent_cse=False)
    xs = (hs,) + tuple(split(x) for x in per_token)
    _, (logp, ent) = jax.lax.scan(lambda carry, x: (carry, one(*x)), None, xs)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(rows, c * k)[:, :n]  # noqa: E731
    return unchunk(logp), None if ent is None else unchunk(ent)


def blacken_patches(images: VisionInputs, rng: jax.Array, prob: float, black=None) -> VisionInputs:
    """Perturbed image I': each patch set to black with probability `prob`, independently.

    pixel_values rows are flattened (C, T, P, P) patches; black: the normalised value of pixel
    0 in each channel (the processor's `ProcessorSettings.black`; default CLIP's).
    """
    pv = images.pixel_values  # [N, D] packed or [B, N, D] per row
    black = ProcessorSettings().black if black is None else black
    channels = len(black)
    black_row = jnp.repeat(jnp.asarray(black, pv.dtype), pv.shape[-1] // channels)
    drop = jax.random.bernoulli(rng, prob, pv.shape[:-1])
    return images.replace(pixel_values=jnp.where(drop[..., None], black_row, pv))


def perturbed_vision(batch: RolloutBatch, rng: jax.Array, prob: float, black=None) -> tuple:
    """(images, videos) of the perturbed input I': `blacken_patches` on the batch's image
    patches (drawn from `rng`) and on its video patches (from fold_in(rng, 1)); None where
    the batch has none."""
    images, videos = batch.images, batch.videos
    return (
        None if images is None else blacken_patches(images, rng, prob, black),
        None
        if videos is None
        else blacken_patches(videos, jax.random.fold_in(rng, 1), prob, black),
    )
