"""Text-only causal language models as entries of one table (`TEXT_FAMILIES`).

A text family differs from another only in settings: transformers' config defaults, whether
q/k/v and o carry biases, per-head q/k RMSNorm, whether config.json's `sliding_window`
applies, and whether its layers may be sparse mixtures of experts (`moe.py`). Each is a `TextFamily` entry; the module is the shared `Model` (the text decoder
with an LM head or tied embeddings, no vision encoder), the HF key table is the one below,
and positions are 1-D RoPE positions int32[B, T]. Adding a Llama-like family is one entry:

    TEXT_FAMILIES["mistral"] = TextFamily("mistral", "MistralForCausalLM", defaults=...)

A `<Family>ForSequenceClassification` checkpoint (a reward model) is the same decoder with a
`score` head (Linear(hidden, num_labels), no bias) in place of the LM head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxvrl.config import ConfigError
from jaxvrl.models import moe
from jaxvrl.models.config import TextConfig, fields_of, freeze, jsonable, text_sizes, thaw
from jaxvrl.models.layers import ROPE_TYPES, activation, rope_attention_factor
from jaxvrl.models.weights import KeyTable


@dataclasses.dataclass(frozen=True)
class TextFamily:
    """One text-only family. defaults: transformers' config defaults of the family (keys a
    config.json leaves out); bias: (q/k/v, o) biases fixed by the architecture, or None where
    config.json's attention_bias sets all four; qk_norm: per-head q/k RMSNorm before the
    rotary; sliding_window: config.json's `sliding_window` bounds every layer's attention
    (Mistral), else a sliding window is refused at load; moe: config.json's mixture-of-experts
    keys (moe.MOE_KEYS) are read, and its sparse layers run `moe.SparseMoE` (Qwen3-MoE);
    shared_expert: config.json's `shared_expert_intermediate_size` is read too, the width of
    each sparse layer's shared expert (Qwen2-MoE); qkv_bias: config.json's `qkv_bias` sets
    the q/k/v biases that `bias` fixes otherwise (Qwen2-MoE)."""

    model_type: str
    architecture: str
    defaults: tuple[tuple[str, Any], ...] = ()
    bias: tuple[bool, bool] | None = None
    qk_norm: bool = False
    sliding_window: bool = False
    moe: bool = False
    shared_expert: bool = False
    qkv_bias: bool = False

    @property
    def classifier_architecture(self) -> str:
        """`Qwen2ForCausalLM` -> `Qwen2ForSequenceClassification`."""
        return self.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"


def _defaults(**kw) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kw.items()))


# model_type -> entry; transformers' defaults of each family's config class
TEXT_FAMILIES: dict[str, TextFamily] = {
    # Llama 2, Llama 3.x, DeepSeek-LLM/Math: config.json's attention_bias on q, k, v and o
    "llama": TextFamily(
        "llama",
        "LlamaForCausalLM",
        _defaults(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            hidden_act="silu",
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),  # fmt: skip
    # Qwen2 and Qwen2.5: biases on q, k and v, none on o
    "qwen2": TextFamily(
        "qwen2",
        "Qwen2ForCausalLM",
        _defaults(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=22016,
            num_hidden_layers=32,
            num_attention_heads=32,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        ),
        bias=(True, False),
    ),  # fmt: skip
    # Qwen3 (dense): per-head q/k RMSNorm, an explicit head_dim
    "qwen3": TextFamily(
        "qwen3",
        "Qwen3ForCausalLM",
        _defaults(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=22016,
            num_hidden_layers=32,
            num_attention_heads=32,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        ),
        qk_norm=True,
    ),  # fmt: skip
    # Mistral: no biases, a sliding window over every layer's keys
    "mistral": TextFamily(
        "mistral",
        "MistralForCausalLM",
        _defaults(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_act="silu",
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            bos_token_id=1,
            eos_token_id=2,
            sliding_window=4096,
        ),
        bias=(False, False),
        sliding_window=True,
    ),  # fmt: skip
    # Qwen3-MoE: Qwen3's attention, sparse mixture-of-experts feed-forwards
    "qwen3_moe": TextFamily(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _defaults(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=4,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            router_aux_loss_coef=0.001,
        ),
        qk_norm=True,
        moe=True,
    ),  # fmt: skip
    # Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (q/k/v biases by config.json's qkv_bias),
    # sparse feed-forwards with a shared expert
    "qwen2_moe": TextFamily(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _defaults(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            router_aux_loss_coef=0.001,
            qkv_bias=True,
        ),
        bias=(True, False),
        moe=True,
        shared_expert=True,
        qkv_bias=True,
    ),  # fmt: skip
}

# config.json keys read into the config (the rest is kept in `extra` and written back)
TEXT_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "model_type",
    "architectures",
    "num_labels",
}


def text_family(model_type: str, source: str = "config.json") -> TextFamily:
    if model_type not in TEXT_FAMILIES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not a text family")
    return TEXT_FAMILIES[model_type]


def _rope(d: dict, source: str, theta: float) -> dict:
    """TextConfig's rope fields from config.json's rope_parameters / rope_scaling."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    out = dict(rope_type=kind, rope_theta=float(rope.get("rope_theta", d.get("rope_theta", theta))))
    if kind == "default":
        return out
    # the pretraining length: config.json's own key first (Phi-3 style), as transformers reads it
    original = d.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings"
    )
    original = int(original or d["max_position_embeddings"])
    if kind == "yarn" and rope.get("factor") is None:  # DeepSeek-V3 style: the lengths' ratio
        rope["factor"] = d["max_position_embeddings"] / original
    if rope.get("factor") is None:
        raise ConfigError(f"{source}: rope type {kind!r} needs a factor")
    out["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        try:
            out["rope_low_freq_factor"] = float(rope["low_freq_factor"])
            out["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        except KeyError as e:
            raise ConfigError(f"{source}: rope type 'llama3' needs {e.args[0]}") from None
    if kind in ("llama3", "yarn"):
        out["rope_original_max_position_embeddings"] = original
    if kind == "yarn":
        out["rope_beta_fast"] = float(rope.get("beta_fast") or 32.0)
        out["rope_beta_slow"] = float(rope.get("beta_slow") or 1.0)
        out["rope_truncate"] = bool(rope.get("truncate", True))
        out["rope_attention_factor"] = rope_attention_factor(rope, out["rope_factor"])
    return out


def _rope_parameters(t: TextConfig) -> dict:
    """config.json's rope_parameters (transformers' layout) of a TextConfig."""
    out: dict[str, Any] = {"rope_type": t.rope_type, "rope_theta": t.rope_theta}
    if t.rope_type != "default":
        out["factor"] = t.rope_factor
    if t.rope_type == "llama3":
        out["low_freq_factor"] = t.rope_low_freq_factor
        out["high_freq_factor"] = t.rope_high_freq_factor
    if t.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = t.rope_original_max_position_embeddings
    if t.rope_type == "yarn":  # what differs from transformers' defaults
        given = {
            "beta_fast": (t.rope_beta_fast, 32.0),
            "beta_slow": (t.rope_beta_slow, 1.0),
            "truncate": (t.rope_truncate, True),
            "attention_factor": (t.rope_attention_factor, rope_attention_factor({}, t.rope_factor)),
        }
        out |= {k: v for k, (v, default) in given.items() if v != default}
    return out


def _sliding_window(d: dict, entry: TextFamily, source: str) -> int:
    """The window every layer's attention keeps (0: none) from config.json `d` (an explicit
    null: none), or a one-line refusal naming the key that asks for one the family's entry
    does not read."""
    types = set(d.get("layer_types") or ())
    if not types and d.get("use_sliding_window"):  # Qwen2/Qwen3: layers from max_window_layers
        n, first = d.get("num_hidden_layers", 0), d.get("max_window_layers", 28)
        types = {"sliding_attention" if i >= first else "full_attention" for i in range(n)}
        if types == {"sliding_attention"} or len(types) > 1:
            raise ConfigError(
                f"{source}: use_sliding_window=true with max_window_layers={first} of {n} "
                "layers: sliding-window attention on those layers is not supported"
            )
    if types - {"full_attention", "sliding_attention"} or len(types) > 1:
        raise ConfigError(
            f"{source}: layer_types {sorted(types)}: mixed sliding-window and full attention "
            "layers are not supported"
        )
    window = None
    if entry.sliding_window:
        window = d.get("sliding_window", dict(entry.defaults).get("sliding_window"))
    if types == {"sliding_attention"} and not window:
        raise ConfigError(
            f"{source}: layer_types ['sliding_attention']: sliding-window attention is not "
            f"supported for {entry.model_type}"
        )
    if window is None:
        return 0
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return window


@dataclasses.dataclass(frozen=True)
class CausalLMConfig:
    """A text-only model's config: its family's `model_type` (an entry of `TEXT_FAMILIES`),
    the decoder's settings and the keys config.json holds besides them."""

    model_type: str = "llama"
    text: TextConfig = TextConfig()
    tie_word_embeddings: bool = False
    # a sequence classifier's labels (its `score` head; config.json's architectures name
    # `<Family>ForSequenceClassification`); None: a causal LM
    num_labels: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Anything else in config.json (kept so that export writes it back).
    extra: tuple[tuple[str, Any], ...] = ()

    vision = None  # no vision encoder

    @property
    def family(self) -> TextFamily:
        return text_family(self.model_type)

    @property
    def architecture(self) -> str:
        return self.family.architecture

    @property
    def hf_architecture(self) -> str:
        entry = self.family
        return entry.classifier_architecture if self.num_labels else entry.architecture

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> CausalLMConfig:
        entry = text_family(d.get("model_type"), source)
        window = _sliding_window(d, entry, source)
        # an explicit null token id stays None (as in transformers); other nulls take defaults
        d = dict(entry.defaults) | {
            k: v for k, v in d.items() if v is not None or k.endswith("token_id")
        }
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        heads = d["num_attention_heads"]
        kw = {k: d[k] for k in fields_of(TextConfig) & TEXT_KEYS if k in d}
        kw["num_key_value_heads"] = d.get("num_key_value_heads", heads)
        kw["head_dim"] = d.get("head_dim") or d["hidden_size"] // heads
        bias = bool(d.get("attention_bias", False))
        kw["attention_bias"], kw["output_bias"] = (bias, bias) if entry.bias is None else entry.bias
        if entry.qkv_bias:
            kw["attention_bias"] = bool(d["qkv_bias"])
        kw |= _rope(d, source, dict(entry.defaults).get("rope_theta", 10000.0))
        if entry.moe:
            kw |= moe.config_fields(d, source, entry.shared_expert)
        text = TextConfig(**kw, qk_norm=entry.qk_norm, mrope_section=(), sliding_window=window)
        if heads % text.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads not divisible by num_key_value_heads")
        if text.head_dim % 2:
            raise ConfigError(f"{source}: head_dim {text.head_dim} is odd")
        try:
            activation(text.hidden_act)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        read = TEXT_KEYS | ({"sliding_window"} if entry.sliding_window else set())
        read |= {*moe.MOE_KEYS, "num_local_experts"} if entry.moe else set()
        read |= {moe.SHARED_EXPERT_KEY} if entry.shared_expert else set()
        read |= {"qkv_bias"} if entry.qkv_bias else set()
        extra = tuple(sorted((k, v) for k, v in d.items() if k not in read and jsonable(v)))
        eos = d.get("eos_token_id")
        num_labels = None
        if entry.classifier_architecture in (d.get("architectures") or ()):
            # transformers: num_labels is len(id2label), 2 when config.json names neither
            num_labels = int(d.get("num_labels") or len(d.get("id2label") or ()) or 2)
        return cls(
            model_type=entry.model_type,
            text=text,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_labels=num_labels,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            extra=tuple((k, freeze(v)) for k, v in extra),
        )

    def to_hf_dict(self) -> dict:
        t, entry = self.text, self.family
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d = {k: thaw(v) for k, v in self.extra}
        d.update(
            {
                "architectures": [self.hf_architecture],
                "model_type": self.model_type,
                **text_sizes(t),
                "head_dim": t.head_dim,
                "rope_parameters": _rope_parameters(t),
                "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": eos,
            }
        )
        if entry.bias is None:
            d["attention_bias"] = t.attention_bias
        if entry.sliding_window:
            d["sliding_window"] = t.sliding_window or None
        if entry.moe:
            d.update({k: getattr(t, k) for k in moe.MOE_KEYS})
            d["mlp_only_layers"] = list(t.mlp_only_layers)
        if entry.shared_expert:
            d[moe.SHARED_EXPERT_KEY] = t.shared_expert_intermediate_size
        if entry.qkv_bias:
            d["qkv_bias"] = t.attention_bias
        if self.num_labels and len(d.get("id2label") or ()) != self.num_labels:
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d


def rope_index(
    input_ids,
    attention_mask,
    cfg=None,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids int32[B, T], deltas int32[B]) of left- or right-padded prompts: the
    valid tokens of a row count 0, 1, 2, ... (cumsum(mask) - 1, as HF's generate places
    them), padding 0; deltas are 0 (the i-th token after a row's n valid ones has position
    n + i)."""
    if any(g is not None for g in (image_grid_thw, video_grid_thw)):
        raise ValueError("a text-only model takes no images or videos")
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) > 0
    pos = np.where(mask, np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return pos, np.zeros(ids.shape[0], np.int32)


# HF tensor names <-> param paths (the same for every text family)
KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "model.embed_tokens.embedding", "copy"),
    ("model.layers.{i}.{norm}.weight", "model.layers.{i}.{norm}.weight", "copy"),
    (
        "model.layers.{i}.self_attn.{p}_proj.weight",
        "model.layers.{i}.self_attn.{p}_proj.kernel",
        "linear",
    ),
    (
        "model.layers.{i}.self_attn.{p}_proj.bias",
        "model.layers.{i}.self_attn.{p}_proj.bias",
        "copy",
    ),
    (
        "model.layers.{i}.self_attn.{p}_norm.weight",
        "model.layers.{i}.self_attn.{p}_norm.weight",
        "copy",
    ),
    ("model.layers.{i}.mlp.{proj}.weight", "model.layers.{i}.mlp.{proj}.kernel", "linear"),
    # a sparse layer: its router is `mlp.gate` (the row above), as is its shared expert's
    # gate `mlp.shared_expert_gate`; expert e's projections are index e of the experts'
    # stacked kernels (`weights.expert_path`)
    (
        "model.layers.{i}.mlp.shared_expert.{proj}.weight",
        "model.layers.{i}.mlp.shared_expert.{proj}.kernel",
        "linear",
    ),
    (
        "model.layers.{i}.mlp.experts.{e}.{proj}.weight",
        "model.layers.{i}.mlp.experts.{e}.{proj}.kernel",
        "linear",
    ),
    ("model.norm.weight", "model.norm.weight", "copy"),
    ("lm_head.weight", "lm_head.kernel", "linear"),
    ("score.weight", "score.kernel", "linear"),  # a sequence classifier's head
)

KEYS = KeyTable(KEY_TABLE)
