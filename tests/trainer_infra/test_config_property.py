"""Every setting, drawn: values of each key of configs/base.py (types, edges, out of range)
and of several keys at once either pass the start-up check and build every piece the first
step needs (mesh, row splits, the step's settings, optimizer and schedule, samplers, the
rollout phase with its rewards and filters) or are refused at start by a ConfigError naming
a key. Any other exception is a defect: it would come after the model has loaded."""

from __future__ import annotations

import math

import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import base
from jaxvrl.config import ConfigError, OneOf, flat_keys, get, set_values, validate
from jaxvrl.models import EMBEDDED, qwen2_5_vl
from jaxvrl.trainer.build import learning_rate, make_optimizer, step_config
from jaxvrl.trainer.setup import (
    check_rows,
    make_rollout_phase,
    make_samplers,
    sampling_config,
    training_mesh,
)

# Paths, hosts and switches that reach outside the process: their checks are the loaders'.
SKIP = {
    "workdir",
    "load_checkpoint_path",
    "model.path",
    "model.preset",
    "data.train_files",
    "data.val_files",
    "data.image_dir",
    "data.format",
    "data.system_prompt",
    "distributed.enable",
    "distributed.coordinator_address",
    "reward.funcs",  # module:function specs; their loading is tested with the rewards
}
INTS = [-2, -1, 0, 1, 2, 3, 8, 1_000_000]
FLOATS = [-1.0, 0.0, 1e-9, 0.2, 0.5, 1.0, 1.5, 100.0, math.inf, -math.inf, math.nan]


def candidates(key: str, cfg) -> list:
    """Values to try for `key`: its type's edges and out-of-range values, its choices and
    wrong ones, lists of several lengths; None where the key allows it."""
    parent, _, leaf = key.rpartition(".")
    node = get(cfg, parent) if parent else cfg
    field, value = node._fields[leaf], node[leaf]
    typ = node.get_type(leaf) if value is None else type(value)
    extra = [None] if getattr(field, "nullable", False) else []
    if node.get_type(leaf) is object:  # "auto" or a number (`AutoOr`)
        return ["auto", "bogus", "", 2.5, True, *INTS]
    if typ is bool:
        return [True, False]
    if typ is int:
        return INTS + extra
    if typ is float:
        return FLOATS + extra
    if typ is str:
        rules = getattr(field, "rules", ())
        choices = [c for r in rules if isinstance(r, OneOf) for c in r.choices]
        return [*choices, "bogus", ""] + extra
    if typ in (tuple, list):
        if value and isinstance(value[0], str):
            return [(), ("",), tuple(value), (*value, "bogus")]
        return [(), (0.5,), (3.0, 0.2), (0.2, 3.0), (1.0, 1.0, 1.0), (-1.0, math.nan)]
    return [value]


KEYS = [k for k in flat_keys(base.get_config()) if k not in SKIP]


@st.composite
def draws(draw):
    cfg = base.get_config()
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    return {k: draw(st.sampled_from(candidates(k, cfg))) for k in keys}


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoTokenizer

    class Embedded:  # hypothesis prints its arguments: a short name, not the graph
        def __repr__(self):
            return "embedded"

    model = qwen2_5_vl.load(EMBEDDED)
    out = Embedded()
    out.pieces = (nnx.graphdef(model), model.config, AutoTokenizer.from_pretrained(EMBEDDED))
    return out


def first_step_pieces(c, embedded):
    graph, mcfg, tokenizer = embedded
    mesh = training_mesh(c)
    check_rows(c, mesh)
    cfg = step_config(c)
    assert cfg.updates >= 1 and cfg.group_size >= 1
    _ = (cfg.old_pass, cfg.shaping_in_loss, cfg.sampler_old, cfg.needs_ref, cfg.trainable)
    make_optimizer(c.optim, c.total_steps, cfg.updates)
    lr = learning_rate(c.optim, c.total_steps, cfg.updates)
    if callable(lr):
        assert math.isfinite(float(lr(0))) and math.isfinite(float(lr(c.total_steps)))
    sampling_config(c, mcfg, tokenizer)
    sampler, greedy = make_samplers(graph, mcfg, tokenizer, c, mesh)
    make_rollout_phase(c, sampler, greedy, tokenizer, mcfg, cfg, mesh)


def check(values: dict, pieces) -> None:
    """The start-up check, then what the run builds before its first step: either passes, or
    raises a ConfigError naming a key."""
    c = base.get_config()
    try:
        set_values(c, values)
        validate(c)
        first_step_pieces(c, pieces)
    except ConfigError as e:
        assert "config." in str(e), e  # names the key


def test_every_value_of_every_key(embedded):
    """Each key alone, every candidate value (the draws below combine keys)."""
    cfg = base.get_config()
    for key in KEYS:
        for value in candidates(key, cfg):
            try:
                check({key: value}, embedded.pieces)
            except Exception as e:
                raise AssertionError(f"{key}={value!r}: {type(e).__name__}: {e}") from e


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(values=draws())
def test_each_draw_of_several_keys_runs_or_is_refused_at_start(embedded, values):
    check(values, embedded.pieces)
