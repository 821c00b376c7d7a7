"""Sampler: greedy tokens equal HF generate; logprobs equal a teacher-forced pass; masking,
early stop, compile count (programs shared by every call), top-k/top-p, legacy keys."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxvrl.models import qwen2_5_vl
from jaxvrl.sampling import Sampler, SamplingConfig, generate
from jaxvrl.sampling import sampler as sampler_lib
from jaxvrl.sampling.sampler import generation_config
from tests.models import hf_tiny

EOS = hf_tiny.IM_END
N = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampler_model")
    hf = hf_tiny.build(path, seed=5)
    return hf, qwen2_5_vl.load(path)


def hf_greedy(hf, ids, mask, **vision):
    kw = dict(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        mm_token_type_ids=torch.tensor(hf_tiny.token_types(ids)),
    )
    kw.update({k: torch.tensor(np.asarray(v)) for k, v in vision.items() if v is not None})
    with torch.no_grad():
        out = hf.generate(**kw, do_sample=False, max_new_tokens=N, eos_token_id=EOS, pad_token_id=0)
    return out[:, ids.shape[1] :].numpy()


def check_greedy(hf, model, ids, mask, **vision):
    ours = generate(
        model, ids, mask, max_new_tokens=N, temperature=0.0, eos_token_ids=EOS, **vision
    )
    ref = hf_greedy(
        hf,
        ids,
        mask,
        **{k: v for k, v in vision.items() if k != "second_per_grid_ts" or v is not None},
    )
    toks, m = np.asarray(ours.tokens), np.asarray(ours.mask)
    for row in range(ids.shape[0]):
        n = int(m[row].sum())
        assert n > 0
        np.testing.assert_array_equal(toks[row, :n], ref[row, :n], err_msg=f"row {row}")
    return ours


def test_greedy_text_and_left_padding(models):
    hf, model = models
    rng = np.random.default_rng(0)
    ids, mask = hf_tiny.left_pad(
        [hf_tiny.prompt(rng, text_len=(3, 4)), hf_tiny.prompt(rng, text_len=(11, 12))]
    )
    check_greedy(hf, model, ids, mask)


def test_greedy_images_and_multi_image_batch(models):
    hf, model = models
    rng = np.random.default_rng(1)
    grids = [[1, 4, 6], [1, 6, 10], [1, 2, 2]]
    rows = [hf_tiny.prompt(rng, images=grids[:1]), hf_tiny.prompt(rng, text_len=(7, 8))]
    ids, mask = hf_tiny.left_pad(rows + [hf_tiny.prompt(rng, images=grids[1:])])
    pv = hf_tiny.patches(rng, grids)
    check_greedy(hf, model, ids, mask, pixel_values=pv, image_grid_thw=np.array(grids))


def test_greedy_video(models):
    hf, model = models
    rng = np.random.default_rng(2)
    grids = [[2, 4, 4]]
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, videos=grids)])
    pvv = hf_tiny.patches(rng, grids)
    check_greedy(
        hf,
        model,
        ids,
        mask,
        pixel_values_videos=pvv,
        video_grid_thw=np.array(grids),
        second_per_grid_ts=np.array([1.0]),
    )


def test_logprobs_match_teacher_forcing_and_eos_masking(models):
    _, model = models
    rng = np.random.default_rng(3)
    grids = [[1, 4, 4]]
    rows = [hf_tiny.prompt(rng, images=grids), hf_tiny.prompt(rng, text_len=(6, 7))]
    ids, mask = hf_tiny.left_pad(rows)
    pv = hf_tiny.patches(rng, grids[:1])
    temp = 0.8
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=N,
        temperature=temp,
        top_k=40,
        top_p=0.95,
        eos_token_ids=(EOS, 280),
        rng=jax.random.key(4),
        pixel_values=pv,
        image_grid_thw=np.array(grids),
    )
    toks, m, lp = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
    full = np.concatenate([ids, toks], 1)
    fmask = np.concatenate([mask, m.astype(np.int64)], 1)
    logits = np.asarray(model(full, fmask, pixel_values=pv, image_grid_thw=np.array(grids)).logits)
    logp = jax.nn.log_softmax(logits[:, ids.shape[1] - 1 : -1] / temp, -1)
    ref = np.take_along_axis(np.asarray(logp), toks[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp[m > 0], ref[m > 0], atol=2e-4)
    for row in range(2):
        n = int(m[row].sum())
        ended = np.isin(toks[row, :n], [EOS, 280])
        assert ended[:-1].sum() == 0  # nothing sampled after the first EOS is kept
        assert bool(out.truncated[row]) == (not ended[-1])
        assert np.all(toks[row, n:] == 0) and np.all(lp[row, n:] == 0)
        assert not np.isin(
            toks[row], [hf_tiny.IMAGE, hf_tiny.VIDEO, hf_tiny.VSTART, hf_tiny.VEND]
        ).any()


@pytest.mark.parametrize("slots", [0, 3])
def test_entropies_match_teacher_forcing(models, slots):
    """With SamplingConfig.entropies the sampler returns each token's entropy of
    softmax(logits / T) over the full vocabulary (top-k/top-p do not change it), as the
    trainer's teacher-forced pass computes it; 0 after a row ends. Static and slot decoding."""
    import dataclasses

    from flax import nnx

    _, model = models
    rng = np.random.default_rng(6)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(3, 9)) for _ in range(3)])
    temp = 0.7
    cfg = generation_config(model.config, max_new_tokens=N, temperature=temp, top_k=50,
                            eos_token_ids=tuple(range(3, 400, 9)))  # fmt: skip
    cfg = dataclasses.replace(cfg, entropies=True, slots=slots, page_size=4)
    pos, deltas = qwen2_5_vl.get_rope_index(ids, mask, model.config)
    args = [jax.numpy.asarray(x) for x in (ids, mask, pos, deltas)]
    out = Sampler(nnx.graphdef(model), cfg)(nnx.state(model), *args, jax.random.key(2))
    toks, m, ent = (np.asarray(x) for x in (out.tokens, out.mask, out.entropies))
    full = np.concatenate([ids, toks], 1)
    fmask = np.concatenate([mask, m.astype(np.int64)], 1)
    logits = np.asarray(model(full, fmask).logits)[:, ids.shape[1] - 1 : -1] / temp
    logp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    ref = -np.sum(np.exp(logp) * logp, -1)
    assert 0.5 < m.sum() < m.size and ref[m > 0].std() > 0.01  # entropies vary by token
    np.testing.assert_allclose(ent[m > 0], ref[m > 0], atol=5e-5)  # float32 over 448 terms
    assert np.all(ent[m == 0] == 0)


