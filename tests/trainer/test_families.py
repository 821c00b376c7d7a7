"""The main job on every vision-language family: a tiny random checkpoint saved by transformers
(over the embedded tokenizer) trains 2 steps of tprl with the perturbed-image pass, VGR token
weights and the MDI reward, resumes for a third, and its export loads in transformers with our
logits; PPO with LoRA or DAPO with QLoRA runs a step (each family one of the two). (That a resumed run equals an
uninterrupted one does not depend on the family: tests/trainer_infra tests it.)"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxvrl import models
from jaxvrl.config import load_config
from jaxvrl.train import run
from tests.trainer.test_train import ROOT, TINY

# the embedded tokenizer's special tokens (its config.json)
IDS = dict(image_token_id=12, video_token_id=13, vision_start_token_id=9, vision_end_token_id=10)
TEXT = dict(
    vocab_size=448,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    eos_token_id=2,
    bos_token_id=None,
)


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **IDS)
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14}
    return Qwen2VLForConditionalGeneration, cfg, processor


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
            "mrope_interleaved": True}  # fmt: skip
    text = dict(TEXT, head_dim=16, rope_parameters=rope)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **IDS)
    mean = [0.5, 0.5, 0.5]
    processor = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
                 "image_mean": mean, "image_std": mean}  # fmt: skip
    return Qwen3VLForConditionalGeneration, cfg, processor


def _qwen3_vl_moe():
    """_qwen3_vl's shapes with every text layer sparse: 4 experts of width 48, top 2."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    _, dense, processor = _qwen3_vl()
    text = dict(dense.text_config.to_dict(), num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=48, decoder_sparse_step=1)  # fmt: skip
    vision = dense.vision_config.to_dict()
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           **IDS)  # fmt: skip
    return Qwen3VLMoeForConditionalGeneration, cfg, processor


FAMILIES = {"qwen2_vl": _qwen2_vl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe}


def _landed(name: str) -> bool:
    try:
        models.family(name)
    except ImportError:
        return False
    return True


def save_family(name: str, path) -> None:
    """A tiny random checkpoint of family `name` in `path`, with the embedded tokenizer's
    files."""
    import torch

    cls, cfg, processor = FAMILIES[name]()
    torch.manual_seed(0)
    cls(cfg).save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(models.EMBEDDED, file), path / file)
    base = json.load(open(os.path.join(models.EMBEDDED, "preprocessor_config.json")))
    with open(path / "preprocessor_config.json", "w") as f:
        json.dump(dict(base, **processor), f)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A tiny random checkpoint of the family, with the embedded tokenizer's files."""
    if not _landed(request.param):
        pytest.skip(f"{request.param} is not registered yet")
    path = tmp_path_factory.mktemp(request.param)
    save_family(request.param, path)
    return request.param, path


def _config(path, workdir, *extra):
    overrides = TINY + [
        f"workdir={workdir}",
        f"model.path={path}",
        "vgr.enable_token_weights=True",
        "vgr.token_weight_last_k_layers=1",
        "reward.funcs=('mc_idx', 'think_format', 'mdi')",
        "reward.weights=(4.0, 1.0, 1.0)",
        "val_before_train=False",
        "val_size=0",
        *extra,
    ]
    return load_config(os.path.join(ROOT, "configs/tprl.py"), overrides)


def test_tprl_with_vgr_and_mdi_runs_resumes_and_exports(checkpoint, tmp_path):
    from transformers import AutoModelForImageTextToText

    from jaxvrl.export import export

    name, path = checkpoint
    workdir = tmp_path / "run"
    first = run(_config(path, workdir, "total_steps=2"))
    metrics = run(_config(path, workdir, "total_steps=3"))  # resumes from step 2
    for m in (first, metrics):
        assert np.isfinite(m["loss"]) and m["train/nonfinite"] == 0
        for key in ("perception_token_fraction", "scaling_factor_mean", "reward/mdi", "attn/mdi"):
            assert key in m, key
        assert np.isfinite(m["attn/mdi"])  # the rows' images drew attention statistics
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the resumed run trained step 3 only

    out = tmp_path / "hf"
    export(str(workdir), str(out))
    assert json.load(open(out / "config.json"))["model_type"] == name
    ours = models.load(out)
    hf = AutoModelForImageTextToText.from_pretrained(out).eval()
    ids = np.array([[5, 9] + [12] * 4 + [10, 30, 31, 32]])
    grid = np.array([[1, 4, 4]])
    patch = models.processor(ours.config).patch_dim
    pixels = np.random.default_rng(0).normal(size=(16, patch)).astype(np.float32)
    got = np.asarray(ours(ids, pixel_values=pixels, image_grid_thw=grid).logits)
    import torch

    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            mm_token_type_ids=torch.tensor((ids == IDS["image_token_id"]).astype(np.int64)),
            pixel_values=torch.tensor(pixels),
            image_grid_thw=torch.tensor(grid),
        ).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max())


