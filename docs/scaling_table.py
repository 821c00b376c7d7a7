"""Per-device memory of Qwen2.5-VL RL training on device meshes: the table in docs/scaling.md.

    python docs/scaling_table.py > /tmp/table.md    # docs/scaling.md shows this output verbatim

Plain arithmetic on the checkpoints' config numbers (no jax needed); every formula is one
function below and is stated in docs/scaling.md. tests/parallel/test_scaling_table.py checks
the parameter counts against `jax.eval_shape` of the Flax model for all three configs and that
the document holds this script's current output.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Size:
    """The numbers of one checkpoint's config.json (text decoder + vision tower)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    v_depth: int = 32
    v_hidden: int = 1280
    v_heads: int = 16
    v_intermediate: int = 3420
    patch_dim: int = 3 * 2 * 14 * 14  # C x T x P x P
    merge: int = 4  # 2 x 2 patches per vision token

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES = (
    Size("Qwen2.5-VL-3B", 2048, 36, 16, 2, 11008, 151936, tied=True),
    Size("Qwen2.5-VL-7B", 3584, 28, 28, 4, 18944, 152064, tied=False),
    Size("Qwen2.5-VL-32B", 5120, 64, 40, 8, 27648, 152064, tied=False, v_intermediate=3456),
)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    hbm_gib: float


