"""The rollout's sampler call: each prompt goes to the sampler once and is sampled G times;
completions, old log-probs and attention masses equal those of the G-times repeated rows the
train batch holds (the embedded tiny model, the built-in task)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxvrl import rl
from jaxvrl.data import synthetic
from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.sampling import Sampler
from jaxvrl.sampling.sampler import generation_config
from jaxvrl.train import EMBEDDED
from jaxvrl.trainer.rollout import repeat_prompts, sample_completions

G = 3


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED)
    model = q.load(EMBEDDED)
    rows = synthetic.make_split("train", 2, seed=0)
    opts = EncodeOptions(system_prompt=synthetic.SYSTEM_PROMPT)
    examples, _ = encode_rows(rows, tokenizer, opts)
    return tokenizer, model, examples


def test_repeated_prompts_are_the_train_batchs_rows(setup):
    tokenizer, model, examples = setup
    prompts = collate(examples, 1, model.config, tokenizer)
    full = collate(examples, G, model.config, tokenizer)
    rep = repeat_prompts(prompts, G)
    assert rep["rows"] == full["rows"]
    flat = lambda b: jax.tree.map(np.asarray, {k: v for k, v in b.items() if k != "rows"})  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, flat(rep), flat(full))


def test_one_prefill_per_prompt_gives_the_repeated_rows_completions(setup):
    tokenizer, model, examples = setup
    prompts = collate(examples, 1, model.config, tokenizer)
    full = collate(examples, G, model.config, tokenizer)
    assert prompts["images"] is not None
    cfg = generation_config(
        model.config, max_new_tokens=6, temperature=1.0, eos_token_ids=tokenizer.eos_token_id
    )
    sampler = Sampler(nnx.graphdef(model), cfg)
    params, key = nnx.state(model), jax.random.key(11)
    once = sample_completions(sampler, params, prompts, key, prompts["pools"], num_samples=G)
    ids = [full[k] for k in ("input_ids", "attention_mask", "position_ids", "deltas")]
    rows = sampler(
        params, *ids, key, images=full["images"], pools=full["pools"], num_samples=G,
        prefill_once=False,
    )  # fmt: skip
    rows = jax.tree.map(np.asarray, rows)
    np.testing.assert_array_equal(once.tokens, rows.tokens)
    np.testing.assert_array_equal(once.mask, rows.mask)
    np.testing.assert_allclose(once.logprobs, rows.logprobs, atol=1e-5)
    np.testing.assert_allclose(once.vision_mass, rows.vision_mass, atol=1e-5)
    np.testing.assert_allclose(once.text_mass, rows.text_mass, atol=1e-5)
    # the MDI reward's inputs: the rollout's attention metrics per row
    pools = full["pools"]
    metrics = [
        rl.attention_metrics(
            out.vision_mass,
            out.text_mass,
            pools["vision"].sum(1),
            pools["text"].sum(1),
            out.mask,
            layer_set="all",
            last_k=2,
        )  # fmt: skip
        for out in (once, rows)
    ]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), *metrics)


def test_the_samplers_masses_are_the_clean_passes(setup):
    """The attention masses the rollout hands the train step (VGR token weights shaped from
    the sampler, no clean pass) equal the clean pass's at every completion token: a token's
    masses are those of the query that predicts it. (The slots engine's masses are the static
    sampler's: tests/sampling/test_engine.py.)"""
    import jax.numpy as jnp

    from jaxvrl.trainer.experience import no_grad_passes
    from jaxvrl.trainer.rollout import assemble_prompts
    from tests.helpers import step_config

    tokenizer, model, examples = setup
    prompts = collate(examples, 1, model.config, tokenizer)
    cfg = generation_config(
        model.config, max_new_tokens=8, temperature=1.0, eos_token_ids=tokenizer.eos_token_id
    )
    sampler = Sampler(nnx.graphdef(model), cfg)
    out = sample_completions(
        sampler, nnx.state(model), prompts, jax.random.key(5), prompts["pools"], num_samples=G
    )
    rows = lambda m: np.moveaxis(np.asarray(m), 0, 1)  # noqa: E731  [L, B, N] -> [B, L, N]
    batch = assemble_prompts(
        repeat_prompts(prompts, G),
        np.asarray(out.tokens),
        np.asarray(out.mask),
        np.zeros(len(out.tokens)),
        with_pools=True,
        masses=(rows(out.vision_mass), rows(out.text_mass)),
    )
    values = {"vgr.enable_token_weights": True, "actor.ppo_epochs": 2}
    recompute = step_config({**values, "actor.shaping_source": "recompute"})
    graphdef, params = nnx.split(model, nnx.Param)
    batch = jax.tree.map(jnp.asarray, batch)
    passes = no_grad_passes(graphdef, params, None, batch, jax.random.key(0), recompute)
    m = np.asarray(out.mask) > 0
    assert m.sum() > len(m)  # several tokens a row
    for got, want in ((batch.old_vision_mass, passes.vision_mass),
                      (batch.old_text_mass, passes.text_mass)):  # fmt: skip
        np.testing.assert_allclose(rows(got)[:, m], np.asarray(want)[:, m], atol=1e-5)
    assert np.asarray(passes.vision_mass)[:, m].max() > 0.01  # the queries look at the image
    sampler_cfg = step_config({**values, "actor.shaping_source": "sampler"})
    batch = batch.replace(old_entropy=passes.entropy)
    got = no_grad_passes(graphdef, params, None, batch, jax.random.key(0), sampler_cfg)
    np.testing.assert_array_equal(got.vision_mass, rows(batch.old_vision_mass))


def test_rollouts_stop_at_generation_configs_eos_ids_too(setup, tmp_path):
    """As transformers' generate and vLLM: config.json's eos_token_id and those of the
    checkpoint's generation_config.json (Qwen2.5 Instruct: <|im_end|> and <|endoftext|>),
    each once; the tokenizer's EOS only where neither names one; an unreadable file is one
    ConfigError naming it."""
    import dataclasses
    import json

    from configs import base
    from jaxvrl.config import ConfigError
    from jaxvrl.trainer.setup import sampling_config, stop_token_ids

    tokenizer, model, _ = setup
    mcfg = model.config
    own = tuple(np.atleast_1d(mcfg.eos_token_id).tolist())
    assert stop_token_ids(mcfg, tokenizer, str(tmp_path)) == own  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [own[0], 7]}))
    assert stop_token_ids(mcfg, tokenizer, str(tmp_path)) == (*own, 7)
    cfg = sampling_config(base.get_config(), mcfg, tokenizer, model_dir=str(tmp_path))
    assert cfg.eos_token_ids == (*own, 7)
    bare = dataclasses.replace(mcfg, eos_token_id=None)
    assert stop_token_ids(bare, tokenizer) == (tokenizer.eos_token_id,)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json"):
        stop_token_ids(mcfg, tokenizer, str(tmp_path))
