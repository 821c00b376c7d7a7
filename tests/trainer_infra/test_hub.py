"""Models and datasets by Hugging Face Hub name, offline: a hub cache laid out as
huggingface_hub writes it (refs/<revision> holding a commit, snapshots/<commit>/ with the
files, linked to blobs/), HF_HUB_OFFLINE set; and datasets in local directories
(`save_to_disk`, parquet files)."""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jaxvrl import hub
from jaxvrl.data.columns import RowFormat
from jaxvrl.data.loader import make_dataset
from jaxvrl.data.rows import DataError, EncodeOptions
from jaxvrl.data.sources import DataNotFound, open_source, open_sources

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline. huggingface_hub reads its environment when imported, so
    its constants are set too."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache, kind: str, repo: str, files: dict, commit=COMMIT, ref="main") -> str:
    """Lays out `files` ({path in the repo: bytes}) as snapshot `commit` of `repo` (kind:
    model | dataset) in the hub cache, `ref` pointing at it; -> the snapshot directory."""
    folder = cache / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return str(snapshot)


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buf, "PNG")
    return buf.getvalue()


def vqa_rows(n: int, split: str = "train") -> list[dict]:
    """A-OKVQA-like rows: question, choices, correct_choice_idx, image as {bytes, path}."""
    return [
        {
            "question": f"{split} question {i}?",
            "choices": ["red", "green", "blue", "black"],
            "correct_choice_idx": i % 4,
            "image": {"bytes": png((60 * (i % 4), 0, 0)), "path": None},
        }
        for i in range(n)
    ]


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=2)
    return buf.getvalue()


VQA = RowFormat(
    prompt_key="question",
    choices_key="choices",
    answer_key="correct_choice_idx",
    image_key="image",
)


def vqa_dataset(cache) -> dict:
    """org/vqa in the cache in the repository's own layout: train in two shards (3 + 2
    rows), validation in one."""
    train = vqa_rows(5)
    files = {
        "README.md": b"---\n---\n",
        "data/train-00000-of-00002.parquet": parquet_bytes(train[:3]),
        "data/train-00001-of-00002.parquet": parquet_bytes(train[3:]),
        "data/validation-00000-of-00001.parquet": parquet_bytes(vqa_rows(2, "validation")),
    }
    cache_repo(cache, "dataset", "org/vqa", files)
    return {"train": train}


def test_a_hub_dataset_reads_by_name_and_split(hub_cache):
    vqa_dataset(hub_cache)
    src = open_sources(["org/vqa"], fmt=VQA)
    assert len(src) == 5
    row = src[4]
    assert row["problem"] == "train question 4?" and row["answer"] == 0
    assert row["choices"] == ["red", "green", "blue", "black"]
    assert row["images"][0]["bytes"] == png((0, 0, 0))  # the {bytes, path} dict as stored
    assert row["_where"] == (
        f"hf://datasets/org/vqa@{COMMIT[:12]}/data/train-00001-of-00002.parquet row 1"
    )
    train = open_source("org/vqa@train")  # raw rows: the dataset's own columns
    assert [train[i]["question"] for i in range(5)] == [f"train question {i}?" for i in range(5)]
    val = open_source("org/vqa@validation", fmt=VQA)
    assert [val[i]["problem"] for i in range(2)] == [f"validation question {i}?" for i in (0, 1)]
    with pytest.raises(DataError, match="column|key"):  # the column rules apply per shard
        open_source("org/vqa", fmt=RowFormat(prompt_key="no_such_column"))
    with pytest.raises(DataNotFound, match="no parquet files for split 'test'"):
        open_source("org/vqa@test")


