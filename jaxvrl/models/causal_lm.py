"""Text-only causal language models (Llama, Qwen2, Qwen3), shared by their families.

The module is the shared text decoder (`decoder.TextDecoder`) with an LM head or tied
embeddings, and no vision tower (`visual` is None). Positions are 1-D: the M-RoPE position
ids int32[3, B, T] that the trainer and the samplers pass hold the same positions on all three
axes, and with every rotary frequency on the first axis (mrope_section (head_dim / 2, 0, 0))
that is plain RoPE. A family differs only in its config: the attention biases, per-head q/k
RMSNorm, the head dim and the rope scaling (`CausalLMConfig` and its subclasses).

A `<Family>ForSequenceClassification` checkpoint (a reward model) is the same decoder with a
`score` head (Linear(hidden, num_labels), no bias) in place of the LM head: `logits` are then
float32[..., num_labels], and `classify` reads them at each row's last real token, as
transformers does.

model = jaxvrl.models.load("/path/to/Llama-3.1-8B")
out = model(input_ids, attention_mask)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxvrl.config import ConfigError
from jaxvrl.models.attention import resolve
from jaxvrl.models.cache import KVCache
from jaxvrl.models.config import TextConfig, fields_of, freeze, jsonable, thaw
from jaxvrl.models.decoder import TextDecoder
from jaxvrl.models.interface import ModelOutput, ProcessorSettings, decoder_outputs
from jaxvrl.models.layers import ROPE_TYPES, activation, linear, remat
from jaxvrl.models.weights import KeyTable

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
    if "factor" not in rope:
        raise ConfigError(f"{source}: rope type {kind!r} needs a factor")
    out["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        try:
            out["rope_low_freq_factor"] = float(rope["low_freq_factor"])
            out["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        except KeyError as e:
            raise ConfigError(f"{source}: rope type 'llama3' needs {e.args[0]}") from None
        original = rope.get("original_max_position_embeddings", d["max_position_embeddings"])
        out["rope_original_max_position_embeddings"] = int(original)
    return out


def _rope_parameters(t: TextConfig) -> dict:
    """config.json's rope_parameters (transformers' layout) of a TextConfig."""
    out: dict[str, Any] = {"rope_type": t.rope_type, "rope_theta": t.rope_theta}
    if t.rope_type != "default":
        out["factor"] = t.rope_factor
    if t.rope_type == "llama3":
        out["low_freq_factor"] = t.rope_low_freq_factor
        out["high_freq_factor"] = t.rope_high_freq_factor
        out["original_max_position_embeddings"] = t.rope_original_max_position_embeddings
    return out


@dataclasses.dataclass(frozen=True)
class CausalLMConfig:
    """A text-only model's config; a family subclasses it with its names and defaults.

    DEFAULTS: transformers' config defaults of the family; BIAS: (q/k/v, o) biases fixed by the
    architecture, or None where config.json's attention_bias sets all four; QK_NORM: per-head
    q/k RMSNorm. The vision fields the VL families have are None: no tower, no vision tokens.
    """

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict] = {}
    BIAS: ClassVar[tuple[bool, bool] | None] = None
    QK_NORM: ClassVar[bool] = False
    vision: ClassVar[None] = None
    image_token_id: ClassVar[None] = None
    video_token_id: ClassVar[None] = None
    vision_start_token_id: ClassVar[None] = None
    vision_end_token_id: ClassVar[None] = None

    text: TextConfig = TextConfig()
    tie_word_embeddings: bool = False
    # a sequence classifier's labels (its `score` head; config.json's architectures name
    # `<Family>ForSequenceClassification`); None: a causal LM
    num_labels: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Anything else in config.json (kept so that export writes it back).
    extra: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def classifier_architecture(cls) -> str:
        """`Qwen2ForCausalLM` -> `Qwen2ForSequenceClassification`."""
        return cls.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"

    @property
    def hf_architecture(self) -> str:
        return self.classifier_architecture() if self.num_labels else self.architecture

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> CausalLMConfig:
        if d.get("model_type") != cls.model_type:
            raise ConfigError(
                f"{source}: model_type {d.get('model_type')!r} is not {cls.model_type!r}"
            )
        # an explicit null token id stays None (as in transformers); other nulls take defaults
        d = cls.DEFAULTS | {k: v for k, v in d.items() if v is not None or k.endswith("token_id")}
        if d.get("use_sliding_window") or any(
            t != "full_attention" for t in d.get("layer_types") or ()
        ):
            raise ConfigError(f"{source}: sliding-window attention is not supported")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        heads = d["num_attention_heads"]
        kw = {k: d[k] for k in fields_of(TextConfig) & TEXT_KEYS if k in d}
        kw["num_key_value_heads"] = d.get("num_key_value_heads", heads)
        kw["head_dim"] = d.get("head_dim") or d["hidden_size"] // heads
        bias = bool(d.get("attention_bias", False))
        kw["attention_bias"], kw["output_bias"] = (bias, bias) if cls.BIAS is None else cls.BIAS
        kw |= _rope(d, source, cls.DEFAULTS.get("rope_theta", 10000.0))
        text = TextConfig(
            **kw,
            qk_norm=cls.QK_NORM,
            mrope_section=(kw["head_dim"] // 2, 0, 0),
            mrope_interleaved=False,
        )
        if heads % text.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads not divisible by num_key_value_heads")
        if text.head_dim % 2:
            raise ConfigError(f"{source}: head_dim {text.head_dim} is odd")
        try:
            activation(text.hidden_act)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        extra = tuple(sorted((k, v) for k, v in d.items() if k not in TEXT_KEYS and jsonable(v)))
        eos = d.get("eos_token_id")
        num_labels = None
        if cls.classifier_architecture() in (d.get("architectures") or ()):
            # transformers: num_labels is len(id2label), 2 when config.json names neither
            num_labels = int(d.get("num_labels") or len(d.get("id2label") or ()) or 2)
        return cls(
            text=text,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_labels=num_labels,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            extra=tuple((k, freeze(v)) for k, v in extra),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> CausalLMConfig:
        file = os.path.join(os.fspath(path), "config.json")
        if not os.path.exists(file):
            raise ConfigError(f"{file}: not found (an HF checkpoint directory needs config.json)")
        with open(file) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d, source=file)

    def to_hf_dict(self) -> dict:
        t = self.text
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d = {k: thaw(v) for k, v in self.extra}
        d.update(
            {
                "architectures": [self.hf_architecture],
                "model_type": self.model_type,
                "vocab_size": t.vocab_size,
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "head_dim": t.head_dim,
                "hidden_act": t.hidden_act,
                "rms_norm_eps": t.rms_norm_eps,
                "max_position_embeddings": t.max_position_embeddings,
                "rope_parameters": _rope_parameters(t),
                "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": eos,
            }
        )
        if self.BIAS is None:
            d["attention_bias"] = t.attention_bias
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
    """(position_ids int32[3, B, T], deltas int32[B]) of left- or right-padded prompts: the
    valid tokens of a row count 0, 1, 2, ... on all three axes (cumsum(mask) - 1, as HF's
    generate places them), padding 0; deltas are 0 (the i-th token after a row's n valid
    ones has position n + i)."""
    if any(g is not None for g in (image_grid_thw, video_grid_thw)):
        raise ValueError("a text-only model takes no images or videos")
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) > 0
    pos = np.where(mask, np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return np.broadcast_to(pos, (3, *pos.shape)).copy(), np.zeros(ids.shape[0], np.int32)


def vision_inputs(pixel_values, grid_thw, vision_cfg, num_patches=None):
    raise ConfigError("a text-only model has no vision tower: rows must not hold images")


def processor(cfg) -> ProcessorSettings:
    """Default settings (a text-only model reads no pixels; the trainer asks regardless)."""
    return ProcessorSettings()


class CausalLM(nnx.Module):
    """A text-only causal LM: `model` (the text decoder), `lm_head` unless tied (a sequence
    classifier: `score`); the Model protocol's methods, vision inputs refused."""

    visual = None

    def __init__(
        self,
        cfg: CausalLMConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        remat_policy: str = "none",
        attention: str = "auto",
        scan_layers: bool = True,
    ):
        """scan_layers: the decoder layers stacked on a leading layer axis and run by a scan
        (see `Qwen2_5_VL`); the same outputs either way."""
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = cfg
        self.dtype = dtype
        self.scan_layers = scan_layers
        self.model = TextDecoder(cfg.text, scan_layers=scan_layers, **kw)
        if cfg.num_labels:
            self.score = linear(cfg.text.hidden_size, cfg.num_labels, bias=False, **kw)
        elif not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False, **kw)
        self.set_remat_policy(remat_policy)
        self.set_attention(attention)

    def set_remat_policy(self, policy: str) -> None:
        """Gradient checkpointing of every decoder layer (see `Qwen2_5_VL.set_remat_policy`)."""
        remat(lambda: None, policy)  # validates the name
        self.model.remat_policy = policy

    def set_dtype(self, dtype) -> None:
        """The compute dtype of every layer; the parameters keep theirs."""
        dtype = jnp.dtype(dtype)
        for _, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Module) and "dtype" in vars(node):
                node.dtype = dtype

    def set_attention(self, name: str, block: int = 512) -> None:
        """The attention implementation of forward passes without a KV cache (see
        `Qwen2_5_VL.set_attention`)."""
        resolve(name, "cpu")  # validates the name
        if block < 1:
            raise ValueError(f"attention block size must be positive, got {block}")
        self.model.attention = name
        self.model.attention_block = int(block)

    def embed(self, input_ids, images=None, videos=None):
        """Token embeddings [B, T, D]."""
        if images is not None or videos is not None:
            raise ValueError(f"{self.config.architecture} takes no images or videos")
        return self.model.embed_tokens(input_ids)

    @property
    def _tied(self) -> bool:
        return self.config.tie_word_embeddings and not self.config.num_labels

    @property
    def head(self) -> nnx.Module:
        """The vocabulary projection: `lm_head`, or the token embedding when tied; a
        classifier's `score`."""
        if self.config.num_labels:
            return self.score
        return self.model.embed_tokens if self._tied else self.lm_head

    def logits(self, hidden: jax.Array, head: nnx.Module | None = None) -> jax.Array:
        """float32[..., V] (a classifier: [..., num_labels]) from final hidden states, through
        `head` (default `self.head`)."""
        head = self.head if head is None else head
        out = head.attend(hidden) if self._tied else head(hidden)
        return out.astype(jnp.float32)

    def classify(self, input_ids, attention_mask, position_ids) -> jax.Array:
        """A sequence classifier's logits float32[B, num_labels] at each row's last real token
        (the last attention_mask 1: left or right padding); input_ids/attention_mask [B, T],
        position_ids int[3, B, T]. transformers takes the last token that is not
        pad_token_id, the same token where no real token is the pad token."""
        out = self.forward(input_ids, attention_mask, position_ids, return_logits=False)
        t = jnp.arange(input_ids.shape[1])
        last = jnp.argmax(jnp.where(attention_mask > 0, t, -1), axis=1)  # [B]
        hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return self.logits(hidden)

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        images=None,
        videos=None,
        cache: KVCache | None = None,
        pools: dict | None = None,
        return_logits: bool = True,
        forms=None,
        key_queries=None,
        packing=None,
    ) -> ModelOutput:
        """Traceable forward pass: input_ids/attention_mask [B, T], position_ids int[3, B, T]
        (`rope_index`); cache, pools, return_logits, forms and key_queries as
        `Qwen2_5_VL.forward`'s."""
        return decoder_outputs(
            self,
            self.embed(input_ids, images, videos),
            position_ids,
            attention_mask,
            return_logits=return_logits,
            cache=cache,
            pools=pools,
            forms=forms,
            key_queries=key_queries,
            packing=packing,
        )

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        *,
        position_ids=None,
        pools: dict | None = None,
    ) -> ModelOutput:
        """Forward on host arrays (numpy or concrete jax); left- or right-padded batches."""
        if pixel_values is not None or pixel_values_videos is not None:
            raise ValueError(f"{self.config.architecture} takes no images or videos")
        input_ids = np.asarray(input_ids)
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask)
        if position_ids is None:
            position_ids, _ = rope_index(input_ids, attention_mask)
        return self.forward(
            jnp.asarray(input_ids),
            jnp.asarray(attention_mask),
            jnp.asarray(position_ids),
            pools=None if pools is None else {k: jnp.asarray(v) for k, v in pools.items()},
        )


# HF tensor names <-> param paths (the same for the three families)
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
    ("model.norm.weight", "model.norm.weight", "copy"),
    ("lm_head.weight", "lm_head.kernel", "linear"),
    ("score.weight", "score.kernel", "linear"),  # a sequence classifier's head
)

KEYS = KeyTable(KEY_TABLE)
