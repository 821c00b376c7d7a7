"""Qwen3-VL's HF tensor names <-> param paths (see `jaxvrl.models.weights`).

transformers (and the published checkpoints) name the tower `model.visual.` and the text
decoder `model.language_model.`; the tower's MLPs and mergers call their layers linear_fc1 /
linear_fc2 and the mergers' norm `norm` (here fc1 / fc2 and ln_q, the shared modules' names).
"""

from jaxvrl.models.weights import KeyTable

V, T = "model.visual", "model.language_model"
_MERGER = (
    ("{m}.norm.{wb}", "{m}.ln_q.{wb}", "copy"),
    ("{m}.linear_{fc}.weight", "{m}.{fc}.kernel", "linear"),
    ("{m}.linear_{fc}.bias", "{m}.{fc}.bias", "copy"),
)
_MERGERS = tuple(
    (hf.format(m=hm, wb="{wb}", fc="{fc}"), path.format(m=pm, wb="{wb}", fc="{fc}"), kind)
    for hm, pm in (
        (f"{V}.merger", "visual.merger"),
        (f"{V}.deepstack_merger_list.{{k}}", "visual.deepstack_merger_list.{k}"),
    )
    for hf, path, kind in _MERGER
)

KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    (f"{V}.patch_embed.proj.weight", "visual.patch_embed.kernel", "patch"),
    (f"{V}.patch_embed.proj.bias", "visual.patch_embed.bias", "copy"),
    (f"{V}.pos_embed.weight", "visual.pos_embed.embedding", "copy"),
    (f"{V}.blocks.{{i}}.norm{{n}}.{{wb}}", "visual.blocks.{i}.norm{n}.{wb}", "copy"),
    (f"{V}.blocks.{{i}}.attn.{{proj}}.weight", "visual.blocks.{i}.attn.{proj}.kernel", "linear"),
    (f"{V}.blocks.{{i}}.attn.{{proj}}.bias", "visual.blocks.{i}.attn.{proj}.bias", "copy"),
    (f"{V}.blocks.{{i}}.mlp.linear_{{fc}}.weight", "visual.blocks.{i}.mlp.{fc}.kernel", "linear"),
    (f"{V}.blocks.{{i}}.mlp.linear_{{fc}}.bias", "visual.blocks.{i}.mlp.{fc}.bias", "copy"),
    *_MERGERS,
    (f"{T}.embed_tokens.weight", "model.embed_tokens.embedding", "copy"),
    (f"{T}.layers.{{i}}.{{norm}}.weight", "model.layers.{i}.{norm}.weight", "copy"),
    (
        f"{T}.layers.{{i}}.self_attn.{{p}}_proj.weight",
        "model.layers.{i}.self_attn.{p}_proj.kernel",
        "linear",
    ),
    (
        f"{T}.layers.{{i}}.self_attn.{{p}}_proj.bias",
        "model.layers.{i}.self_attn.{p}_proj.bias",
        "copy",
    ),
    (
        f"{T}.layers.{{i}}.self_attn.{{p}}_norm.weight",
        "model.layers.{i}.self_attn.{p}_norm.weight",
        "copy",
    ),
    (f"{T}.layers.{{i}}.mlp.{{proj}}.weight", "model.layers.{i}.mlp.{proj}.kernel", "linear"),
    (f"{T}.norm.weight", "model.norm.weight", "copy"),
    ("lm_head.weight", "lm_head.kernel", "linear"),
)

# Saves without the nesting (`visual.`, `model.layers.`) -> transformers' layout.
KEY_ALIASES: tuple[tuple[str, str], ...] = (
    (r"^visual\.", "model.visual."),
    (r"^model\.(?!visual\.|language_model\.)", "model.language_model."),
)

KEYS = KeyTable(KEY_TABLE, KEY_ALIASES)