def test_a_hub_dataset_in_the_parquet_conversion_layout(hub_cache):
    files = {
        "main/train/0000.parquet": parquet_bytes(vqa_rows(2, "main")),
        "extra/train/0000.parquet": parquet_bytes(vqa_rows(3, "extra")),
        "extra/test/0000.parquet": parquet_bytes(vqa_rows(1, "extra-test")),
    }
    cache_repo(hub_cache, "dataset", "org/conv", files, ref=hub.PARQUET_REVISION)
    assert len(open_source("org/conv:main")) == 2
    src = open_source("org/conv:extra@test")
    assert len(src) == 1 and src[0]["question"] == "extra-test question 0?"
    assert src[0]["_where"] == f"hf://datasets/org/conv@{COMMIT[:12]}/extra/test/0000.parquet row 0"


def test_hub_dataset_shards_per_process_and_resumes_exactly(hub_cache):
    from transformers import AutoTokenizer

    from jaxvrl.data import default_tokenizer_path

    vqa_dataset(hub_cache)
    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    src = open_sources(["org/vqa"], fmt=VQA)
    opts = EncodeOptions(min_pixels=28 * 28, max_pixels=28 * 28 * 4)

    def where(**kw) -> list[str]:
        ds, stats = make_dataset(src, tok, opts, batch_size=1, num_epochs=1, **kw)
        rows = [r["_where"] for b in ds for r in b]
        assert stats.total == 0
        return rows

    shards = [where(shard_index=k, shard_count=2) for k in range(2)]
    assert [len(s) for s in shards] == [3, 2]
    assert sorted(shards[0] + shards[1]) == sorted(where())
    it = iter(make_dataset(src, tok, opts, batch_size=2, seed=5)[0])
    for _ in range(3):  # past the first epoch's end
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expect = [next(it) for _ in range(2)]
    fresh = open_sources(["org/vqa"], fmt=VQA)
    again = iter(make_dataset(fresh, tok, opts, batch_size=2, seed=5)[0])
    again.set_state(state)
    for a, b in zip(expect, [next(again) for _ in range(2)]):
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and x["_where"] == y["_where"]
            np.testing.assert_array_equal(x["pixel_values"], y["pixel_values"])
            assert list(x["prompt_ids"]) == list(y["prompt_ids"])


def test_a_dataset_missing_offline_names_it_in_one_line(hub_cache):
    with pytest.raises(DataNotFound) as e:
        open_source("org/absent@train")
    assert e.value.path == "org/absent@train"
    assert "not found on the Hugging Face Hub and not cached (offline" in e.value.reason
    assert "\n" not in str(e.value)
    with pytest.raises(DataNotFound, match="data/absent.jsonl: data file not found"):
        open_source("data/absent.jsonl")  # a file name is never taken for a Hub name


