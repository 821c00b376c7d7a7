"""The replay buffer's checkpoint bytes: a round trip gives back every group equal in type,
dtype, shape and bits (arrays of several dtypes, numpy scalars, bytes, nested containers),
an empty buffer too; what cannot be stored exactly is refused."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jaxvrl import rl
from jaxvrl.trainer.replay_state import decode_items, encode_items, load_buffer, save_buffer
from jaxvrl.trainer.rollout import Group


def assert_same(a, b, where="item"):
    """Equal values of the same types; arrays also of the same dtype, shape and bytes."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a.flat, b.flat)):
                assert_same(x, y, f"{where}[{i}]")
        else:
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), where
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


def group(seed: int) -> Group:
    rng = np.random.default_rng(seed)
    g, n = 2, 5
    example = {
        "problem": f"what is shown? ({seed})",
        "prompt_ids": [151644, 8948, seed],
        "label_idx": seed % 4,
        "answer": None,
        "ok": True,
        "score": 0.1 + seed,  # a float that JSON must give back exactly
        "pixel_values": rng.standard_normal((4, 1176)).astype(np.float32),
        "image_grid_thw": np.array([[1, 2, 2]], np.int64),
        "second_per_grid_ts": np.zeros(0, np.float32),
        "image_bytes": b"\x89PNG\r\n\x1a\n\x00\xff",
        "options": ("A", "B"),
        7: "a key that is not a string",
    }
    logprobs = rng.standard_normal((g, n)).astype(np.float32)
    logprobs[0, -1] = np.float32("nan")
    return Group(
        example=example,
        tokens=rng.integers(0, 151_000, (g, n), dtype=np.int32),
        mask=np.ones((g, n), np.float32),
        truncated=np.array([False, True]),
        totals=rng.standard_normal(g),  # float64
        parts={"mc_idx": np.array([0.0, 1.0]), "format": np.array([1.0, -0.0])},
        texts=["<answer>A</answer>", "ünïcødé ✓"],
        att={"mdi": np.array([0.25, np.inf], np.float32)},
        baseline=np.zeros(g),
        logprobs=logprobs,
    )


def test_groups_round_trip_bit_exact():
    groups = [group(0), group(1)]
    groups[1].tokens = groups[1].tokens[:, ::2]  # a strided view is saved by value
    out = decode_items(encode_items(groups))
    assert len(out) == 2
    for i, (a, b) in enumerate(zip(groups, out)):
        assert_same(a, b, f"group {i}")
    assert out[0].example["score"] == 0.1  # the float itself, not a rounding of it
    out[0].tokens[0, 0] = -1  # restored arrays are the buffer's own, writable


def test_payloads_of_several_kinds_round_trip():
    items = [
        np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        np.array([1.5, -2.25], ml_dtypes.float8_e4m3fn),
        np.array([[1 + 2j]], np.complex64),
        np.arange(4, dtype=">u2"),
        np.array(["ab", "c"]),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.float16(0.5),
        ml_dtypes.bfloat16(3.0),
        np.int64(2**40),
        np.array([{"x": 1}, None], object),
        bytearray(b"\x00\x01"),
        b"",
        {"nested": [(), {}, [float("inf"), float("-inf"), 2**70, -0.0]]},
        "plain",
        None,
    ]
    for i, (a, b) in enumerate(zip(items, decode_items(encode_items(items)))):
        assert_same(a, b, f"item {i}")


def test_in_memory_images_round_trip_pixel_exact():
    """A row's images given as PIL objects (the built-in tasks' rows) come back with the same
    mode, size and pixels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    gray = Image.fromarray(rng.integers(0, 256, (3, 4), dtype=np.uint8))
    (back,) = decode_items(encode_items([{"image_refs": [rgb, gray]}]))
    for a, b in zip([rgb, gray], back["image_refs"]):
        assert (b.mode, b.size) == (a.mode, a.size)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_an_empty_buffer_round_trips():
    assert decode_items(encode_items([])) == []
    buf = rl.ReplayBuffer(capacity=3)
    load_buffer(buf, save_buffer(rl.ReplayBuffer()))
    assert len(buf) == 0


def test_a_buffer_restores_its_groups_in_order_and_keeps_its_capacity():
    saved = rl.ReplayBuffer(capacity=3)
    for s in range(4):
        saved.add(group(s))
    fresh = rl.ReplayBuffer(capacity=3)
    load_buffer(fresh, save_buffer(saved))
    assert [g.example["label_idx"] for g in fresh.contents()] == [1, 2, 3]  # oldest first
    for a, b in zip(saved.contents(), fresh.contents()):
        assert_same(a, b)
    smaller = rl.ReplayBuffer(capacity=2)  # a resume with a smaller capacity keeps the newest
    load_buffer(smaller, save_buffer(saved))
    assert [g.example["label_idx"] for g in smaller.contents()] == [2, 3]


def test_what_cannot_be_stored_exactly_is_refused():
    with pytest.raises(TypeError, match="cannot hold a set"):
        encode_items([{"tags": {"a"}}])


def test_resume_restores_the_buffer_and_warns_when_the_checkpoint_has_none(tmp_path, caplog):
    """train.resume: the saved groups come back; a checkpoint without a buffer (written
    before it was saved) starts an empty one, with a warning."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    from jaxvrl.checkpoint import Checkpointer
    from jaxvrl.data.rows import SkipStats
    from jaxvrl.train import resume
    from jaxvrl.trainer.counters import RunCounters

    c = SimpleNamespace(seed=0, resume=True)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    data = SimpleNamespace(set_state=lambda s: None)
    state, saved = {"w": jnp.zeros(2)}, rl.ReplayBuffer(capacity=4)
    saved.fill([group(0), group(1)], [True, True])
    ck = Checkpointer(str(tmp_path))
    items = {"state": state, "rng": jax.random.key(0), "data_state": {"pos": 1}}
    ck.save(1, {**items, "replay": save_buffer(saved)})
    buf = rl.ReplayBuffer(capacity=4)
    start, *_ = resume(c, ck, state, data, mesh, RunCounters(SkipStats(), {}), buf)
    assert start == 1 and len(buf) == 2
    for a, b in zip(saved.contents(), buf.contents()):
        assert_same(a, b)

    ck.save(2, {**items, "data_state": {"pos": 2}})  # no buffer saved
    buf = rl.ReplayBuffer(capacity=4)
    with caplog.at_level("WARNING", logger="jaxvrl"):
        start, *_ = resume(c, ck, state, data, mesh, RunCounters(SkipStats(), {}), buf)
    assert start == 2 and len(buf) == 0
    assert "step 2 holds no replay buffer" in caplog.text
    ck.close()


def test_reward_failures_and_timeouts_continue_after_a_resume():
    """The run's totals of a reward's failed and timed-out calls are in the checkpoint's
    counters: a resumed run's rewards count on from them (a reward it no longer has is
    dropped)."""
    import json

    from jaxvrl.data.rows import SkipStats
    from jaxvrl.rl.rewards import SafeReward
    from jaxvrl.trainer.counters import RunCounters

    def fn(completions, **_):
        return [0.0] * len(completions)

    before = SafeReward("r", fn)
    before.record("RuntimeError: x")
    before.record("TimeoutError: y", timed_out=True)
    saved = json.loads(json.dumps(RunCounters(SkipStats(), {"r": before}).state()))
    after = SafeReward("r", fn)
    RunCounters(SkipStats(), {"r": after}).load(dict(saved, reward_timeouts={"r": 1, "gone": 5}))
    assert (after.failures, after.timeouts) == (2, 1)
    assert saved["reward_timeouts"] == {"r": 1}
