"""Rows with videos through the trainer: the rollout's collated batch (positions, per-row image
and video patches) gives transformers' logits for every row of a batch mixing text-only,
image, video and image + video rows; the perturbed-image pass blackens video patches as it
does image patches; a TPRL run on such a dataset trains and draws its attention maps."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from jaxvrl import models
from jaxvrl.data.pipeline import EncodeOptions, collate, encode_rows
from jaxvrl.trainer.passes import blacken_patches
from jaxvrl.trainer.rollout import assemble_prompts, repeat_prompts
from tests.trainer.test_families import save_family

VIDEO_PIXELS = dict(video_min_pixels=56 * 56, video_max_pixels=84 * 84)


def _frames(rng, n: int, size=(84, 56)) -> list:
    return [Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), np.uint8)) for _ in range(n)]


def _rows(seed: int = 0) -> list[dict]:
    """Text only, one image, one video, an image and a video, two videos of different sizes."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (56, 84, 3), np.uint8))
    return [
        {"problem": "a question without media", "answer": "A"},
        {"problem": "<image> what is drawn?", "images": [image], "answer": "A"},
        {"problem": "what happens in <video>?", "videos": [_frames(rng, 4)], "answer": "B"},
        {
            "problem": "<image> then <video>: the same?",
            "images": [image],
            "videos": [_frames(rng, 2, (56, 56))],
            "answer": "B",
        },
        {
            "problem": "<video> against <video>",
            "videos": [_frames(rng, 2), _frames(rng, 6, (56, 112))],
            "answer": "A",
        },
    ]


def _hf_logits(hf, ex: dict, cfg, timed: bool) -> np.ndarray:
    """transformers' logits of one encoded example, unpadded."""
    import torch

    ids = np.asarray(ex["prompt_ids"])[None]
    types = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.video_token_id, 2, 0))
    kw = dict(input_ids=torch.tensor(ids), mm_token_type_ids=torch.tensor(types))
    if len(ex["image_grid_thw"]):
        kw["pixel_values"] = torch.tensor(ex["pixel_values"])
        kw["image_grid_thw"] = torch.tensor(ex["image_grid_thw"])
    if len(ex["video_grid_thw"]):
        kw["pixel_values_videos"] = torch.tensor(ex["pixel_values_videos"])
        kw["video_grid_thw"] = torch.tensor(ex["video_grid_thw"])
        if timed:  # Qwen2.5-VL's temporal positions read the seconds per frame group
            kw["second_per_grid_ts"] = torch.tensor(ex["second_per_grid_ts"])
    with torch.no_grad():
        return hf(**kw).logits[0].numpy()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_collated_rows_with_videos_give_transformers_logits(family, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = models.EMBEDDED
    if family != "qwen2_5_vl":  # a tiny random one with the embedded tokenizer
        path = tmp_path
        save_family(family, path)
    model = models.load(path)
    cfg = model.config
    tokenizer = AutoTokenizer.from_pretrained(path)
    opts = EncodeOptions(
        processor=models.processor(cfg), max_prompt_length=1024, video_fps=3.0, **VIDEO_PIXELS
    )
    examples, stats = encode_rows(_rows(), tokenizer, opts, source="rows")
    assert stats.total == 0 and len(examples) == 5
    assert [len(e["video_grid_thw"]) for e in examples] == [0, 0, 1, 1, 2]

    # the rollout's batches: each prompt once for the sampler, then G rows of each
    batch = repeat_prompts(collate(examples, 1, cfg, tokenizer), 2)
    assert batch["has_image"].tolist() == [False] * 2 + [True] * 8
    assert batch["videos"].pixel_values.shape[0] == 10
    out = model.forward(
        batch["input_ids"],
        batch["attention_mask"],
        batch["position_ids"],
        images=jax.tree.map(jax.numpy.asarray, batch["images"]),
        videos=jax.tree.map(jax.numpy.asarray, batch["videos"]),
    )
    got = np.asarray(out.logits)
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    width = batch["input_ids"].shape[1]
    for i, ex in enumerate(examples):
        want = _hf_logits(hf, ex, cfg, timed=family == "qwen2_5_vl")
        for row in (2 * i, 2 * i + 1):
            ours = got[row, width - len(want) :]  # left-padded
            np.testing.assert_allclose(ours, want, atol=2e-5 * np.abs(want).max())


def test_the_perturbed_pass_blackens_video_patches(tmp_path):
    """A batch of video rows only: the perturbed pass's log-probs are a forward over the
    videos' patches blackened (drawn from fold_in(rng, 1); images from rng itself), and
    differ from the clean ones."""
    from transformers import AutoTokenizer

    from jaxvrl.trainer.experience import no_grad_passes
    from tests.helpers import N, reference_logp, step_config

    model = models.load(models.EMBEDDED)
    cfg = model.config
    tokenizer = AutoTokenizer.from_pretrained(models.EMBEDDED)
    opts = EncodeOptions(processor=models.processor(cfg), max_prompt_length=1024, **VIDEO_PIXELS)
    examples, _ = encode_rows(_rows()[2:5:2], tokenizer, opts, source="rows")
    prompts = collate(examples, 2, cfg, tokenizer)
    assert prompts["images"] is None and prompts["videos"] is not None
    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 400, (4, N))
    batch = assemble_prompts(prompts, tokens, np.ones((4, N)), rng.normal(size=4), with_pools=True)
    batch = jax.tree.map(jax.numpy.asarray, batch)
    graphdef, params = nnx.split(model, nnx.Param)
    step = step_config({"tprl.enable_perception_filtering": True, "optim.micro_batches": 2})
    key = jax.random.key(3)
    res = no_grad_passes(graphdef, params, None, batch, key, step)
    black = models.processor(cfg).black
    aug = blacken_patches(batch.videos, jax.random.fold_in(key, 1), step.tprl.black_prob, black)
    want, _ = reference_logp(params, graphdef, batch.replace(videos=aug), step.temperature)
    clean, _ = reference_logp(params, graphdef, batch, step.temperature)
    np.testing.assert_allclose(res.aug_logp, want, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(res.old_logp, clean, atol=2e-5 * np.abs(clean).max())
    assert np.abs(np.asarray(want) - np.asarray(clean)).max() > 1e-3  # the videos matter


def test_a_tprl_run_on_video_rows_trains_and_draws_them(tmp_path):
    """TPRL with VGR token weights and the MDI reward on a JSONL whose rows hold videos as
    frame lists (one also an image): it trains 2 steps with the perturbed pass, scores the
    videos' attention and draws their attention maps (clean and perturbed frames)."""
    pytest.importorskip("matplotlib")
    from jaxvrl.config import load_config
    from jaxvrl.train import run
    from tests.trainer.test_train import ROOT, TINY

    rng = np.random.default_rng(1)
    rows = []
    for i in range(4):
        frames = []
        for j, frame in enumerate(_frames(rng, 4)):
            frame.save(tmp_path / f"v{i}_{j}.png")
            frames.append(f"v{i}_{j}.png")
        row = {"problem": "<video> A or B?", "videos": [frames], "answer": "AB"[i % 2]}
        if i == 1:
            Image.fromarray(rng.integers(0, 255, (56, 56, 3), np.uint8)).save(tmp_path / "i.png")
            row.update(problem="<image> <video> A or B?", images=["i.png"])
        rows.append(row)
    data = tmp_path / "videos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = TINY + [
        f"workdir={tmp_path / 'run'}",
        f"data.train_files={data}",
        f"data.image_dir={tmp_path}",
        "data.max_prompt_length=512",
        "data.video_min_pixels=3136",
        "data.video_max_pixels=6000",
        "total_steps=2",
        "val_before_train=False",
        "vgr.enable_token_weights=True",
        "reward.funcs=('mc_idx', 'think_format', 'mdi')",
        "reward.weights=(4.0, 1.0, 1.0)",
        "logging.attention_samples=1",
    ]
    metrics = run(load_config(os.path.join(ROOT, "configs/tprl.py"), overrides))
    assert np.isfinite(metrics["loss"]) and metrics["train/nonfinite"] == 0
    assert not [k for k in metrics if k.startswith("data/skipped")]  # every row was read
    assert np.isfinite(metrics["attn/mdi"])  # the videos drew attention statistics
    assert metrics["sensitivity_score_mean"] > 0  # the perturbed pass changed the videos
    results = (tmp_path / "run" / "rollout_results.md").read_text()
    assert "<|video_pad|>" in results
    assert list((tmp_path / "run" / "attention").glob("step_*_sample_0.png"))