def test_sampled_tokens_lie_in_the_top_p_set(models):
    _, model = models
    rng = np.random.default_rng(9)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(4, 12)) for _ in range(4)])
    out = generate(
        model, ids, mask, max_new_tokens=N, temperature=1.0, top_p=0.5, eos_token_ids=EOS,
        rng=jax.random.key(5),
    )  # fmt: skip
    toks, m = np.asarray(out.tokens), np.asarray(out.mask)
    full = np.concatenate([ids, toks], 1)
    logits = np.asarray(model(full, np.concatenate([mask, m.astype(np.int64)], 1)).logits)
    x = logits[:, ids.shape[1] - 1 : -1].astype(np.float64)
    x[..., [hf_tiny.IMAGE, hf_tiny.VIDEO, hf_tiny.VSTART, hf_tiny.VEND]] = -np.inf
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    desc = -np.sort(-p, -1)
    n_keep = (np.cumsum(desc, -1) < 0.5).sum(-1, keepdims=True) + 1
    threshold = np.take_along_axis(desc, n_keep - 1, -1)[..., 0]
    p_tok = np.take_along_axis(p, toks[..., None], -1)[..., 0]
    assert np.all(p_tok[m > 0] >= threshold[m > 0] - 1e-4)


def test_one_compilation_per_shape_with_images(models):
    """Different prompts and images of one (batch, prompt length, patch bucket) shape."""
    _, model = models
    rng = np.random.default_rng(8)
    from flax import nnx

    cfg = generation_config(model.config, max_new_tokens=5, temperature=1.0, eos_token_ids=EOS)
    sampler = Sampler(nnx.graphdef(model), cfg)
    counts = []
    for grids in ([[1, 4, 4], [1, 2, 6]], [[1, 6, 2], [1, 2, 2]], [[1, 2, 4], [1, 4, 2]]):
        rows = [hf_tiny.prompt(rng, images=[g], text_len=(4, 7)) for g in grids]
        ids, mask = hf_tiny.left_pad(rows, length=20)
        out = generate(
            model,
            ids,
            mask,
            max_new_tokens=5,
            temperature=1.0,
            eos_token_ids=EOS,
            rng=jax.random.key(0),
            pixel_values=hf_tiny.patches(rng, grids),
            image_grid_thw=np.array(grids),
            patch_bucket=16,
            sampler=sampler,
        )
        assert out.tokens.shape == (2, 5)
        counts.append(sampler.compiles())
    assert counts == [1, 1, 1]
    with pytest.raises(ValueError, match="the sampler was made for"):
        generate(model, ids, mask, max_new_tokens=4, temperature=1.0, sampler=sampler)