def saved_to_disk(path, splits: dict[str, list[dict]]) -> None:
    """The layout `datasets.DatasetDict.save_to_disk` writes: dataset_dict.json, one folder
    per split with data-0000i-of-0000n.arrow (IPC stream), dataset_info.json, state.json."""
    path.mkdir()
    (path / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, rows in splits.items():
        d = path / split
        d.mkdir()
        table = pa.Table.from_pylist(rows)
        names = []
        for k, part in enumerate((table.slice(0, 2), table.slice(2))):
            names.append(f"data-{k:05d}-of-00002.arrow")
            with pa.OSFile(str(d / names[-1]), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(part)
        (d / "dataset_info.json").write_text(json.dumps({"features": {}}))
        (d / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": n} for n in names], "_split": split})
        )


def test_local_directories_saved_to_disk_or_holding_parquet(tmp_path):
    saved = tmp_path / "saved"
    saved_to_disk(saved, {"train": vqa_rows(5), "test": vqa_rows(3, "test")})
    src = open_source(str(saved), fmt=VQA)  # the train split by default
    assert len(src) == 5 and src[3]["problem"] == "train question 3?"
    assert src[3]["images"][0]["bytes"] == png((180, 0, 0))
    test = open_source(f"{saved}@test")
    assert [test[i]["question"] for i in range(3)] == [f"test question {i}?" for i in range(3)]
    assert len(open_source(str(saved / "test"))) == 3  # one split's own folder

    files = tmp_path / "files"
    (files / "data").mkdir(parents=True)
    rows = vqa_rows(5)
    (files / "data" / "train-00000-of-00002.parquet").write_bytes(parquet_bytes(rows[:2]))
    (files / "data" / "train-00001-of-00002.parquet").write_bytes(parquet_bytes(rows[2:]))
    (files / "data" / "test-00000-of-00001.parquet").write_bytes(parquet_bytes(vqa_rows(1)))
    (files / "extra.jsonl").write_text(json.dumps({"question": "jsonl row"}) + "\n")
    (files / ".cache").mkdir()  # e.g. `hf download --local-dir` metadata: skipped
    (files / ".cache" / "x.parquet").write_bytes(b"not parquet")
    everything = open_source(str(files))
    assert len(everything) == 5 + 1 + 1
    train = open_source(f"{files}@train", fmt=VQA)
    assert [train[i]["problem"] for i in range(5)] == [f"train question {i}?" for i in range(5)]
    with pytest.raises(DataError, match="no .parquet, .jsonl or .json files for split 'dev'"):
        open_source(f"{files}@dev")


# --- models -------------------------------------------------------------------------------


def tiny_model_files(path, seed: int) -> dict:
    """A tiny random Qwen2.5-VL saved by transformers, with the embedded tokenizer and chat
    template beside it (the files of a model repository)."""
    from jaxvrl.data import default_tokenizer_path
    from tests.models.hf_tiny import build

    build(str(path), seed=seed)
    tok = default_tokenizer_path()
    files = {f: (path / f).read_bytes() for f in os.listdir(path)}
    files.update({f: open(os.path.join(tok, f), "rb").read() for f in os.listdir(tok)})
    return files


def cache_tiny_model(cache, tmp_path) -> None:
    """org/tiny: main at COMMIT, tag v2 at OTHER (other weights)."""
    cache_repo(cache, "model", "org/tiny", tiny_model_files(tmp_path / "main", seed=0))
    files = tiny_model_files(tmp_path / "v2", seed=1)
    cache_repo(cache, "model", "org/tiny", files, commit=OTHER, ref="v2")


def config(tmp_path, *overrides):
    from jaxvrl.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return load_config(
        os.path.join(root, "configs/grpo.py"), [f"workdir={tmp_path / 'run'}", *overrides]
    )


def test_a_hub_model_loads_by_name_and_by_name_at_revision(hub_cache, tmp_path, monkeypatch):
    import jax
    from flax import nnx

    from jaxvrl import train
    from jaxvrl.models.qwen2_5_vl import load

    cache_tiny_model(hub_cache, tmp_path)
    assert hub.fetch_model("org/tiny").commit == COMMIT
    assert hub.fetch_model("org/tiny@v2").commit == OTHER
    assert hub.fetch_model(f"org/tiny@{OTHER}").commit == OTHER  # a commit as the revision

    def params(path):
        return jax.tree.leaves(nnx.state(load(path, scan_layers=False), nnx.Param))

    main, v2 = (params(hub.fetch_model(n).path) for n in ("org/tiny", "org/tiny@v2"))
    assert len(main) == len(v2) and any(
        not np.array_equal(a, b) for a, b in zip(main, v2)
    )  # the revisions' own weights

    c = config(tmp_path, "model.path=org/tiny@v2")
    source = train.model_source(c)
    assert source[1] == OTHER and os.path.basename(source[0]) == OTHER
    model, tokenizer = train.load_model(c, source)  # the run's loader, tokenizer included
    assert tokenizer("a b").input_ids
    assert train.run_info(c, source[1])["model_path"] == "org/tiny@v2"
    assert train.run_info(c, source[1])["model_commit"] == OTHER
    local = tmp_path / "org" / "tiny"  # a local directory of the same name wins
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert train.model_source(config(tmp_path, "model.path=org/tiny")) == ("org/tiny", None)


def test_a_model_missing_offline_ends_the_run_in_one_line(hub_cache, tmp_path, capsys):
    from jaxvrl import train
    from jaxvrl.config import ConfigError

    with pytest.raises(ConfigError) as e:
        train.model_source(config(tmp_path, "model.path=org/absent"))
    assert str(e.value).startswith(
        "config.model.path='org/absent': not found on the Hugging Face Hub and not cached (offline"
    )
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'/no/such/model': no such directory"):
        train.model_source(config(tmp_path, "model.path=/no/such/model"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = ["--config", os.path.join(root, "configs/grpo.py"), f"--config.workdir={tmp_path}"]
    for override, key in [
        ("model.path=org/absent@v1", "model.path='org/absent@v1'"),
        ("data.train_files=org/absent@train", "data.train_files='org/absent@train'"),
    ]:
        with pytest.raises(SystemExit) as stop:
            train.main([*argv, f"--config.{override}"])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: config.{key}: not found"), err


def test_export_reads_the_base_model_by_name_at_the_runs_commit(hub_cache, tmp_path):
    from jaxvrl import export

    cache_tiny_model(hub_cache, tmp_path)
    assert export._base_files("org/tiny", str(tmp_path), OTHER).endswith(OTHER)
    assert export._base_files("org/tiny", str(tmp_path)).endswith(COMMIT)
    (tmp_path / "w").mkdir()
    export.write_run_info(str(tmp_path / "w"), {"model_path": "org/tiny", "model_commit": OTHER})
    assert "model_commit" not in export.read_run_info(str(tmp_path / "w"), "org/other")
    with pytest.raises(export.ExportError, match="base model org/absent: not found"):
        export._base_files("org/absent", str(tmp_path))


def _scalars(workdir) -> dict[int, dict]:
    """metrics.jsonl by step, without the timings (`*_s`: seconds, tokens per second) and the
    compile counts (a run reuses the step program of an earlier run in its process)."""
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    own = lambda k: not k.endswith("_s") and not k.startswith("compiles/")  # noqa: E731
    return {r["step"]: {k: v for k, v in r.items() if own(k)} for r in rows}


@pytest.mark.slow
def test_a_run_with_model_and_data_by_hub_name_resumes_exactly(hub_cache, tmp_path):
    from jaxvrl import train
    from tests.trainer.test_train import _final_params

    emb = train.EMBEDDED  # the embedded checkpoint, as a model repository
    cache_repo(
        hub_cache,
        "model",
        "org/emb",
        {f: open(os.path.join(emb, f), "rb").read() for f in os.listdir(emb)},
    )
    vqa_dataset(hub_cache)

    def hub_config(root, steps: int):
        return config(
            root,
            "model.path=org/emb",
            "data.train_files=org/vqa@train",
            "data.prompt_key=question",
            "data.choices_key=choices",
            "data.answer_key=correct_choice_idx",
            "data.image_key=image",
            "prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_new_tokens=8",
            f"total_steps={steps}",
            "val_freq=100",
            "save_freq=0",
        )

    metrics = train.run(hub_config(tmp_path, 2))
    assert np.isfinite(metrics["loss"]) and metrics["compiles/train_step"] == metrics["compiles/train_step_shapes"]
    resumed = tmp_path / "run"
    info = json.loads((resumed / "run.json").read_text())
    assert info["model_path"] == "org/emb" and info["model_commit"] == COMMIT

    # resumed from its step-2 checkpoint (the model and the data found by name again; the
    # third batch of 2 prompts reaches the second epoch of 5 rows) == an uninterrupted 3-step
    # run: the same state (parameters, optimizer, RNG) and the same metrics rows
    train.run(hub_config(tmp_path, 3))
    train.run(hub_config(tmp_path / "whole", 3))
    whole = tmp_path / "whole" / "run"
    (sa, pa), (sb, pb) = _final_params(whole), _final_params(resumed)
    assert sa == sb == 3 and pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    a, b = _scalars(whole), _scalars(resumed)
    assert sorted(a) == sorted(b) and {1, 2, 3} <= set(a)  # no step repeated or missing
    assert np.isfinite(a[3]["loss"]) and "reward/total" in a[3] and "tokens_per_s" not in a[3]
    for step in a:
        assert a[step] == b[step], step
