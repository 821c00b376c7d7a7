"""The optimizer update with its state in host memory (`actor.offload_optimizer`), streamed.

Brought to the devices whole, the state of AdamW (two float32 moments per parameter) takes
twice the parameters' bytes of device memory while the update runs, and the compiler starts
such copies early (during the backward pass) to hide their latency: the step's peak then
holds the whole state, and offloading saves nothing. Streamed, the stacked parameters of
scanned layers (a leading "layers" axis) are updated one layer at a time inside a loop: each
iteration brings that layer's moments in, updates them and the layer's parameters, and puts
them back. A loop's copies stay inside it and the loop starts once the gradients are made,
so only one layer's state is ever on the devices. The other leaves (embeddings, heads,
unstacked weights) are updated whole.

The optimizer is `optax.chain(clip_by_global_norm(clip), <per-leaf transformation>)`, the form
`make_optimizer` builds for the policy and the critic: the clip is applied first with the
norm of all the gradients, then each part runs the whole chain on its leaves (whose own clip
then sees a norm within the limit and leaves them as they are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxvrl.parallel import sharding


def streamed_update(tx, grads, opt_state, params, ok, clip: float | None):
    """(new params, new optimizer state in host memory): `tx.update` applied a layer at a
    time to the stacked leaves and at once to the others; the new values where `ok`, else
    the old ones."""
    paths, p_def = jax.tree.flatten_with_path(params)
    p_leaves = [x for _, x in paths]
    if clip is not None:
        norm = optax.tree.norm(grads)
        scale = lambda g: jnp.where(norm < clip, g, g / norm.astype(g.dtype) * clip)  # noqa: E731
        grads = jax.tree.map(scale, grads)
    g_leaves = p_def.flatten_up_to(grads)
    is_slot = lambda n: jax.tree.structure(n) == p_def  # noqa: E731 -- a moment, shaped as params
    flat, s_def = jax.tree.flatten(opt_state, is_leaf=is_slot)
    slots = [k for k, n in enumerate(flat) if is_slot(n)]
    slot_leaves = [p_def.flatten_up_to(flat[k]) for k in slots]

    def part(p, g, s):
        """tx.update of some leaves (params p, gradients g, the slots' host leaves s) -> (new
        p, the new state's flat leaves in host memory)."""
        host = iter(s)
        state = s_def.unflatten([next(host) if k in slots else n for k, n in enumerate(flat)])
        state = jax.device_put(state, jax.memory.Space.Device)
        updates, new_state = tx.update(g, state, p)
        new_p = pick(ok, optax.apply_updates(p, updates), p)
        new_state = jax.device_put(pick(ok, new_state, state), jax.memory.Space.Host)
        return new_p, s_def.flatten_up_to(new_state)

    stacks: dict[int, list[int]] = {}  # layer count -> the leaves stacked over that many
    whole = []
    for j, (path, x) in enumerate(paths):
        axes = sharding.param_axes(sharding.leaf_name(path), x.ndim)
        if axes[:1] == ("layers",) and x.shape[0] > 1:
            stacks.setdefault(x.shape[0], []).append(j)
        else:
            whole.append(j)
    new_p = list(p_leaves)
    new_slots = [list(s) for s in slot_leaves]
    take = lambda leaves, group: [leaves[j] for j in group]  # noqa: E731
    # the leaves updated whole (maybe none): their new state also gives the shared leaves
    # (step counts), the same for every part
    p, new_flat = part(
        take(p_leaves, whole), take(g_leaves, whole), [take(s, whole) for s in slot_leaves]
    )
    for u, j in enumerate(whole):
        new_p[j] = p[u]
        for i, k in enumerate(slots):
            new_slots[i][j] = new_flat[k][u]

    for group in stacks.values():

        def layer(p, xs):
            i, g, s = xs
            p_i = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in p]
            p_i, n_flat = part(p_i, g, s)
            p = [jax.lax.dynamic_update_index_in_dim(x, y, i, 0) for x, y in zip(p, p_i)]
            return p, [n_flat[k] for k in slots]

        n = p_leaves[group[0]].shape[0]
        xs = (jnp.arange(n), take(g_leaves, group), [take(s, group) for s in slot_leaves])
        p, stacked = jax.lax.scan(layer, take(p_leaves, group), xs)
        for u, j in enumerate(group):
            new_p[j] = p[u]
            for i in range(len(slots)):
                new_slots[i][j] = stacked[i][u]
    slot_of = dict(zip(slots, new_slots))
    out = [p_def.unflatten(slot_of[k]) if k in slots else x for k, x in enumerate(new_flat)]
    return p_def.unflatten(new_p), s_def.unflatten(out)


def pick(ok, new, old):
    """The `new` tree where `ok` (a scalar), else the `old` one."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
