"""Configuration shared by the model families: the text decoder's and the vision tower's
settings as frozen dataclasses, read from HF `config.json` dictionaries, and the helpers that
keep a config's unknown keys for export."""

from __future__ import annotations

import dataclasses
import json

from jaxvrl.config import ConfigError

# Gradient checkpointing of decoder layers and vision blocks (`model.remat_policy`). "offload":
# as "full", with each layer's input (what the backward pass recomputes the layer from) kept in
# host memory instead of the devices' (named OFFLOADED inside the checkpoint).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload")
OFFLOADED = "layer_input"


def checkpoint_policy(name: str):
    """The jax.checkpoint policy for a REMAT_POLICIES name ("full": save nothing)."""
    import jax

    if name not in REMAT_POLICIES or name == "none":
        raise ValueError(f"remat_policy {name!r} is not one of {REMAT_POLICIES[1:]}")
    if name == "full":
        return None
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=(OFFLOADED,),
            offload_src="device",
            offload_dst="pinned_host",
        )
    return getattr(jax.checkpoint_policies, name)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 2
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # the blocks' and the merger's norm: "rms" (Qwen2.5-VL) or "layer" (Qwen2-VL, Qwen3-VL)
    norm: str = "rms"
    # the blocks' MLP: "gated" (gate/up/down, Qwen2.5-VL) or "plain" (fc1/fc2)
    mlp: str = "gated"
    # a bias on the patch embedding (Qwen3-VL)
    patch_bias: bool = False
    # a learned square table of position embeddings, interpolated to each grid (Qwen3-VL);
    # 0: none
    num_position_embeddings: int = 0
    # blocks whose outputs, each through its own merger, are added to the text decoder's first
    # layers (Qwen3-VL's DeepStack)
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_side(self) -> int:
        """Side of the square table of learned position embeddings (0 without one)."""
        return int(round(self.num_position_embeddings**0.5))

    @property
    def windowed(self) -> bool:
        """Whether some blocks attend within windows (window_size 0: every block attends over
        its whole frame)."""
        return self.window_size > 0 and len(set(self.fullatt_block_indexes)) < self.depth

    @property
    def full_blocks(self) -> frozenset[int]:
        """The blocks that attend over whole frames."""
        if not self.windowed:
            return frozenset(range(self.depth))
        return frozenset(self.fullatt_block_indexes)

    @property
    def patch_dim(self) -> int:
        """Flattened size of one patch: C x T x P x P (1176 for Qwen2.5-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Merge units along one side of an attention window (0 without windows)."""
        if not self.windowed:
            return 0
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_patches(self) -> int:
        """Patches in a whole attention window (64 for Qwen2.5-VL); edge windows hold fewer."""
        return self.window_units**2 * self.merge_unit


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # M-RoPE: the rotary frequencies on the temporal, height and width axes of positions
    # int[3, B, T]; () for plain RoPE over positions int[B, T] (the text families)
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 128000
    # 0: hidden_size / num_attention_heads (Qwen2.5-VL); Qwen3 names its own
    head_dim: int = 0
    # biases on q/k/v (Qwen2.5-VL) and on o (neither in Qwen3-VL)
    attention_bias: bool = True
    output_bias: bool = False
    # RMSNorm over each head of q and k before the rotary (Qwen3)
    qk_norm: bool = False
    # M-RoPE frequencies interleaved t, h, w, t, h, w, ... (Qwen3-VL) rather than in sections
    mrope_interleaved: bool = False
    # rotary scaling of the text families (`layers.rope_inv_freq`): "default", "linear",
    # "dynamic" (NTK by the call's longest position), "llama3", "yarn"; factor,
    # low/high_freq_factor, original_max_position_embeddings, beta_fast/beta_slow and truncate
    # as transformers' rope parameters name them; YaRN's cos/sin scale (its attention_factor,
    # resolved from factor, mscale and mscale_all_dim at load)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    # every layer's queries see only the keys fewer than this many positions back (Mistral);
    # 0: no window
    sliding_window: int = 0
    # a sparse mixture of experts in place of the gated MLP (Qwen3-MoE, `moe.py`): experts
    # (0: every layer dense) of width moe_intermediate_size, num_experts_per_tok of them per
    # token, their weights renormalised to sum 1 where norm_topk_prob; layer i is sparse
    # where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; the
    # auxiliary load-balancing loss's coefficient
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    # the experts' gate and up projections held as one kernel [E, D, 2F], gate's F columns
    # first, as Qwen3-VL-MoE's checkpoints hold them (`moe.Experts`)
    fused_gate_up: bool = False
    # a shared expert beside the routed ones (Qwen2-MoE, `moe.SparseMoE`): a dense gated MLP
    # of this width that every token of a sparse layer runs, its output scaled by a sigmoid
    # gate; 0: none
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)


