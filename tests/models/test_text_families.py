"""Float32 parity of the text-only families (Llama, Qwen2, Qwen3, Mistral with a sliding
window shorter than the rows) against transformers on tiny random checkpoints: logits of
left-padded batches (GQA and MHA, tied and untied heads, each of Llama's rope scalings),
greedy tokens of HF `generate`, sampled log-probs against a teacher-forced pass (and the
paged slots), export that transformers loads to the same logits, scanned against unrolled
layers, and a family added as one table entry."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxvrl import models as M
from jaxvrl.config import ConfigError
from jaxvrl.models import text
from jaxvrl.sampling import Sampler, generate
from jaxvrl.sampling.sampler import generation_config
from tests.models import hf_tiny_text as T
from tests.models.export_check import export_equals_checkpoint
from tests.models.test_qwen2_5_vl_parity import assert_close

# (model_type, rope, kv heads of 4, tied head): every family with GQA and MHA, tied and
# untied; every rope scaling of Llama
CASES = [
    ("llama", "default", 2, False),
    ("llama", "linear", 4, True),
    ("llama", "dynamic", 2, False),
    ("llama", "llama3", 2, True),
    ("qwen2", "default", 2, True),
    ("qwen2", "default", 4, False),
    ("qwen3", "default", 2, False),
    ("qwen3", "default", 4, True),
    ("mistral", "default", 2, False),
    ("qwen3", "yarn", 2, False),
]
_IDS = [f"{m}-{r}-kv{kv}-{'tied' if tie else 'untied'}" for m, r, kv, tie in CASES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (HF model, our model, path), built on first use."""
    made = {}

    def get(case):
        if case not in made:
            model_type, rope, kv, tie = case
            path = tmp_path_factory.mktemp(f"{model_type}_{rope}")
            seed = len(made)
            hf = T.build(path, model_type, seed=seed, kv_heads=kv, rope=rope, tie=tie)
            made[case] = (hf, M.load(path), path)
        return made[case]

    return get


def hf_logits(hf, ids, mask):
    """HF logits float32[B, T, V] at the positions our rope index gives (cumsum(mask) - 1, as
    HF's generate places them); a dynamic rope starts from its original frequencies."""
    pos, _ = text.rope_index(ids, mask)
    with torch.no_grad():
        if hf.config.rope_parameters["rope_type"] == "dynamic":  # reset its cached length
            hf(input_ids=torch.tensor(ids[:, :1]))
        out = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.numpy()


@nnx.jit
def _forward(model, ids, mask, pos):
    return model.forward(ids, mask, pos)


def ours(model, ids, mask):
    pos, _ = M.rope_index(model.config, ids, mask)
    return _forward(model, ids, mask, pos)


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_logits_and_config(checkpoints, case):
    """Logits of a left-padded batch; the config, read back from its HF dictionary."""
    hf, model, path = checkpoints(case)
    model_type, rope, kv, tie = case
    cfg = model.config
    assert type(model) is M.Model
    assert (cfg.text.rope_type, cfg.text.num_key_value_heads, cfg.tie_word_embeddings) == (
        rope,
        kv,
        tie,
    )
    assert (cfg.text.attention_bias, cfg.text.qk_norm) == (
        model_type == "qwen2",
        model_type == "qwen3",
    )
    assert cfg.text.head_dim == (16 if model_type == "qwen3" else 8)
    assert cfg.text.sliding_window == (T.SLIDING_WINDOW if model_type == "mistral" else 0)
    assert M.load_config(path) == cfg and type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
    assert hasattr(model, "lm_head") != tie and model.visual is None
    ids, mask = T.prompts(seed=1)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)