def test_one_compilation_per_shape_and_early_stop(models):
    _, model = models
    from flax import nnx

    graphdef, params = nnx.split(model)
    cfg = SamplingConfig(
        max_new_tokens=N, temperature=1.0, eos_token_ids=tuple(range(300)), check_every=1
    )
    fn = Sampler(graphdef, cfg)
    rng = np.random.default_rng(5)
    for seed in range(3):
        ids = rng.integers(20, 280, (2, 9))
        mask = np.ones_like(ids)
        pos, deltas = qwen2_5_vl.get_rope_index(ids, mask, model.config)
        out = fn(params, ids, mask, pos, deltas, jax.random.key(seed))
        # every token is an EOS: each row ends after one token and the loop stops
        np.testing.assert_array_equal(np.asarray(out.mask).sum(1), [1, 1])
        assert int(out.steps) == 1
    assert fn.compiles() == 1


def _programs() -> tuple[int, int]:
    """Prefill and decode programs in jax's cache (the module-level jits every sampler runs)."""
    return sampler_lib.prefill_program._cache_size(), sampler_lib.decode_program._cache_size()


def test_generate_calls_share_their_programs(models):
    """`generate` makes a new `Sampler` on each call, here for a new model object of the same
    structure each time too: the programs are compiled once for these shapes and settings,
    and again for another max_new_tokens. A kept sampler counts the shapes it has run."""
    from flax import nnx

    _, model = models
    rng = np.random.default_rng(12)
    ids, mask = hf_tiny.left_pad(
        [hf_tiny.prompt(rng, text_len=(3, 5)), hf_tiny.prompt(rng, text_len=(8, 10))]
    )
    kw = dict(temperature=0.7, top_k=30, eos_token_ids=EOS, rng=jax.random.key(1))
    before = _programs()
    outs = [
        generate(nnx.merge(*nnx.split(model)), ids, mask, max_new_tokens=7, **kw) for _ in range(3)
    ]
    assert _programs() == (before[0] + 1, before[1] + 1)
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(outs[0].tokens))
    cfg = generation_config(model.config, max_new_tokens=7, temperature=0.7, top_k=30,
                            eos_token_ids=EOS)  # fmt: skip
    sampler = Sampler(nnx.graphdef(model), cfg)
    for _ in range(2):
        generate(model, ids, mask, max_new_tokens=7, sampler=sampler, **kw)
    assert sampler.compiles() == 1 and _programs() == (before[0] + 1, before[1] + 1)
    generate(model, ids, mask, max_new_tokens=9, **kw)
    assert _programs() == (before[0] + 2, before[1] + 2)