def test_sizes_agreed_across_processes_pad_the_batch_and_change_no_logit():
    """On a pod each process collates its rows with the widest prompt and the most patches
    of any process (`agree`): a batch collated wider, with more image and video patches per
    row, and with image inputs for rows that have none, gives the same logits."""
    from transformers import AutoTokenizer

    model = models.load(models.EMBEDDED)
    cfg = model.config
    tokenizer = AutoTokenizer.from_pretrained(models.EMBEDDED)
    opts = EncodeOptions(processor=models.processor(cfg), max_prompt_length=1024, **VIDEO_PIXELS)
    examples, _ = encode_rows(_rows(), tokenizer, opts, source="rows")

    def logits(batch):
        vision = {k: jax.tree.map(jax.numpy.asarray, batch[k]) for k in ("images", "videos")}
        ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        return np.asarray(model.forward(ids, mask, pos, **vision).logits)

    seen = []

    def agree(sizes):
        seen.append(dict(sizes))
        return {"width": sizes["width"] + 64, "images": 64, "videos": 2 * sizes["videos"]}

    for rows in (examples, examples[2:3]):  # the second: no image here, some elsewhere
        own = collate(rows, 1, cfg, tokenizer)
        wide = collate(rows, 1, cfg, tokenizer, agree=agree)
        assert seen[-1]["width"] == own["input_ids"].shape[1]
        assert wide["input_ids"].shape[1] == own["input_ids"].shape[1] + 64
        assert wide["images"].pixel_values.shape[1] == 64
        assert wide["videos"].pixel_values.shape[1] == 2 * own["videos"].pixel_values.shape[1]
        for key in ("attention_mask", "pools"):
            got, want = wide[key], own[key]
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(g[:, 64:], w)
                assert not g[:, :64].any()
        width = own["input_ids"].shape[1]
        real = own["attention_mask"] > 0
        got, want = logits(wide)[:, -width:], logits(own)
        np.testing.assert_allclose(got[real], want[real], atol=2e-5 * np.abs(want).max())