def test_a_tied_config_with_a_stored_head_of_its_own_keeps_that_head(checkpoints, tmp_path):
    """config.json ties the head, yet the checkpoint stores an lm_head.weight unlike the
    embeddings (a fine-tune exported untied, its config stale): transformers keeps the stored
    head, and so does the loader."""
    import shutil

    from transformers import AutoModelForCausalLM

    _, _, path = checkpoints(CASES[5])  # qwen2, untied
    shutil.copytree(path, tmp_path / "stale")
    d = json.loads((tmp_path / "stale" / "config.json").read_text())
    (tmp_path / "stale" / "config.json").write_text(json.dumps({**d, "tie_word_embeddings": True}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "stale").eval()
    model = M.load(tmp_path / "stale")
    assert hasattr(model, "lm_head") and not model.config.tie_word_embeddings
    ids, mask = T.prompts(seed=1)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)


@pytest.mark.parametrize(
    "case", [CASES[1], CASES[2], CASES[5], CASES[6], CASES[9]], ids=_IDS[1:3] + _IDS[5:7] + _IDS[9:]
)
def test_export_loads_in_transformers(checkpoints, case, tmp_path):
    """The export's tensors are the checkpoint's, and transformers computes the same logits
    from it (tied and untied heads, a scaled rotary's parameters written back)."""
    from transformers import AutoModelForCausalLM

    hf, model, path = checkpoints(case)
    export_equals_checkpoint(model, path, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    assert back.config.rope_parameters == hf.config.rope_parameters
    ids, mask = T.prompts(seed=1)
    np.testing.assert_array_equal(hf_logits(back, ids, mask), hf_logits(hf, ids, mask))


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "default"], ids=lambda c: c[1])
def test_rope_scaling_changes_the_logits(checkpoints, case):
    """The scaled rotary is exercised: the same weights with the default rotary give other
    logits (the prompts run past the original length of 8 positions)."""
    _, model, _ = checkpoints(case)
    cfg = model.config
    plain = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, rope_type="default"))
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: type(model)(plain))), nnx.state(model))
    ids, mask = T.prompts(seed=1)
    a, b = ours(model, ids, mask).logits, ours(other, ids, mask).logits
    assert np.abs(np.asarray(a) - np.asarray(b))[mask > 0].max() > 3e-3 * np.abs(a).max()


def test_the_sliding_window_changes_the_logits(checkpoints):
    """Mistral's window is exercised: without it the same weights give other logits (rows of
    up to 11 tokens, a window of 4), and a null sliding_window (later Mistral checkpoints)
    is no window."""
    _, model, _ = checkpoints(CASES[8])
    cfg = model.config
    whole = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, sliding_window=0))
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: M.Model(whole))), nnx.state(model))
    ids, mask = T.prompts(seed=1)
    a, b = ours(model, ids, mask).logits, ours(other, ids, mask).logits
    assert np.abs(np.asarray(a) - np.asarray(b))[mask > 0].max() > 3e-3 * np.abs(a).max()
    d = cfg.to_hf_dict() | {"sliding_window": None}
    assert M.config_from_hf(d).text.sliding_window == 0


def test_a_family_is_one_table_entry(monkeypatch, tmp_path):
    """A text family the package does not know, added as one entry of the table: a Qwen2
    checkpoint under another model_type loads with its logits (biases on q, k, v) and
    exports under its own names."""
    monkeypatch.setitem(
        text.TEXT_FAMILIES,
        "throwaway",
        text.TextFamily("throwaway", "ThrowawayForCausalLM", bias=(True, False)),
    )
    hf = T.build(tmp_path, "qwen2", seed=5)
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    d.update(model_type="throwaway", architectures=["ThrowawayForCausalLM"])
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    model = M.load(tmp_path)
    assert model.config.model_type == "throwaway" and model.config.text.attention_bias
    ids, mask = T.prompts(seed=1)
    assert_close(ours(model, ids, mask).logits, hf_logits(hf, ids, mask), mask)
    assert model.config.to_hf_dict()["architectures"] == ["ThrowawayForCausalLM"]