def test_generate_packs_the_decode_weights_once_per_parameters(models, monkeypatch):
    """Repeated `generate` calls on a model (or on a merged copy holding the same arrays) take
    the decode weights the first call packed; once its parameters are updated, a call packs
    them afresh and samples what a model holding copies of the new arrays samples."""
    from flax import nnx

    _, model = models
    packs = []
    real = Sampler.decode_weights

    def counted(self, *args, **kwargs):
        packs.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "decode_weights", counted)
    rng = np.random.default_rng(13)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(3, 6)) for _ in range(3)])
    kw = dict(max_new_tokens=6, temperature=0.0)
    first = generate(model, ids, mask, **kw)
    again = generate(nnx.merge(*nnx.split(model)), ids, mask, **kw)
    assert len(packs) == 1 and sampler_lib._GENERATE_WEIGHTS  # transposed decode weights kept
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(first.tokens))

    changed = nnx.merge(*nnx.split(model))
    params = nnx.state(changed, nnx.Param)
    nnx.update(changed, jax.tree.map(lambda x: -x, params))
    got = generate(changed, ids, mask, **kw)
    assert len(packs) == 2
    copied = nnx.merge(*jax.tree.map(lambda x: jax.numpy.array(x, copy=True), nnx.split(changed)))
    want = generate(copied, ids, mask, **kw)
    assert len(packs) == 3
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert not np.array_equal(np.asarray(got.tokens), np.asarray(first.tokens))


def test_a_legacy_key_samples_what_a_typed_key_samples(models):
    """A uint32[2] key (`jax.random.PRNGKey`) is the typed key of the same seed: the same
    tokens and log-probs, sampled at temperature 1 with top-k and top-p."""
    _, model = models
    rng = np.random.default_rng(13)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(4, 9)) for _ in range(3)])
    kw = dict(max_new_tokens=N, temperature=1.0, top_p=0.9, top_k=40, eos_token_ids=EOS)
    legacy = generate(model, ids, mask, rng=jax.random.PRNGKey(3), **kw)
    typed = generate(model, ids, mask, rng=jax.random.key(3), **kw)
    other = generate(model, ids, mask, rng=jax.random.key(4), **kw)
    assert int(np.asarray(legacy.mask).sum()) > 6
    np.testing.assert_array_equal(np.asarray(legacy.tokens), np.asarray(typed.tokens))
    np.testing.assert_array_equal(np.asarray(legacy.logprobs), np.asarray(typed.logprobs))
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(typed.tokens))


def test_top_k_one_is_greedy(models):
    _, model = models
    rng = np.random.default_rng(6)
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, text_len=(5, 6))])
    g = generate(model, ids, mask, max_new_tokens=6, temperature=0.0, eos_token_ids=EOS)
    s = generate(
        model,
        ids,
        mask,
        max_new_tokens=6,
        temperature=1.0,
        top_k=1,
        eos_token_ids=EOS,
        rng=jax.random.key(1),
    )
    np.testing.assert_array_equal(np.asarray(g.tokens), np.asarray(s.tokens))


def test_decode_attention_statistics(models):
    _, model = models
    rng = np.random.default_rng(7)
    grids = [[1, 4, 4]]
    ids, mask = hf_tiny.left_pad([hf_tiny.prompt(rng, images=grids)])
    pv = hf_tiny.patches(rng, grids)
    pools = qwen2_5_vl.attention_pools(
        ids,
        mask,
        ids.shape[1],
        im_start_id=hf_tiny.IM_START,
        im_end_id=hf_tiny.IM_END,
        user_header_ids=[10, 11],
        special_ids=[hf_tiny.IMAGE, hf_tiny.VSTART, hf_tiny.VEND, hf_tiny.IM_START, hf_tiny.IM_END],
        vision_ids=[hf_tiny.IMAGE],
    )
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=4,
        temperature=0.0,
        eos_token_ids=(),
        pixel_values=pv,
        image_grid_thw=np.array(grids),
        pools=pools,
    )
    full = np.concatenate([ids, np.asarray(out.tokens)], 1)
    full_pools = {k: np.pad(v, ((0, 0), (0, 4))) for k, v in pools.items()}
    ref = model(
        full, np.ones_like(full), pixel_values=pv, image_grid_thw=np.array(grids), pools=full_pools
    )
    p = ids.shape[1]
    # token i's masses are its predictor's: the prefill's last query (p - 1) for token 0, the
    # decode step that fed token i - 1 after (a teacher-forced pass's positions p - 1 .. p + 2)
    for got, want in ((out.vision_mass, ref.vision_mass), (out.text_mass, ref.text_mass)):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want)[:, :, p - 1 : p + 3], atol=1e-5
        )
    assert np.asarray(out.vision_mass)[:, 0, 0].max() > 0.01  # the prefill's query looks


