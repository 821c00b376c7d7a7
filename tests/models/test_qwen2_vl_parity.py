"""Float32 parity of the Flax Qwen2-VL against transformers on tiny random checkpoints: logits
(text, images, video, padding, tied head, scanned or unrolled layers), rope index, greedy
generation, sampled log-probs, attention statistics, export; presets' parameter counts."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import jaxvrl.models as M
from jaxvrl.models import qwen2_vl as q
from jaxvrl.models.interface import CLIP_MEAN, CLIP_STD, ProcessorSettings
from jaxvrl.sampling import generate
from tests.models import hf_tiny as T
from tests.models import hf_tiny_qwen2_vl as T2
from tests.models.test_qwen2_5_vl_parity import assert_close
from tests.models.test_qwen2_5_vl_stats_io import _masses_from_hf

EOS = T.IM_END
PUBLISHED = {  # the model cards' parameter counts
    "qwen2-vl-2b": 2_208_985_600,
    "qwen2-vl-7b": 8_291_375_616,
    "qwen2-vl-72b": 73_405_560_320,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    hf = T2.build(path)
    return hf, M.load(path), path


def vision_kw(images=(), videos=(), pv=None, pvv=None):
    kw = {}
    if images:
        kw.update(pixel_values=pv, image_grid_thw=np.array(images))
    if videos:
        kw.update(pixel_values_videos=pvv, video_grid_thw=np.array(videos))
    return kw


def test_config_and_family(tiny):
    _, model, _ = tiny
    cfg = model.config
    assert isinstance(model, M.Model) and isinstance(cfg, q.Qwen2VLConfig)
    v = cfg.vision
    assert (v.norm, v.mlp, v.window_size, v.windowed, v.hidden_act) == (
        "layer",
        "plain",
        0,
        False,
        "quick_gelu",
    )
    assert (v.hidden_size, v.intermediate_size, v.out_hidden_size) == (32, 64, 64)
    assert v.full_blocks == frozenset(range(v.depth))
    # what we write reads back the same
    again = q.Qwen2VLConfig.from_hf_dict(cfg.to_hf_dict())
    assert (again.text, again.vision, again.eos_token_id) == (cfg.text, cfg.vision, EOS)
    assert M.family("qwen2_vl").processor(cfg) == ProcessorSettings(14, 2, 2, CLIP_MEAN, CLIP_STD)


def test_loads_a_flat_config_and_transformers_4_key_names(tiny, tmp_path):
    """The published checkpoints' flat config.json and the `model.language_model.` /
    `model.visual.` tensor names of transformers 4.5x saves give the same model."""
    from safetensors.numpy import load_file, save_file

    _, model, path = tiny
    flat = json.loads((path / "config.json").read_text())
    text = flat.pop("text_config")
    rope = text.pop("rope_parameters")
    flat.update({k: v for k, v in text.items() if k != "model_type"})
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["rope_theta"] = rope["rope_theta"]
    flat["vision_config"] = dict(flat["vision_config"], in_chans=3, model_type="qwen2_vl")
    (tmp_path / "config.json").write_text(json.dumps(flat))
    renamed = {}
    for k, v in load_file(os.path.join(path, "model.safetensors")).items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model.") :]
        elif k.startswith("visual."):
            k = "model." + k
        renamed[k] = v
    assert any(k.startswith("model.visual.blocks.0.norm1.bias") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    other = M.load(tmp_path)
    assert (other.config.text, other.config.vision) == (model.config.text, model.config.vision)
    a, b = nnx.state(model, nnx.Param), nnx.state(other, nnx.Param)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rope_index_matches_hf(tiny):
    """Left-padded rows with images and a video: video time is the frame index, and
    second_per_grid_ts changes nothing."""
    hf, model, _ = tiny
    rng = np.random.default_rng(0)
    images, videos = [[1, 4, 6], [1, 2, 2]], [[3, 4, 4]]
    rows = [T.prompt(rng, images=images[:1], videos=videos), T.prompt(rng, images=images[1:])]
    ids, mask = T.left_pad(rows)
    ours, deltas = M.rope_index(model.config, ids, mask, np.array(images), np.array(videos), [2.5])
    with torch.no_grad():
        ref, ref_deltas = hf.model.get_rope_index(
            torch.tensor(ids),
            torch.tensor(T.token_types(ids)),
            torch.tensor(images),
            torch.tensor(videos),
            torch.tensor(mask),
        )
    np.testing.assert_array_equal(ours, ref.numpy())
    np.testing.assert_array_equal(deltas, ref_deltas.numpy()[:, 0])
    video = ours[0, 0][ids[0] == T.VIDEO]
    np.testing.assert_array_equal(video - video[0], np.repeat([0, 1, 2], 4))


# One left-padded batch holds the vision cases, a row each: (images, videos, text length).
CASES = {
    "one image, odd merged grid": ([[1, 6, 10]], [], 3),  # 3 x 5 merged units
    "two images of different sizes": ([[1, 4, 8], [1, 10, 6]], [], 9),
    "video": ([], [[3, 4, 6]], 4),
    "image and video": ([[1, 6, 4]], [[2, 4, 4]], 2),
    "text only": ([], [], 12),
}


def case_rows(rng, names):
    """(ids int[B, T] left-padded, mask, vision kwargs packed in row order) of CASES rows."""
    rows, images, videos = [], [], []
    for name in names:
        im, vid, n = CASES[name]
        rows.append(T.prompt(rng, images=im, videos=vid, text_len=(n, n + 1)))
        images += im
        videos += vid
    ids, mask = T.left_pad(rows)
    pv = T.patches(rng, images) if images else None
    pvv = T.patches(rng, videos) if videos else None
    return ids, mask, vision_kw(images, videos, pv, pvv)


def hf_forward(hf, ids, mask, vision, **kw):
    args = {k: torch.tensor(np.asarray(v)) for k, v in vision.items()}
    with torch.no_grad():
        return hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            mm_token_type_ids=torch.tensor(T.token_types(ids)),
            **args,
            **kw,
        )


@nnx.jit
def _forward(model, ids, mask, pos, images, videos):
    return model.forward(ids, mask, pos, images=images, videos=videos).logits


def forward(model, ids, mask, vision):
    """Logits float32[B, T, V] of the jitted traceable forward (one compile per shape, where
    the HF-like call compiles op by op)."""
    cfg = model.config
    pos, _ = M.rope_index(
        cfg, ids, mask, vision.get("image_grid_thw"), vision.get("video_grid_thw")
    )
    images = videos = None
    if "pixel_values" in vision:
        images = M.vision_inputs(cfg, vision["pixel_values"], vision["image_grid_thw"])
    if "pixel_values_videos" in vision:
        videos = M.vision_inputs(cfg, vision["pixel_values_videos"], vision["video_grid_thw"])
    return np.asarray(_forward(model, ids, mask, pos, images, videos))


@pytest.fixture(scope="module")
def batch(tiny):
    """The CASES batch through the HF-like call (with attention pools, and seconds per video
    grid, which Qwen2-VL does not read) and through HF eager attention (with its attention
    weights)."""
    from transformers import Qwen2VLForConditionalGeneration

    _, model, path = tiny
    ids, mask, vision = case_rows(np.random.default_rng(1), list(CASES))
    pools = M.attention_pools(ids, mask, ids.shape[1], **T.POOL_IDS)
    out = model(ids, mask, **vision, second_per_grid_ts=[3.0, 0.5], pools=pools)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager")
    ref = hf_forward(hf.eval(), ids, mask, vision, output_attentions=True)
    return dict(ids=ids, mask=mask, vision=vision, pools=pools, out=out, ref=ref)


def test_text_only(tiny):
    hf, model, _ = tiny
    rng = np.random.default_rng(2)
    ids, mask = T.left_pad([T.prompt(rng, text_len=(3, 4)), T.prompt(rng, text_len=(11, 12))])
    logits = forward(model, ids, mask, {})
    assert_close(logits, hf_forward(hf, ids, mask, {}).logits.numpy(), mask)


@pytest.mark.parametrize("row, case", list(enumerate(CASES)))
def test_logits_in_a_left_padded_batch(batch, row, case):
    m = batch["mask"][row : row + 1]
    ours = np.asarray(batch["out"].logits)[row : row + 1]
    assert_close(ours, batch["ref"].logits.numpy()[row : row + 1], m)


def test_attention_statistics_match_hf_eager(tiny, batch):
    out, pools, mask = batch["out"], batch["pools"], batch["mask"]
    attentions = batch["ref"].attentions
    assert len(attentions) == tiny[1].config.text.num_hidden_layers
    ref_v, ref_x = _masses_from_hf(attentions, pools)
    valid = mask.astype(bool) & (np.arange(mask.shape[1]) > np.argmax(mask, 1)[:, None])
    for ours, theirs in ((out.vision_mass, ref_v), (out.text_mass, ref_x)):
        ours = np.asarray(ours)
        assert ours.shape == (2, *mask.shape)
        np.testing.assert_allclose(ours[:, valid], theirs[:, valid], atol=1e-5)
    assert np.asarray(out.vision_mass)[:, valid].max() > 0.01


def test_unrolled_layers_and_blocked_attention(tiny, batch):
    """scan_layers=False and the scanned model, both with the blocked kernel (8-token blocks,
    so rows and frames span several) in the decoder and in every block of the tower, give
    the scanned dense model's logits."""
    _, model, path = tiny
    unrolled = M.load(path, scan_layers=False)
    assert 0 in nnx.state(unrolled.model.layers)  # one module per layer
    unrolled.set_attention("flash", block=8)
    assert unrolled.visual.attention == "flash"
    logits = forward(unrolled, batch["ids"], batch["mask"], batch["vision"])
    m = batch["mask"].astype(bool)
    np.testing.assert_allclose(logits[m], np.asarray(batch["out"].logits)[m], atol=2e-5)
    scanned = M.load(path, attention="flash")
    scanned.set_attention("flash", block=8)
    assert (scanned.model.attention, scanned.visual.attention) == ("flash", "flash")
    logits = forward(scanned, batch["ids"], batch["mask"], batch["vision"])
    np.testing.assert_allclose(logits[m], np.asarray(batch["out"].logits)[m], atol=2e-5)