@pytest.mark.parametrize(
    "case",
    [CASES[2], CASES[4], CASES[7], CASES[8], CASES[9]],
    ids=["llama-dynamic", "qwen2", "qwen3", "mistral", "qwen3-yarn"],
)
def test_greedy_tokens_match_hf_generate(checkpoints, case):
    """The sampler's prefill and decode steps (a dynamic rope takes each step's length, as
    HF's generate does)."""
    hf, model, _ = checkpoints(case)
    ids, mask = T.prompts(seed=2)
    out = generate(model, ids, mask, max_new_tokens=6, temperature=0.0)
    with torch.no_grad():
        hf(input_ids=torch.tensor(ids[:, :1]))  # a dynamic rope's cached length reset
    np.testing.assert_array_equal(np.asarray(out.tokens), T.hf_greedy(hf, ids, mask, 6))


@pytest.mark.parametrize("case", [CASES[6], CASES[8]], ids=["qwen3", "mistral"])
def test_sampled_logprobs_match_teacher_forcing_and_slots(checkpoints, case):
    """Tokens sampled at temperature 1, G = 3 per prompt (one prefill each): their log-probs
    equal those of HF's teacher-forced pass over prompt and completion, and the refilling
    slots over a paged cache (pages with gaps: the window counts positions, not slots)
    sample the same tokens and log-probs."""
    hf, model, _ = checkpoints(case)
    sampled_logprobs_match_teacher_forcing_and_slots(hf, model)


def sampled_logprobs_match_teacher_forcing_and_slots(hf, model):
    """The check above for HF model `hf` and our `model` of the same checkpoint."""
    ids, mask = T.prompts(seed=3)
    pos, deltas = M.rope_index(model.config, ids, mask)
    base = generation_config(model.config, max_new_tokens=6, temperature=1.0)
    base = dataclasses.replace(base, eos_token_ids=tuple(range(4, T.VOCAB, 9)))

    def sample(sampling):
        out = Sampler(nnx.graphdef(model), sampling)(
            nnx.state(model), ids, mask, pos, deltas, jax.random.key(3), num_samples=3
        )
        return jax.tree.map(np.asarray, out)

    out = sample(base)
    tokens, keep = out.tokens, out.mask > 0
    assert len(set(keep.sum(1).tolist())) > 1  # rows end at different lengths
    rows, rows_mask = np.repeat(ids, 3, axis=0), np.repeat(mask, 3, axis=0)
    full = np.concatenate([rows, tokens], axis=1)
    full_mask = np.concatenate([rows_mask, keep.astype(mask.dtype)], axis=1)
    logits = hf_logits(hf, full, full_mask)[:, ids.shape[1] - 1 : -1]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs[keep], want[keep], atol=2e-4)
    slots = sample(dataclasses.replace(base, slots=4, page_size=5))
    np.testing.assert_array_equal(slots.tokens, tokens)
    np.testing.assert_array_equal(slots.mask, out.mask)
    np.testing.assert_allclose(slots.logprobs, out.logprobs, atol=1e-5)


def test_scanned_and_unrolled_layers_agree(checkpoints):
    _, scanned, path = checkpoints(CASES[6])
    unrolled = M.load(path, scan_layers=False)
    assert scanned.model.layers.mlp.up_proj.kernel.shape[0] == 2
    ids, mask = T.prompts(seed=4)
    a, b = ours(scanned, ids, mask).logits, ours(unrolled, ids, mask).logits
    scale = np.abs(b).max()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def test_key_masses_of_a_diagnostic_pass(checkpoints):
    """forward(key_queries=): per layer, each key's attention mass summed over the queries;
    a valid query's probabilities sum to 1 over its keys."""
    _, model, _ = checkpoints(CASES[6])
    ids, mask = T.prompts(seed=5)
    pos, _ = M.rope_index(model.config, ids, mask)
    queries = (mask > 0) & (np.arange(ids.shape[1]) >= ids.shape[1] - 2)
    out = model.forward(ids, mask, pos, key_queries=queries, return_logits=False)
    masses = np.asarray(out.vision_mass)
    assert masses.shape == (2, *ids.shape) and out.text_mass is None
    np.testing.assert_allclose(masses.sum(-1), np.broadcast_to(queries.sum(-1), (2, 3)), rtol=1e-5)