LORA_RUNS = {  # each family one of the two (the LoRA code is the families' shared decoder's)
    "qwen2_vl": ("configs/dapo.py", ("lora.rank=4", "lora.alpha=8.0", "lora.quantize=int8")),
    "qwen3_vl": ("configs/ppo.py", ("lora.rank=4", "lora.alpha=8.0")),
    "qwen3_vl_moe": ("configs/dapo.py", ("lora.rank=4", "lora.alpha=8.0", "lora.quantize=int8")),
}


def test_ppo_with_lora_or_dapo_with_qlora_runs(checkpoint, tmp_path):
    family, path = checkpoint
    config, extra = LORA_RUNS[family]
    overrides = TINY + [f"workdir={tmp_path}", f"model.path={path}", "total_steps=1",
                        "val_before_train=False", "val_size=0", *extra]  # fmt: skip
    metrics = run(load_config(os.path.join(ROOT, config), overrides))
    assert np.isfinite(metrics["loss"]) and metrics["train/nonfinite"] == 0
    if family == "qwen3_vl_moe":  # QLoRA stores the experts quantized too
        from jaxvrl.export import StateReader, checkpoint_steps

        directory, steps = checkpoint_steps(str(tmp_path))
        shapes = StateReader(directory, steps[-1]).shapes
        experts = {k: v for k, v in shapes.items() if k.startswith("params/") and "/experts/" in k}
        assert {k.split("/")[-2] for k in experts} == {"qvalue", "scale"}, sorted(experts)
        stored = {dtype for k, (_, dtype) in experts.items() if "/qvalue/" in k}
        assert stored == {np.dtype(np.int8)}


def test_slots_sample_what_the_static_sampler_samples(checkpoint):
    """The refilling slots over a paged cache give the static sampler's completions and
    log-probs (one prefill per prompt, G samples each) on an image prompt and a video prompt;
    so do the slots in accelerators' form (the dense cached attention over pages holding
    their keys by slot) against the CPU form."""
    import dataclasses

    import jax
    from flax import nnx

    from jaxvrl.sampling import Sampler
    from jaxvrl.sampling.sampler import generation_config, row_vision_inputs

    _, path = checkpoint
    model = models.load(path)
    cfg = model.config
    rng = np.random.default_rng(3)
    text = lambda n: rng.integers(20, 400, n).tolist()  # noqa: E731
    v0, v1 = IDS["vision_start_token_id"], IDS["vision_end_token_id"]
    a = text(3) + [v0] + [IDS["image_token_id"]] * 6 + [v1] + text(4)  # grid (1, 4, 6)
    b = text(2) + [v0] + [IDS["video_token_id"]] * 8 + [v1] + text(6)  # grid (2, 4, 4)
    width = max(len(a), len(b)) + 1
    ids = np.array([[0] * (width - len(r)) + r for r in (a, b)])
    mask = (np.arange(width)[None] >= (width - np.array([len(a), len(b)]))[:, None]).astype(int)
    dim = models.processor(cfg).patch_dim
    image, video = np.array([[1, 4, 6]]), np.array([[2, 4, 4]])
    pv = rng.normal(size=(24, dim)).astype(np.float32)
    pvv = rng.normal(size=(32, dim)).astype(np.float32)
    pos, deltas = models.rope_index(cfg, ids, mask, image, video)
    images = row_vision_inputs(pv, image, ids, cfg.image_token_id, cfg)
    videos = row_vision_inputs(pvv, video, ids, cfg.video_token_id, cfg)
    args = [jax.numpy.asarray(x) for x in (ids, mask, pos, deltas)]
    base = generation_config(cfg, max_new_tokens=8, temperature=1.0)
    base = dataclasses.replace(base, eos_token_ids=tuple(range(3, 400, 7)))

    def sample(sampling):
        out = Sampler(nnx.graphdef(model), sampling)(
            nnx.state(model), *args, jax.random.key(5), images=images, videos=videos,
            num_samples=3,
        )  # fmt: skip
        return jax.tree.map(np.asarray, out)

    want = sample(base)
    assert len(set(want.mask.sum(1).tolist())) > 1  # rows end at different lengths
    paged = dict(slots=4, page_size=5)
    for other in (paged, dict(paged, decode_attention="dense")):
        got = sample(dataclasses.replace(base, **other))
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.mask, want.mask)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