def check_export(model, path, ids, mask, vision, logits):
    """`jaxvrl.models.save` then transformers' `from_pretrained` gives our logits."""
    from transformers import Qwen2VLForConditionalGeneration

    M.save(model, path)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    assert hf.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert_close(logits, hf_forward(hf, ids, mask, vision).logits.numpy(), mask)


def test_untied_export(tiny, batch, tmp_path):
    from safetensors.numpy import load_file

    _, model, path = tiny
    logits = np.asarray(batch["out"].logits)
    check_export(model, tmp_path, batch["ids"], batch["mask"], batch["vision"], logits)
    original = load_file(os.path.join(path, "model.safetensors"))
    exported = load_file(tmp_path / "model.safetensors")
    assert set(original) == set(exported)
    for k in original:
        np.testing.assert_array_equal(original[k], exported[k], err_msg=k)


def test_tied_embeddings_and_their_export(tmp_path):
    hf = T2.build(tmp_path / "tied", seed=7, tie=True, heads=8, kv_heads=8, mrope=(1, 1, 2))
    model = M.load(tmp_path / "tied")
    assert model.config.tie_word_embeddings and not hasattr(model, "lm_head")
    ids, mask, vision = case_rows(np.random.default_rng(7), ["image and video", "text only"])
    logits = forward(model, ids, mask, vision)
    assert_close(logits, hf_forward(hf, ids, mask, vision).logits.numpy(), mask)
    check_export(model, tmp_path / "export", ids, mask, vision, logits)