DEVICES = (Device("TPU v5e", 16), Device("TPU v5p", 95), Device("H100", 80))


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step. Rows per device: `micro_rows` in the train step (one micro-batch),
    `sample_rows` in the sampler (its KV cache)."""

    prompt: int = 1024  # prompt tokens incl. the image's vision tokens
    completion: int = 1024  # max_new_tokens
    patches: int = 4096  # image patches per row (1024 vision tokens: 896 x 896 px)
    micro_rows: int = 1
    sample_rows: int = 8
    kl_reference: bool = True  # use_kl_loss: a frozen copy of the params


# ----------------------------------------------------------------------------- counts
def text_params(s: Size) -> int:
    d, kv = s.hidden, s.kv_heads * s.head_dim
    attn = d * d + d + 2 * (d * kv + kv) + d * d  # q (+bias), k, v (+bias), o
    layer = attn + 3 * d * s.intermediate + 2 * d  # gated MLP, two RMSNorms
    embed = s.vocab * d * (1 if s.tied else 2)  # embed_tokens (+ lm_head)
    return s.layers * layer + embed + d


def vision_params(s: Size) -> int:
    h, i = s.v_hidden, s.v_intermediate
    block = (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h) + 2 * h
    m = h * s.merge
    merger = h + (m * m + m) + (m * s.hidden + s.hidden)
    return s.patch_dim * h + s.v_depth * block + merger


def params(s: Size) -> int:
    return text_params(s) + vision_params(s)


# ----------------------------------------------------------------------------- memory
def state_bytes(s: Size, shards: int, w: Workload) -> dict[str, float]:
    """float32 master params, AdamW mu + nu, float32 gradients (the accumulator), and the
    reference copy; all split over the fsdp x tensor devices (data replicas hold copies)."""
    p = params(s) / shards
    out = {"params": 4 * p, "optimizer": 8 * p, "gradients": 4 * p}
    out["reference"] = 4 * p if w.kl_reference else 0.0
    return out


def activation_bytes(s: Size, tensor: int, w: Workload) -> float:
    """Train step with remat_policy=full, bf16 compute, `micro_rows` rows per device.

    Saved: each decoder layer's input [b, T, D] and each vision block's input [b, n, Dv]
    (bf16). Live at the peak: one decoder layer recomputed for its backward (float32
    attention probabilities [b, heads/tensor, T, T] twice, q/k/v/o and the MLP's
    3 x [b, T, I/tensor] in bf16, float32 residual gradients) and the completion logits
    float32 [b, N, V/tensor] with their log-softmax and gradient (x3).
    """
    b, t = w.micro_rows, w.prompt + w.completion
    saved = 2 * b * t * s.hidden * s.layers + 2 * b * w.patches * s.v_hidden * s.v_depth
    heads = max(1, s.heads // tensor)
    attn = 2 * 4 * b * heads * t * t
    layer = (
        attn + 2 * b * t * (4 * s.hidden + 3 * s.intermediate // tensor) + 3 * 4 * b * t * s.hidden
    )
    logits = 3 * 4 * b * w.completion * s.vocab / tensor
    return saved + layer + logits


def saved_per_layer(s: Size, policy: str, t: int, tensor: int = 1) -> float:
    """Bytes per row and token that the backward keeps for one decoder layer (bf16 compute).

    full: the layer input (D). none: layer input, two norm outputs, q, k, v, attention output,
    o, gate, up, act(gate) * up (bf16), the bf16 attention scores and their float32 copy and
    probabilities (5 bf16 units per head and key). dots_saveable: the layer input and every
    matmul output, the bf16 attention scores [h, T] and output included.
    dots_with_no_batch_dims_saveable: the layer input and the weight matmuls' outputs.
    """
    d, kv, i, h = s.hidden, 2 * s.kv_heads * s.head_dim, s.intermediate // tensor, s.heads
    h = max(1, h // tensor)
    weights = d + kv + d + 2 * i + d  # q, k+v, o, gate, up, down
    units = {
        "full": d,
        "none": 4 * d + kv + d + 3 * i + 5 * h * t,
        "dots_saveable": d + weights + h * t + d,
        "dots_with_no_batch_dims_saveable": d + weights,
    }[policy]
    return 2.0 * units


def remat_table(w: Workload = Workload()) -> str:
    t = w.prompt + w.completion
    lines = [
        f"Saved decoder activations per row (T = {t}), GiB, by `model.remat_policy`:",
        "",
        "| model | full | dots_with_no_batch_dims_saveable | dots_saveable | none |",
        "|---|---|---|---|---|",
    ]
    for s in SIZES:
        cells = [
            f"{saved_per_layer(s, p, t) * t * s.layers / GiB:.2f}"
            for p in ("full", "dots_with_no_batch_dims_saveable", "dots_saveable", "none")
        ]
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_cache_bytes(s: Size, tensor: int, w: Workload) -> float:
    """Sampler: 2 (k, v) x layers x rows x (P + N) x kv_heads x head_dim in bf16; rows split
    over (data, fsdp), kv heads over tensor when it divides them."""
    kv = s.kv_heads // tensor if s.kv_heads % tensor == 0 else s.kv_heads
    return 2 * 2 * s.layers * w.sample_rows * (w.prompt + w.completion) * kv * s.head_dim


def per_device(s: Size, fsdp: int, tensor: int, w: Workload) -> dict[str, float]:
    out = state_bytes(s, fsdp * tensor, w)
    out["activations"] = activation_bytes(s, tensor, w)
    out["kv_cache"] = kv_cache_bytes(s, tensor, w)
    # The sampler runs between train steps: its cache and the step's activations and
    # gradients are not live at once.
    step = out["gradients"] + out["activations"]
    out["peak"] = out["params"] + out["optimizer"] + out["reference"] + max(step, out["kv_cache"])
    return out


def smallest_mesh(s: Size, dev: Device, w: Workload, budget: float = 0.85):
    """The fewest devices (fsdp x tensor, powers of two, tensor <= 8 and only when fsdp alone
    does not fit by 256 devices) whose peak fits in `budget` of HBM."""
    for tensor in (1, 2, 4, 8):
        for k in range(0, 9):
            fsdp = 2**k
            m = per_device(s, fsdp, tensor, w)
            if m["peak"] <= budget * dev.hbm_gib * GiB:
                return fsdp, tensor, m
    return None


def table(w: Workload = Workload()) -> str:
    lines = [
        f"Workload: prompt {w.prompt} + completion {w.completion} tokens, {w.patches} image "
        f"patches per row, {w.micro_rows} row per device per micro-batch in the train step, "
        f"{w.sample_rows} rows per device in the sampler, AdamW, float32 master weights, "
        f"bf16 compute, remat_policy=full, KL reference copy: {w.kl_reference}. "
        "GiB per device; fits = peak <= 85% of HBM.",
        "",
        "| model | params (text + vision) | device (HBM) | mesh (fsdp x tensor) | params "
        "| optimizer | gradients | reference | activations | KV cache | peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in SIZES:
        count = (
            f"{params(s) / 1e9:.2f}B ({text_params(s) / 1e9:.2f}B + {vision_params(s) / 1e6:.0f}M)"
        )
        for dev in DEVICES:
            found = smallest_mesh(s, dev, w)
            if found is None:
                lines.append(
                    f"| {s.name} | {count} | {dev.name} ({dev.hbm_gib:g}) | > 2048 | |||||||"
                )
                continue
            fsdp, tensor, m = found
            g = {k: v / GiB for k, v in m.items()}
            lines.append(
                f"| {s.name} | {count} | {dev.name} ({dev.hbm_gib:g}) | {fsdp} x {tensor} "
                f"| {g['params']:.2f} | {g['optimizer']:.2f} | {g['gradients']:.2f} "
                f"| {g['reference']:.2f} | {g['activations']:.2f} | {g['kv_cache']:.2f} "
                f"| {g['peak']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    print(table())
    print()
    print(remat_table())


if __name__ == "__main__":
    main()
