"""Attention statistics vs HF eager attentions; export round trip; loader errors; no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxvrl.models import qwen2_5_vl as q
from tests.models import hf_tiny as T
from tests.models.export_check import same_tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_io")
    T.build(path, seed=3)
    return path


def test_attention_pools_hand_case():
    # pad, im_start, user, \n, vstart, img, img, vend, 30, 31, im_end, im_start, asst, \n | 40 41
    ids = np.array([[0, 294, 10, 11, 292, 290, 290, 293, 30, 31, 295, 294, 12, 11, 40, 41]])
    mask = np.array([[0] + [1] * 15])
    pools = q.attention_pools(ids, mask, prompt_length=14, **T.POOL_IDS)
    vision = np.zeros(16, bool)
    vision[[5, 6]] = True
    text = np.zeros(16, bool)
    text[[8, 9]] = True
    prompt = np.zeros(16, bool)
    prompt[2:14] = True  # first valid token (the sink) and completion excluded
    np.testing.assert_array_equal(pools["vision"][0], vision)
    np.testing.assert_array_equal(pools["text"][0], text)
    np.testing.assert_array_equal(pools["prompt"][0], prompt)


def _masses_from_hf(attn, pools):
    """Independent reduction of HF eager attentions [B, H, T, S] per layer."""
    out_v, out_x = [], []
    for a in attn:
        p = a.numpy().astype(np.float64).mean(axis=1)
        tot = (p * pools["prompt"][:, None, :]).sum(-1)
        tot = np.where(tot > 0, tot, np.nan)  # sink/padding rows: compared nowhere
        out_v.append((p * pools["vision"][:, None, :]).sum(-1) / tot)
        out_x.append((p * pools["text"][:, None, :]).sum(-1) / tot)
    return np.stack(out_v), np.stack(out_x)


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_attention_statistics_match_hf_eager(tiny, attention):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny, attn_implementation="eager")
    model = q.load(tiny)
    model.set_attention(attention, block=8)  # flash: per-pool sums over several key blocks
    rng = np.random.default_rng(0)
    grids = [[1, 4, 6], [1, 2, 4]]
    rows = [T.prompt(rng, images=grids[:1]) + [40, 41, 42], T.prompt(rng, images=grids[1:]) + [43]]
    ids, mask = T.left_pad(rows)
    prompt_len = ids.shape[1] - 1  # the last column is completion for row 2, 3 tokens for row 1
    pv = T.patches(rng, grids)
    pools = q.attention_pools(ids, mask, prompt_len, **T.POOL_IDS)
    out = model(ids, mask, pixel_values=pv, image_grid_thw=np.array(grids), pools=pools)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=torch.tensor(pv),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=torch.tensor(T.token_types(ids)),
            output_attentions=True,
        )
    assert len(ref.attentions) == model.config.text.num_hidden_layers
    ref_v, ref_x = _masses_from_hf(ref.attentions, pools)
    valid = mask.astype(bool) & (np.arange(ids.shape[1]) > np.argmax(mask, 1)[:, None])
    for ours, theirs in ((out.vision_mass, ref_v), (out.text_mass, ref_x)):
        ours = np.asarray(ours)
        assert ours.shape == (2, 2, ids.shape[1])
        np.testing.assert_allclose(ours[:, valid], theirs[:, valid], atol=1e-5)
    # The masses are real fractions: vision + text < 1 and both > 0 after the image.
    assert np.all(np.asarray(out.vision_mass)[:, valid] >= 0)
    assert np.all(np.asarray(out.vision_mass + out.text_mass)[:, valid] <= 1 + 1e-6)


def test_export_round_trip(tiny, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = q.load(tiny)
    q.save(model, tmp_path / "export")
    same_tensors(tiny, tmp_path / "export")
    hf_a = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny)
    hf_b = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "export")
    sd_a, sd_b = hf_a.state_dict(), hf_b.state_dict()
    assert set(sd_a) == set(sd_b)
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    assert (
        hf_a.config.to_dict()["text_config"]["rope_parameters"]
        == hf_b.config.to_dict()["text_config"]["rope_parameters"]
    )


def test_loads_transformers_4_layout_and_sharded_index(tiny, tmp_path):
    """Old saves nest keys under model.language_model / model.visual and may be sharded."""
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model.") :]
        elif k.startswith("visual."):
            k = "model." + k
        renamed[k] = v
    keys = sorted(renamed)
    half = len(keys) // 2
    files = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for name, ks in files.items():
        save_file({k: renamed[k] for k in ks}, tmp_path / name)
    index = {"weight_map": {k: name for name, ks in files.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((tiny / "config.json").read_text())
    flat = dict(cfg)
    text = flat.pop("text_config")
    rope = text.pop("rope_parameters")
    flat.update(text)
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["rope_theta"] = rope["rope_theta"]
    flat["model_type"] = "qwen2_5_vl"
    (tmp_path / "config.json").write_text(json.dumps(flat))
    a, b = q.load(tiny), q.load(tmp_path)
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(np.asarray(a(ids).logits), np.asarray(b(ids).logits))

    os.remove(tmp_path / "b.safetensors")
    with pytest.raises(FileNotFoundError, match="b.safetensors"):
        q.load(tmp_path)


def test_loader_errors_name_file_and_key(tiny, tmp_path):
    cfg = json.loads((tiny / "config.json").read_text())
    bad = dict(cfg, model_type="llava")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(q.ConfigError, match=r"config.json: model_type 'llava'"):
        q.load(tmp_path)

    wrong = json.loads(json.dumps(cfg))
    wrong["text_config"]["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(wrong))
    os.symlink(tiny / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(q.ConfigError, match=r"model.safetensors: tensor model.layers.0.mlp"):
        q.load(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    del tensors["model.norm.weight"]
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    os.remove(tmp_path / "model.safetensors")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(q.ConfigError, match=r"model.extra.weight \(model.safetensors\)"):
        q.load(tmp_path)
    del tensors["model.extra.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(q.ConfigError, match=r"lacks tensors: model.norm.weight"):
        q.load(tmp_path)
    # one layer's tensor of a stacked (scanned) param is named by its own HF key
    tensors["model.norm.weight"] = load_file(os.path.join(tiny, "model.safetensors"))[
        "model.norm.weight"
    ]
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(q.ConfigError, match=r"lacks tensors: model.layers.1.mlp.up_proj.weight$"):
        q.load(tmp_path)

    os.remove(tmp_path / "config.json")
    with pytest.raises(q.ConfigError, match="config.json: not found"):
        q.load(tmp_path)


def test_bfloat16_close_to_float32(tiny):
    import jax.numpy as jnp

    f32 = q.load(tiny)
    bf16 = q.load(tiny, dtype=jnp.bfloat16)
    assert bf16.model.layer(0).mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    rng = np.random.default_rng(1)
    grids = [[1, 4, 4]]
    ids = np.array([T.prompt(rng, images=grids)])
    pv = T.patches(rng, grids)
    a = np.asarray(f32(ids, pixel_values=pv, image_grid_thw=np.array(grids)).logits)
    b = np.asarray(bf16(ids, pixel_values=pv, image_grid_thw=np.array(grids)).logits)
    assert b.dtype == np.float32
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert np.mean(a.argmax(-1) == b.argmax(-1)) > 0.8


def test_loading_and_forward_never_import_torch(tiny):
    code = (
        "import sys, numpy as np\n"
        "from jaxvrl.models import qwen2_5_vl as q\n"
        f"m = q.load({str(tiny)!r})\n"
        "pv = np.zeros((16, 1176), np.float32)\n"
        "ids = np.array([[294, 292] + [290] * 4 + [293, 5]])\n"
        "m(ids, pixel_values=pv, image_grid_thw=np.array([[1, 4, 4]]))\n"
        f"q.save(m, {str(tiny / 'resaved')!r})\n"
        "bad = [k for k in sys.modules if k == 'torch' or k.startswith('torch.')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok")
