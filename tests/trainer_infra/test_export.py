"""python -m jaxvrl.export: a tiny trained run becomes an HF directory that transformers loads
with the trained logits; LoRA merged, QLoRA dequantized, bfloat16, shards and index, errors,
a gs:// workdir against a loopback GCS emulator, and --push_to_hub against a fake Hub client."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxvrl import export as E
from jaxvrl.checkpoint import Checkpointer
from jaxvrl.models import lora, weights
from jaxvrl.models import qwen2_5_vl as q
from jaxvrl.train import EMBEDDED, run
from tests.trainer.test_train import tiny_config
from tests.trainer_infra.workers import needs_gcs, run_worker

LORA = ("lora.rank=4", "lora.alpha=8.0", "lora.target_modules=('q_proj', 'v_proj', 'up_proj')")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny 2-step runs on the embedded model: full fine-tuning and LoRA."""
    out = {}
    for name, extra in (("full", ()), ("lora", LORA)):
        workdir = tmp_path_factory.mktemp(name)
        steps = ("total_steps=2", "val_before_train=False", "val_size=0")  # no validation
        run(tiny_config("configs/grpo.py", workdir, *steps, *extra))
        out[name] = str(workdir)
    return out


def _weights(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _trained_params(workdir) -> dict[str, np.ndarray]:
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    arrays = ck.manager.restore(ck.latest_step())["state"]
    ck.close()
    return {k: np.asarray(v) for k, v in arrays.items() if k.startswith("params/")}


def _set_params(model, arrays) -> None:
    """Puts checkpoint arrays (`params/<path>/value`) onto the model's Params."""
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        var.set_value(arrays["params/" + "/".join(map(str, path)) + "/value"])
    nnx.update(model, state)


def _processor(path):
    """transformers' Qwen2.5-VL processor from the exported files. Its video processor needs
    torchvision, which cannot be installed beside the pinned CPU torch: without it the
    processor is assembled from the exported tokenizer and image processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2_5_VLProcessor

    if importlib.util.find_spec("torchvision"):
        return AutoProcessor.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        def __init__(self):  # ProcessorMixin.__init__ insists on a video processor
            self.image_processor, self.video_processor = image_processor, None
            self.tokenizer, self.chat_template = tokenizer, tokenizer.chat_template
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    return ImageTextProcessor()


def _image_prompt(processor):
    """-> (the processor's inputs for one image prompt, the image)."""
    from PIL import Image

    pixels = np.full((84, 112, 3), 240, np.uint8)
    pixels[20:60, 30:80] = (30, 60, 200)  # a blue box on a light background
    img = Image.fromarray(pixels)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What colour is the shape in the image?"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[img], return_tensors="np"), img


def test_export_loads_in_transformers_with_the_trained_logits(runs, tmp_path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from jaxvrl.data.processor import process_images
    from jaxvrl.data.rows import EncodeOptions

    out = tmp_path / "hf"
    r = E.export(runs["full"], str(out), max_shard_bytes=1_000_000)  # shards and an index
    assert r.step == 2 and r.dtype == "float32" and r.merged_adapters == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).exists(), name

    # the exported weights are the trained ones, and training moved them off the base
    model = q.load(EMBEDDED)
    _set_params(model, _trained_params(runs["full"]))
    exported, base = _weights(out), _weights(EMBEDDED)
    assert exported.keys() == base.keys() == set(index["weight_map"])
    _, state = nnx.split(model, nnx.Param)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    # scanned layers: HF tensor model.layers.{i}... is index i of the stacked param
    for layer, path, i, _ in weights.per_layer((p, x.shape) for p, x in flat.items()):
        x = flat[path] if i is None else flat[path][i]
        name, want = weights.hf_tensor(layer, x, model.config, q.KEYS)
        np.testing.assert_array_equal(exported[name], want, err_msg=name)
    assert sum(not np.array_equal(exported[k], base[k]) for k in base) > len(base) // 2

    # transformers' processor from the export prepares the image as training did
    processor = _processor(out)
    inputs, img = _image_prompt(processor)
    ids, pv, grid = inputs["input_ids"], inputs["pixel_values"], inputs["image_grid_thw"]
    opts = EncodeOptions()
    ours_pv, ours_grid = process_images([img], opts.min_pixels, opts.max_pixels)
    np.testing.assert_array_equal(grid, ours_grid)
    np.testing.assert_allclose(pv, ours_pv, atol=1e-5)

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()
    ours = np.asarray(model(ids, pixel_values=pv, image_grid_thw=grid).logits)
    scale = np.abs(ref).max()
    assert ours.shape == ref.shape and scale > 0.5
    assert np.abs(ours - ref).max() <= 1e-3 * scale


def test_lora_run_exports_the_merged_weights(runs, tmp_path):
    info = json.loads(open(os.path.join(runs["lora"], "run.json")).read())
    assert info["model_path"] is None and info["lora"]["rank"] == 4 and info["lora"]["alpha"] == 8
    r = E.export(runs["lora"], str(tmp_path / "hf"))
    assert r.merged_adapters == 3 * 4  # q, v, up in each of the 4 decoder layers

    model = q.load(EMBEDDED)
    lora.apply_lora(model, 4, 8.0, 0.0, ("q_proj", "v_proj", "up_proj"))
    _set_params(model, _trained_params(runs["lora"]))
    q.save(lora.merge_lora(model), tmp_path / "merged")
    exported, merged, base = (_weights(p) for p in (tmp_path / "hf", tmp_path / "merged", EMBEDDED))
    assert exported.keys() == merged.keys()
    for k in merged:
        np.testing.assert_array_equal(exported[k], merged[k], err_msg=k)
    changed = {k for k in base if not np.array_equal(exported[k], base[k])}
    assert changed == {
        k
        for k in base
        if k.startswith("model.layers.")  # the text decoder's; the vision tower is frozen
        and k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight"))
    }


def test_qlora_checkpoint_exports_dequantized_merged_weights(tmp_path):
    pytest.importorskip("qwix")
    model = q.load(EMBEDDED)
    lora.apply_lora(model, 4, 8.0, 0.0, ("q_proj",), quantize="int8", quant_tile=64)
    for m in lora.lora_modules(model):  # B = 0 would leave nothing to merge
        m.lora_b[...] = np.random.default_rng(0).normal(0, 0.1, m.lora_b.shape).astype(np.float32)
    _, params = nnx.split(model, nnx.Param)
    ck = Checkpointer(str(tmp_path / "run" / "checkpoints"))
    ck.save(3, {"state": {"params": params, "opt_state": {"mu": params}}}, force=True)
    ck.close()
    E.write_run_info(
        str(tmp_path / "run"),
        {
            "model_path": EMBEDDED,
            "param_dtype": "float32",
            "lora": {"alpha": 8.0, "quantize": "int8"},
        },
    )
    r = E.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert r.step == 3 and r.merged_adapters == 4
    q.save(lora.merge_lora(model), tmp_path / "merged")
    exported, merged = _weights(tmp_path / "hf"), _weights(tmp_path / "merged")
    assert exported.keys() == merged.keys()
    for k in merged:
        np.testing.assert_array_equal(exported[k], merged[k], err_msg=k)


def _checkpoint(workdir, model, info: dict, cast=None) -> None:
    """A run's workdir holding `model`'s params (cast by `cast`) at step 1 and run.json `info`."""
    _, params = nnx.split(model, nnx.Param)
    if cast is not None:
        params = jax.tree.map(cast, params)
    ck = Checkpointer(str(workdir / "checkpoints"))
    ck.save(1, {"state": {"params": params}}, force=True)
    ck.close()
    E.write_run_info(str(workdir), info)


def test_a_bfloat16_lora_run_exports_its_adapters_in_float32(tmp_path):
    """Adapters of a bfloat16 run merged in float32 for a float32 export: updates below
    bfloat16's resolution of the base kernel are kept. Before, the merge was rounded to the
    base's bfloat16 first."""
    model = q.load(EMBEDDED)
    lora.apply_lora(model, 4, 8.0, 0.0, ("q_proj",))
    rng = np.random.default_rng(0)
    for m in lora.lora_modules(model):  # updates ~1e-4, below bfloat16's step at |W| ~ 0.05
        m.lora_b[...] = rng.normal(0, 1e-4, m.lora_b.shape).astype(np.float32)
    bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: bf16(x).astype(jnp.float32), state))
    info = {"model_path": EMBEDDED, "param_dtype": "bfloat16", "lora": {"alpha": 8.0}}
    _checkpoint(tmp_path / "run", model, info, cast=bf16)
    E.export(str(tmp_path / "run"), str(tmp_path / "hf"), dtype="float32")
    q.save(lora.merge_lora(model), tmp_path / "merged")  # float32 values of the run's bfloat16
    exported, merged = _weights(tmp_path / "hf"), _weights(tmp_path / "merged")
    for k in merged:
        np.testing.assert_array_equal(exported[k], merged[k], err_msg=k)