@pytest.fixture(scope="module")
def prompts():
    names = ["image and video", "text only", "two images of different sizes"]
    return case_rows(np.random.default_rng(9), names)


def test_greedy_tokens_match_hf_generate(tiny, prompts):
    hf, model, _ = tiny
    ids, mask, vision = prompts
    n = 8
    ours = generate(
        model, ids, mask, max_new_tokens=n, temperature=0.0, eos_token_ids=EOS, **vision
    )
    kw = {k: torch.tensor(np.asarray(v)) for k, v in vision.items()}
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            mm_token_type_ids=torch.tensor(T.token_types(ids)),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=EOS,
            pad_token_id=0,
            # ours never samples vision tokens
            suppress_tokens=[T.IMAGE, T.VIDEO, T.VSTART, T.VEND],
            **kw,
        )[:, ids.shape[1] :].numpy()
    toks, m = np.asarray(ours.tokens), np.asarray(ours.mask)
    for row in range(ids.shape[0]):
        k = int(m[row].sum())
        assert k > 0
        np.testing.assert_array_equal(toks[row, :k], ref[row, :k], err_msg=f"row {row}")


def test_sampled_logprobs_match_teacher_forcing(tiny, prompts):
    _, model, _ = tiny
    ids, mask, vision = prompts
    temp = 0.8
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=8,
        temperature=temp,
        eos_token_ids=EOS,
        rng=jax.random.key(4),
        **vision,
    )
    toks, m, lp = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
    full = np.concatenate([ids, toks], 1)
    fmask = np.concatenate([mask, m.astype(np.int64)], 1)
    logits = forward(model, full, fmask, vision)
    logp = jax.nn.log_softmax(logits[:, ids.shape[1] - 1 : -1] / temp, -1)
    ref = np.take_along_axis(np.asarray(logp), toks[..., None], -1)[..., 0]
    assert (m > 0).sum() > 4
    np.testing.assert_allclose(lp[m > 0], ref[m > 0], atol=2e-4)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    """Our abstract build of each preset, transformers' model of the same config.json (on the
    meta device) and the model card agree on the parameter count."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    with open(os.path.join(M.PRESETS, f"{name}.json")) as f:
        d = json.load(f)
    cfg = M.config_from_hf(d)
    assert isinstance(cfg, q.Qwen2VLConfig)
    abstract = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    with torch.device("meta"):
        hf = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**d))
    assert ours == sum(p.numel() for p in hf.parameters()) == PUBLISHED[name]
    assert (cfg.vision.depth, cfg.vision.hidden_size, cfg.vision.num_heads) == (32, 1280, 16)
    assert cfg.vision.out_hidden_size == cfg.text.hidden_size