def test_rope_index_and_generation_config(checkpoints):
    _, model, _ = checkpoints(CASES[0])
    ids, mask = T.prompts(lengths=(3, 5))
    pos, deltas = M.rope_index(model.config, ids, mask)
    want = [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert pos.dtype == np.int32 and pos.shape == (2, 5)
    np.testing.assert_array_equal(pos, np.broadcast_to(want, pos.shape))
    np.testing.assert_array_equal(deltas, [0, 0])
    cfg = generation_config(model.config, max_new_tokens=2, temperature=0.0)
    assert cfg.suppress_token_ids == ()
    with pytest.raises(ValueError, match="no images"):
        model(ids, mask, pixel_values=np.zeros((4, 8), np.float32))
    with pytest.raises(ConfigError, match="no vision tower"):
        M.vision_inputs(model.config, np.zeros((4, 8), np.float32), [[1, 2, 2]])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "not supported"),
        (
            {"use_sliding_window": True, "max_window_layers": 0},
            "use_sliding_window=true with max_window_layers=0 of 1 layers: sliding-window",
        ),
        ({"layer_types": ["sliding_attention"]}, "layer_types .*: sliding-window"),
        (
            {"model_type": "mistral", "layer_types": ["sliding_attention", "full_attention"]},
            "layer_types .*mixed",
        ),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs a factor"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    d = {"model_type": "llama", "num_hidden_layers": 1} | change
    with pytest.raises(ConfigError, match=message):
        M.config_from_hf(d)


def test_sliding_window_asked_for_on_no_layer_is_full_attention():
    """Qwen2/Qwen3's use_sliding_window slides only the layers from max_window_layers on
    (transformers' layer_types): where that is none, the model is full attention."""
    for d in (
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        {"use_sliding_window": True, "layer_types": ["full_attention"] * 2},
    ):
        cfg = M.config_from_hf({"model_type": "qwen2", "num_hidden_layers": 2} | d)
        assert cfg.text.sliding_window == 0


# name: (billions of parameters as the model cards round them, family, tied head)
PUBLISHED = {
    "llama-2-7b": (6.74, "llama", False),
    "llama-3.1-8b": (8.03, "llama", False),
    "deepseek-math-7b": (6.91, "llama", False),
    "qwen2.5-7b": (7.62, "qwen2", False),
    "qwen3-8b": (8.19, "qwen3", False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert name in M.preset_names()
    with open(f"{M.PRESETS}/{name}.json") as f:
        d = json.load(f)
    cfg = M.config_from_hf(d, name)
    billions, model_type, tied = PUBLISHED[name]
    assert cfg.model_type == model_type and cfg.tie_word_embeddings == tied
    model = nnx.eval_shape(lambda: M.Model(cfg, rngs=nnx.Rngs(0)))
    ours_ = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    assert ours_ == sum(p.numel() for p in hf.parameters())
    assert abs(ours_ / 1e9 - billions) <= 0.01 * billions, ours_


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.5},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "attention_factor": 0.9,
            "truncate": False,
        },
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024},
    ],
    ids=["linear", "llama3", "yarn", "yarn-mscale", "yarn-given-factor", "yarn-no-factor"],
)
def test_rope_frequencies_equal_transformers(rope):
    """Inverse frequencies and the cos/sin scale of each rope type, read from a config.json,
    equal transformers' rope initialisation (head_dim 128, theta 1e6, 32k positions, and
    YaRN's mscale, beta, truncate and implicit-factor variants)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxvrl.models.layers import rope_inv_freq

    params = {"rope_theta": 1e6, **rope}
    hf = Qwen3Config(head_dim=128, max_position_embeddings=32768, rope_parameters=dict(params))
    inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    d = hf.to_dict() | {"model_type": "qwen3", "rope_parameters": params}
    cfg = M.config_from_hf(d).text
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), inv.numpy(), rtol=1e-6)
    assert cfg.rope_attention_factor == pytest.approx(scale, rel=1e-12)