def test_a_base_that_ties_its_head_in_config_but_stores_one_exports_it_untied(tmp_path):
    """config.json ties the head while the files store their own lm_head.weight: the loader
    keeps the stored head (as transformers does), the run trains it, and the export writes it
    with tie_word_embeddings false. Before, the export refused the checkpoint."""
    import shutil

    from safetensors.numpy import save_file

    base = tmp_path / "base"
    shutil.copytree(EMBEDDED, base)
    tensors = load_file(base / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    head = embed + np.random.default_rng(1).normal(0, 0.02, embed.shape).astype(embed.dtype)
    save_file(dict(tensors, **{"lm_head.weight": head}), base / "model.safetensors")
    model = q.load(base)
    assert not model.config.tie_word_embeddings
    _checkpoint(tmp_path / "run", model, {"model_path": str(base), "param_dtype": "float32"})
    E.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    out = _weights(tmp_path / "hf")
    np.testing.assert_array_equal(out["lm_head.weight"], head)
    np.testing.assert_array_equal(out["model.embed_tokens.weight"], embed)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["tie_word_embeddings"] is False
    assert hf.get("text_config", {}).get("tie_word_embeddings", False) is False


def test_bfloat16_export_halves_the_size(runs, tmp_path):
    import ml_dtypes
    from transformers import Qwen2_5_VLConfig

    E.export(runs["full"], str(tmp_path / "f32"))
    r = E.export(runs["full"], str(tmp_path / "bf16"), dtype="bfloat16")
    size32 = os.path.getsize(tmp_path / "f32" / "model.safetensors")
    size16 = os.path.getsize(tmp_path / "bf16" / "model.safetensors")
    assert r.weight_bytes * 2 == E.export(runs["full"], str(tmp_path / "again")).weight_bytes
    assert abs(size16 - size32 / 2) < 0.01 * size32
    w32, w16 = _weights(tmp_path / "f32"), _weights(tmp_path / "bf16")
    for k in w32:
        assert w16[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(w16[k], w32[k].astype(ml_dtypes.bfloat16), err_msg=k)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert str(Qwen2_5_VLConfig.from_pretrained(tmp_path / "bf16").dtype).endswith("bfloat16")


def test_errors_name_what_is_wrong(runs, tmp_path, capsys):
    with pytest.raises(E.ExportError, match=r"no checkpoint in .*empty.*checkpoints"):
        E.export(str(tmp_path / "empty"), str(tmp_path / "out"))
    assert not (tmp_path / "empty").exists()  # looking created nothing
    with pytest.raises(E.ExportError, match=r"no checkpoint for step 7 .*saved steps: 2"):
        E.export(runs["full"], str(tmp_path / "out"), step=7)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(
        E.ExportError, match=r"busy is not empty \(1 entries: notes.txt\).*--overwrite"
    ):
        E.export(runs["full"], str(tmp_path / "busy"))
    # --overwrite: the old shards go, other files stay
    E.export(runs["full"], str(tmp_path / "busy"), overwrite=True, max_shard_bytes=1_000_000)
    E.export(runs["full"], str(tmp_path / "busy"), overwrite=True)
    names = sorted(p.name for p in (tmp_path / "busy").iterdir())
    assert "notes.txt" in names and "model.safetensors" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]

    # a run without run.json (from before it was written) needs the base model named
    import shutil

    old = tmp_path / "old"
    shutil.copytree(os.path.join(runs["full"], "checkpoints"), old / "checkpoints")
    with pytest.raises(E.ExportError, match=r"run.json not found.*--base_model"):
        E.export(str(old), str(tmp_path / "old_hf"))
    r = E.export(str(old), str(tmp_path / "old_hf"), base_model=EMBEDDED)
    assert r.dtype == "float32" and (tmp_path / "old_hf" / "model.safetensors").exists()

    # a step whose array metadata is gone: named, not an AttributeError from orbax's None
    (old / "checkpoints" / "2" / "state" / "_METADATA").unlink()
    with pytest.raises(E.ExportError, match=r"array metadata at .*2/state/_METADATA \(1 attempt\)"):
        E.export(str(old), str(tmp_path / "old_hf2"), base_model=EMBEDDED)

    # the command line: exit status 2 and the message
    with pytest.raises(SystemExit) as e:
        E.main(["--workdir", runs["full"], "--step", "5", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "saved steps: 2" in capsys.readouterr().err
    E.main(["--workdir", runs["full"], "--out", str(tmp_path / "cli"), "--dtype", "bfloat16"])
    assert "exported step 2" in capsys.readouterr().out
    assert E.parse_size("5GB") == 5 * 10**9 and E.parse_size("2MiB") == 2 * 2**20


class FakeHfApi:
    """huggingface_hub.HfApi without a network: records create_repo and upload_folder calls
    and the files the upload would send (the folder's, filtered by allow_patterns, with their
    bytes as they are when uploaded); `fail` raises from create_repo."""

    calls: list = []
    fail: Exception | None = None

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        if self.fail is not None:
            raise self.fail
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, **kw):
        import fnmatch

        names = sorted(os.listdir(folder_path))
        if allow_patterns is not None:
            names = [n for n in names if any(fnmatch.fnmatch(n, p) for p in allow_patterns)]
        files = {n: open(os.path.join(folder_path, n), "rb").read() for n in names}
        self.calls.append(("upload_folder", repo_id, {**kw, "files": files}))
        return type("CommitInfo", (), {"commit_url": f"https://hf.co/{repo_id}/commit/abc123"})


def test_push_to_hub_uploads_the_export_and_a_failed_push_keeps_it(
    runs, tmp_path, monkeypatch, capsys
):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(FakeHfApi, "calls", [])
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine, not the export's")  # kept, not pushed
    argv = ["--workdir", runs["full"], "--out", str(out), "--overwrite", "--dtype", "bfloat16"]
    E.main([*argv, "--push_to_hub", "org/tiny-grpo", "--private"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == "pushed to org/tiny-grpo: https://hf.co/org/tiny-grpo/commit/abc123"
    (create, repo, kw), (upload, repo2, up) = FakeHfApi.calls
    assert (create, repo, upload, repo2) == ("create_repo", "org/tiny-grpo", "upload_folder", repo)
    assert kw == {"private": True, "exist_ok": True, "repo_type": "model"}
    assert up["repo_type"] == "model" and "step 2" in up["commit_message"]
    assert "model-*-of-*.safetensors" in up["delete_patterns"]  # an earlier push's shards go
    exported = sorted(p.name for p in out.iterdir() if p.name != "notes.txt")
    assert sorted(up["files"]) == exported and "model.safetensors" in exported
    for name, data in up["files"].items():
        assert data == (out / name).read_bytes(), name

    # a push that fails (here: no network): one line, exit status 2, the export left in place
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fail = ConnectionError("Failed to resolve 'huggingface.co'\n(Caused by NameResolutionError)")
    monkeypatch.setattr(FakeHfApi, "fail", fail)
    with pytest.raises(SystemExit) as e:
        E.main([*argv, "--push_to_hub", "org/tiny-grpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (
        "error: --push_to_hub org/tiny-grpo: creating the repository failed: ConnectionError: "
        f"Failed to resolve 'huggingface.co'; the export is at {out}"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    # the real client without a network (offline mode): the same one line
    from huggingface_hub import constants

    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as e:
        E.main([*argv, "--push_to_hub", "org/tiny-grpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --push_to_hub org/tiny-grpo: creating the repository failed:")
    assert err[0].endswith(f"; the export is at {out}") and "offline" in err[0].lower()
    assert sorted(p.name for p in out.iterdir()) == sorted(before)

    # a name that is no repository id is refused before anything is exported
    with pytest.raises(SystemExit) as e:
        E.main(["--workdir", runs["full"], "--out", str(tmp_path / "none"), "--push_to_hub", "x"])
    assert e.value.code == 2 and "expected a repository id org/name" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_a_remote_export_is_pushed_from_a_local_copy(monkeypatch):
    import fsspec
    import huggingface_hub

    from jaxvrl import hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(FakeHfApi, "calls", [])
    fs = fsspec.filesystem("memory")
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    for name, data in files.items():
        fs.pipe(f"/pushed/{name}", data)
    fs.pipe("/pushed/notes.txt", b"not the export's")
    r = E.Exported(4, "memory://pushed", sorted(files), 7, "bfloat16", 0)
    assert E.push(r, "org/remote").endswith("/org/remote/commit/abc123")
    assert FakeHfApi.calls[1][2]["files"] == files
    r.files.append("absent.json")  # a copy that fails is a failed push too, in one line
    with pytest.raises(hub.PushFailed, match=r"^copying memory://pushed to a local directory"):
        E.push(r, "org/remote")
    fs.rm("/pushed", recursive=True)


def test_a_failed_remote_metadata_read_is_tried_again(monkeypatch):
    # a read that fails (a transient error, or a stale cached listing) is retried with backoff
    # and the filesystems' cached listings dropped; the last failure is named
    calls, sleeps, forgets = [], [], []

    class Handler:
        def metadata(self, path):
            calls.append(path)
            if len(calls) < 3:
                raise FileNotFoundError(f"{path}/_METADATA")
            return {"params/w": "meta"}

    def read(path):
        return lambda: Handler().metadata(path)

    monkeypatch.setattr(E.time, "sleep", sleeps.append)
    monkeypatch.setattr(E, "forget_listings", lambda: forgets.append(1))
    path = "gs://b/run/checkpoints/2/state"
    assert E._tree_metadata(read(path), path, 4) == {"params/w": "meta"}
    assert len(calls) == 3 and sleeps == [1, 2] and len(forgets) == 2
    calls.clear()
    with pytest.raises(E.ExportError, match=r"gs://b/s/_METADATA \(2 attempts\): FileNotFound"):
        E._tree_metadata(read("gs://b/s"), "gs://b/s", 2)


def test_policy_sources_map_lora_and_qlora_keys():
    keys = [
        "params/model/norm/weight/value",
        "params/model/layers/0/self_attn/q_proj/base/kernel/value",
        "params/model/layers/0/self_attn/q_proj/base/bias/value",
        "params/model/layers/0/self_attn/q_proj/lora_a/value",
        "params/model/layers/0/self_attn/q_proj/lora_b/value",
        "params/model/layers/0/self_attn/v_proj/base/qvalue/value",
        "params/model/layers/0/self_attn/v_proj/base/scale/value",
        "params/model/layers/0/self_attn/v_proj/lora_a/value",
        "params/model/layers/0/self_attn/v_proj/lora_b/value",
        "params/model/layers/0/self_attn/k_proj/qvalue/value",
        "params/model/layers/0/self_attn/k_proj/scale/value",
        "params/model/layers/0/self_attn/k_proj/zero_point/value",
        "opt_state/1/0/mu/model/norm/weight/value",
        "critic_params/head/kernel/value",
    ]
    s = E.policy_sources(keys)
    p = "params/model/layers/0/self_attn/"
    assert s == {
        "model.norm.weight": E.Stored("params/model/norm/weight/value"),
        "model.layers.0.self_attn.q_proj.kernel": E.Merged(
            E.Stored(p + "q_proj/base/kernel/value"),
            p + "q_proj/lora_a/value",
            p + "q_proj/lora_b/value",
        ),
        "model.layers.0.self_attn.q_proj.bias": E.Stored(p + "q_proj/base/bias/value"),
        "model.layers.0.self_attn.v_proj.kernel": E.Merged(
            E.Dequantized(p + "v_proj/base/qvalue/value", p + "v_proj/base/scale/value", None),
            p + "v_proj/lora_a/value",
            p + "v_proj/lora_b/value",
        ),
        "model.layers.0.self_attn.k_proj.kernel": E.Dequantized(
            p + "k_proj/qvalue/value", p + "k_proj/scale/value", p + "k_proj/zero_point/value"
        ),
    }


@needs_gcs
def test_export_from_a_gs_workdir(runs, tmp_path):
    local = tmp_path / "local"
    E.export(runs["full"], str(local))
    res = run_worker("gcs_export_worker.py", runs["full"], str(tmp_path))
    assert res["kept"] == [True] * 4  # uploads ending in "\r", "\n\r", "\n", "\r\n"
    assert res["missing_run_error"] and "gs://jaxvrl-test/runs/none" in res["missing_run_error"]
    remote = tmp_path / "downloaded"
    assert sorted(res["files"]) == sorted(p.name for p in local.iterdir())
    for name in res["files"]:
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name


@pytest.mark.parametrize("nl", [b"\n", b"\r\n"])
def test_the_emulators_uploads_keep_every_byte(nl):
    """A multipart upload's content is the bytes between the line breaks around it, in the
    body's own style (gcsfs writes "\n", RFC 2046 "\r\n"), whatever its last bytes."""
    from tests.trainer_infra.gcs_emulator import _multipart_related

    for content in (b"ab\r", b"ab\n\r", b"ab\n", b"ab\r\n", b"", b"\r"):
        body = nl.join([b"--==0==", b"Content-Type: application/json", b"", b'{"name": "x"}',
                        b"--==0==", b"Content-Type: image/png", b"", content, b"--==0==--"])  # fmt: skip
        got = _multipart_related(body, 'multipart/related; boundary="==0=="')
        assert got == {"meta": {"name": "x"}, "content": content, "content-type": "image/png"}