@pytest.mark.parametrize("variant", ["untied", "tied", "lora"])
def test_transposed_decode_layout_equals_the_model_layout(models, tmp_path, variant):
    """Decode steps with [out, in] weight copies (the CPU default) give the tokens and
    log-probs of the stored [in, out] kernels: tied head, untied head, LoRA-wrapped linears."""
    from flax import nnx

    from jaxvrl.models import lora

    model = models[1]
    if variant == "tied":
        hf_tiny.build(tmp_path, seed=8, tie=True)
        model = qwen2_5_vl.load(tmp_path)
        assert model.config.tie_word_embeddings
    elif variant == "lora":
        hf_tiny.build(tmp_path, seed=5)
        model = qwen2_5_vl.load(tmp_path)
        lora.apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "down_proj"))
        state = nnx.state(model)
        keys = iter(jax.random.split(jax.random.key(1), 64))
        state = jax.tree.map_with_path(
            lambda p, x: (
                jax.random.normal(next(keys), x.shape, x.dtype) * 0.3
                if "lora_b" in jax.tree_util.keystr(p)
                else x
            ),
            state,
        )
        nnx.update(model, state)
    rng = np.random.default_rng(9)
    ids, mask = hf_tiny.left_pad(
        [
            hf_tiny.prompt(rng, images=[[1, 4, 4]], text_len=(3, 6)),
            hf_tiny.prompt(rng, text_len=(9, 12)),
        ]
    )
    grid = np.array([[1, 4, 4]])
    pv = hf_tiny.patches(rng, grid)
    outs = [
        generate(
            model,
            ids,
            mask,
            max_new_tokens=N,
            temperature=1.0,
            rng=jax.random.key(3),
            pixel_values=pv,
            image_grid_thw=grid,
            decode_layout=layout,
        )
        for layout in ("model", "transposed")
    ]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(
        np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs), atol=1e-5
    )
    if variant == "lora":  # the adapters take part: without them the tokens change
        plain = generate(
            qwen2_5_vl.load(tmp_path), ids, mask, max_new_tokens=N, temperature=0.0,
            pixel_values=pv, image_grid_thw=grid,
        )  # fmt: skip
        ours = generate(
            model, ids, mask, max_new_tokens=N, temperature=0.0, pixel_values=pv,
            image_grid_thw=grid,
        )  # fmt: skip
        assert not np.array_equal(np.asarray(plain.logprobs), np.asarray(ours.logprobs))


def test_decode_attention_forms_agree(models, monkeypatch, retrace):
    """A decode step's cached attention as products and middle-axis reductions (the CPU form)
    and as the batched matmuls (prefill, accelerators) give the same tokens and log-probs."""
    from jaxvrl.sampling.cpu import decode

    model = models[1]
    rng = np.random.default_rng(11)
    ids, mask = hf_tiny.left_pad(
        [
            hf_tiny.prompt(rng, images=[[1, 4, 4]], text_len=(3, 6)),
            hf_tiny.prompt(rng, text_len=(9, 12)),
        ]
    )
    grid = np.array([[1, 4, 4]])
    pv = hf_tiny.patches(rng, grid)
    kw = dict(max_new_tokens=N, temperature=1.0, rng=jax.random.key(4), pixel_values=pv,
              image_grid_thw=grid)  # fmt: skip
    products = generate(model, ids, mask, **kw)
    monkeypatch.setattr(decode, "attention", None)  # the model's own cached attention
    retrace()
    matmuls = generate(model, ids, mask, **kw)
    assert int(np.asarray(products.mask).sum()) > 4
    np.testing.assert_array_equal(np.asarray(products.tokens), np.asarray(matmuls.tokens))
    np.testing.assert_allclose(
        np.asarray(products.logprobs), np.asarray(matmuls.logprobs), atol=1e-5
    )
