"""Per-token quantities of a policy on a rollout batch: log-probs, entropies, attention masses.

Shapes: B rows, L = P + N tokens (left-padded prompt of P, completion of N), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec

from jaxvrl.models.qwen2_5_vl import VisionInputs
from jaxvrl.parallel.sharding import row_axes

# CLIP normalisation used by the Qwen2-VL image processor: black = (0 - mean) / std.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@struct.dataclass
class RolloutBatch:
    """What the train step consumes. Arrays live on device; shapes are static per bucket.

    input_ids:       int32[B, L] prompt (left-padded to P) followed by the completion (N).
    attention_mask:  int32[B, L].
    position_ids:    int32[3, B, L] M-RoPE ids (completion continues the prompt's deltas).
    completion_mask: float32[B, N] 1 on completion tokens up to and including EOS.
    rewards:         float32[B] total reward per row (rows grouped by prompt, G consecutive).
    images:          packed patches of every row's images, or None.
    pools:           {"vision","text","prompt"} bool[B, L] key pools for attention masses.
    has_image:       bool[B].
    baseline:        float32[B] greedy-completion reward (remax) or zeros.
    old_logprobs:    float32[B, N] the sampler's log-probs of the completion tokens under
                     logits / rollout temperature (0 on padding), or None.
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

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]


def split_rows(tree, m: int):
    """[B, ...] -> [m, B/m, ...] on every array of `tree` (each leading axis is the row)."""
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), tree)


def take_rows(tree, idx: jax.Array):
    """The rows idx int32[b] of every array of `tree` (each leading axis is the row)."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


def _rows_first(batch: RolloutBatch) -> RolloutBatch:
    """position_ids [3, B, L] -> [B, 3, L]: then every leaf's leading axis is the row."""
    return batch.replace(position_ids=jnp.moveaxis(batch.position_ids, 1, 0))


def micro_split(batch: RolloutBatch, m: int) -> RolloutBatch:
    """A batch of m micro-batches: leaves [m, B/m, ...] (position_ids [m, 3, B/m, L])."""
    rows = split_rows(_rows_first(batch), m)
    return rows.replace(position_ids=jnp.moveaxis(rows.position_ids, 2, 1))


def interleave_rows(first: RolloutBatch, second: RolloutBatch) -> RolloutBatch:
    """One batch of 2B rows: row 2i is row i of `first`, row 2i + 1 row i of `second` (same
    shapes). Where rows are split over devices, each device keeps the pairs of its own rows."""
    a, b = _rows_first(first), _rows_first(second)
    both = jax.tree.map(lambda x, y: jnp.stack([x, y], 1).reshape((-1,) + x.shape[1:]), a, b)
    return both.replace(position_ids=jnp.moveaxis(both.position_ids, 0, 1))


def unpair_rows(x: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """The rows of an interleaved batch's array back apart: (even rows, odd rows) of `axis`."""
    pairs = x.reshape(x.shape[:axis] + (-1, 2) + x.shape[axis + 1 :])
    return jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)


def batch_rows(batch: RolloutBatch, idx: jax.Array) -> RolloutBatch:
    """The rows idx int32[b] of a batch, as a batch of b rows."""
    rows = take_rows(_rows_first(batch), idx)
    return rows.replace(position_ids=jnp.moveaxis(rows.position_ids, 0, 1))


def completion_hidden(model, batch: RolloutBatch, *, images=None, pools=False):
    """Forward the whole sequence; returns (hidden [B, N, D] whose logits predict each
    completion token, out). Position t predicts token t+1, so the completion's are
    [P-1, L-1)."""
    out = model.forward(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        images=batch.images if images is None else images,
        videos=batch.videos,
        pools=batch.pools if pools else None,
        return_logits=False,
    )
    n = batch.completion_length
    return out.hidden[:, -n - 1 : -1], out


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

    Under a mesh whose row axes (data, fsdp) split the rows, the chunks run per device
    (`shard_map` over those axes): the head's weights are gathered once, before the loop,
    and their gradient summed over the row axes once, after it, where the compiler would
    otherwise gather the whole head and all-reduce its gradient in every chunk.
    """
    axes = row_axes(hidden.shape[0])
    if not axes:
        return _chunked_logprobs(model, model.head, hidden, tokens, temperature, entropy, chunk)
    graphdef, head = nnx.split(model.head)
    rows = PartitionSpec(axes)

    def local(head, hidden, tokens):
        head = nnx.merge(graphdef, head)
        return _chunked_logprobs(model, head, hidden, tokens, temperature, entropy, chunk)

    return jax.shard_map(
        local, in_specs=(PartitionSpec(), rows, rows), out_specs=rows, axis_names=set(axes)
    )(head, hidden, tokens)


def _chunked_logprobs(model, head, hidden, tokens, temperature, entropy, chunk):
    b, n, d = hidden.shape
    inv_t = 1.0 / max(temperature, 1e-6)
    k = chunk or head_chunk(b, n, model.config.text.vocab_size)
    c = -(-n // k)
    pad = c * k - n
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, c, k, d).swapaxes(0, 1)
    ts = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(b, c, k).swapaxes(0, 1)

    def one(h, t):
        z = model.logits(h, head) * inv_t  # float32[B, k, V]
        lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0] - lse
        if entropy == "none":
            return logp, None
        lp = z - lse[..., None]  # -sum p log p: a sum of non-negative terms, no cancellation
        lp = lp if entropy == "grad" else jax.lax.stop_gradient(lp)
        return logp, -jnp.sum(jnp.exp(lp) * lp, axis=-1)

    one = jax.checkpoint(one, prevent_cse=False)
    _, (logp, ent) = jax.lax.scan(lambda carry, x: (carry, one(*x)), None, (hs, ts))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, c * k)[:, :n]  # noqa: E731
    return unchunk(logp), None if ent is None else unchunk(ent)


def blacken_patches(images: VisionInputs, rng: jax.Array, prob: float) -> VisionInputs:
    """Perturbed image I': each patch set to black with probability `prob`, independently.

    pixel_values rows are flattened (C, T, P, P) patches; black is the normalised value of
    pixel 0 in each channel.
    """
    pv = images.pixel_values  # [N, D] packed or [B, N, D] per row
    channels = len(IMAGE_MEAN)
    black = jnp.asarray([-m / s for m, s in zip(IMAGE_MEAN, IMAGE_STD)], pv.dtype)
    black_row = jnp.repeat(black, pv.shape[-1] // channels)
    drop = jax.random.bernoulli(rng, prob, pv.shape[:-1])
    return images.replace(pixel_values=jnp.where(drop[..., None], black_row, pv))