ROPE_SCALING_FIELDS = (
    "rope_type",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_truncate",
    "rope_attention_factor",
)


def text_sizes(t: TextConfig) -> dict:
    """The text decoder's sizes, activation, norm epsilon and length as config.json names
    them (every family writes these the same way; head_dim and the rope are its own)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps")
    return {k: getattr(t, k) for k in (*keys, "max_position_embeddings")}


def fields_of(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def freeze(v):
    return json.dumps(v, sort_keys=True)


def thaw(v):
    return json.loads(v)


def text_from_dict(d: dict, source: str, **overrides) -> TextConfig:
    """A TextConfig from an HF text config dictionary; `overrides` set fields the family
    knows and the dictionary does not hold."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(
            f"{source}: text rope type {rope_type!r} is not supported (only default/mrope)"
        )
    theta = rope.get("rope_theta", d.get("rope_theta", TextConfig.rope_theta))
    kw = {k: d[k] for k in fields_of(TextConfig) if k in d and d[k] is not None}
    kw.pop("rope_theta", None)
    kw.pop("mrope_section", None)
    kw.pop("mrope_interleaved", None)
    kw.pop("sliding_window", None)  # read only where use_sliding_window (refused below)
    for key in ROPE_SCALING_FIELDS:  # the text families' rope scaling, not read here
        kw.pop(key, None)
    kw.update(overrides)
    cfg = TextConfig(
        **kw,
        rope_theta=float(theta),
        mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
    )
    if not d.get("head_dim") and cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"{source}: hidden_size not divisible by num_attention_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{source}: num_attention_heads not divisible by num_key_value_heads")
    if 2 * sum(cfg.mrope_section) != cfg.head_dim:
        raise ConfigError(
            f"{source}: mrope_section {cfg.mrope_section} must sum to head_dim/2 = {cfg.head_dim // 2}"
        )
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported")
    return cfg


def vision_from_dict(d: dict, source: str) -> VisionConfig:
    rope = d.get("rope_parameters") or {}
    kw = {k: d[k] for k in fields_of(VisionConfig) if k in d and d[k] is not None}
    if "num_attention_heads" in d and "num_heads" not in d:
        kw["num_heads"] = d["num_attention_heads"]
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if key in kw:
            kw[key] = tuple(kw[key])
    kw["rope_theta"] = float(rope.get("rope_theta", VisionConfig.rope_theta))
    cfg = VisionConfig(**kw)
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"{source}: vision hidden_size not divisible by num_heads")
    if cfg.position_side**2 != cfg.num_position_embeddings:
        raise ConfigError(
            f"{source}: num_position_embeddings {cfg.num_position_embeddings} is not a square"
        )
    if any(not 0 <= i < cfg.depth for i in cfg.deepstack_visual_indexes):
        raise ConfigError(
            f"{source}: deepstack_visual_indexes {list(cfg.deepstack_visual_indexes)} must be "
            f"blocks of the {cfg.depth}"
        )
    if cfg.windowed and cfg.window_size % (cfg.spatial_merge_size * cfg.patch_size):
        raise ConfigError(
            f"{source}: vision window_size {cfg.window_size} must be a multiple of "
            f"spatial_merge_size * patch_size"
        )
    return cfg
