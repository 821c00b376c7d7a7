"""LoRA adapters on a model's nnx.Linear layers, wrapped from outside the model code.

y = base(x) + dropout(x) @ A @ B * alpha / rank, A float[D_in, r] (Kaiming-uniform like peft),
B float[r, D_out] zeros, so a fresh adapter leaves the model's outputs unchanged. A and B are
nnx.LoRAParam (a subclass of nnx.Param): `nnx.split(model, nnx.Param)` still returns every
weight, and `trainable_filter` picks the adapters out of it.

    n = apply_lora(model, rank=8, alpha=16, dropout=0.05, targets=("q_proj", "v_proj"))
    merged = merge_lora(model)          # plain model, W + A B alpha / r; save() it to HF

QLoRA (quantize="int8" | "int4" | "nf4"): every Linear of the text decoder, and every
mixture-of-experts projection (`QuantExpertKernel`), keeps its kernel quantized by qwix
(google's JAX quantisation library; per output channel, expert and layer, blocks of `tile`
input rows) and dequantizes it on the fly; only the adapters are trained.

Scanned layers (`Model(scan_layers=True)`): a Linear of the stacked decoder layer holds
kernel [L, D_in, D_out]; its adapters are stacked too (lora_a [L, D_in, r], lora_b [L, r,
D_out], each layer its own initial A), its quantized kernel is quantized layer by layer
(scale [L, D_in / tile, D_out]), and the scan hands each layer its slices. Targets then
match the stacked module's path (`model.layers.self_attn.q_proj`): one adapter site per
projection for all layers.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxvrl.models.interface import Family, family_of
from jaxvrl.models.moe import ExpertKernel

# Where every family keeps its text decoder (LoRA's default targets) and its vision tower.
TEXT_PREFIX = Family.lora_prefix
VISION_PREFIX = Family.vision_prefix


class LoRADropoutKey(nnx.Variable):
    """The dropout key of one adapter, set only on models merged inside the gradient pass."""


class QuantParam(nnx.Param):
    """A frozen quantized weight (QLoRA base): in the params, never in the optimizer."""


QTYPES = ("int8", "int4", "nf4")


class _QuantKernel(nnx.Module):
    """A frozen kernel [..., D_in, D_out] stored quantized (qwix QArray fields: qvalue, scale
    per output channel, leading index (layer, expert) and tile of input rows, zero_point where
    the type has one)."""

    def _store(self, w: jax.Array, qtype: str, tile: int) -> None:
        if qtype not in QTYPES:
            raise ValueError(f"lora.quantize={qtype!r}: expected none or one of {QTYPES}")
        qvalue, scale, zero_point = _quantize(w, qtype, tile)
        self.qvalue = QuantParam(qvalue)
        self.scale = QuantParam(scale)
        self.zero_point = None if zero_point is None else QuantParam(zero_point)
        self.qtype = qtype

    def kernel(self) -> jax.Array:
        """The kernel dequantized, in `param_dtype`."""
        zp = None if self.zero_point is None else self.zero_point[...]
        return dequantize(self.qvalue[...], self.scale[...], zp, self.qtype, self.param_dtype)


class QuantLinear(_QuantKernel):
    """A frozen nnx.Linear whose kernel [D_in, D_out] ([L, D_in, D_out] on stacked layers) is
    stored quantized."""

    def __init__(self, base: nnx.Linear, qtype: str, tile: int = 0):
        self._store(base.kernel[...], qtype, tile)
        self.bias = base.bias
        self.in_features, self.out_features = base.in_features, base.out_features
        self.dtype, self.param_dtype = base.dtype, base.param_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        zp = None if self.zero_point is None else self.zero_point[...]
        bias = None if self.bias is None else self.bias[...]
        return _quant_matmul(
            x.astype(dtype), self.qvalue[...], self.scale[...], zp, bias, self.qtype, dtype
        )

    def to_linear(self, kernel: jax.Array | None = None) -> nnx.Linear:
        """An ordinary nnx.Linear with the dequantized (or the given) kernel (stacked layers:
        a Linear of the stacked layer, kernel [L, D_in, D_out])."""
        lin = nnx.eval_shape(  # no weights initialised: they are set below
            lambda: nnx.Linear(
                self.in_features,
                self.out_features,
                use_bias=self.bias is not None,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                rngs=nnx.Rngs(0),
            )
        )
        lin.kernel = nnx.Param(self.kernel() if kernel is None else kernel)
        if self.bias is not None:
            lin.bias = nnx.Param(self.bias[...])
        return lin


class QuantExpertKernel(_QuantKernel):
    """A frozen `moe.ExpertKernel` whose kernel [E, D_in, D_out] ([L, E, D_in, D_out] on
    stacked layers) is stored quantized; `array` dequantizes it where the experts run."""

    def __init__(self, base: ExpertKernel, qtype: str, tile: int = 0):
        self._store(base.kernel[...], qtype, tile)
        self.param_dtype = base.kernel.dtype

    def array(self, dtype) -> jax.Array:
        return self.kernel().astype(dtype)

    def to_float(self) -> ExpertKernel:
        """An ExpertKernel holding the dequantized kernel."""
        dtype = self.param_dtype
        out = nnx.eval_shape(lambda: ExpertKernel(1, 1, 1, param_dtype=dtype, rngs=nnx.Rngs(0)))
        out.kernel = nnx.Param(self.kernel())  # its only weight, abstract until here
        return out


@functools.partial(jax.jit, static_argnames=("qtype", "tile"))
def _quantize(w: jax.Array, qtype: str, tile: int):
    """(qvalue, scale, zero_point) of kernel w [..., D_in, D_out] by qwix: per output channel
    and leading index, in tiles of `tile` input rows where it divides D_in. Jitted: one
    program per shape, not one per qwix op and shape."""
    import qwix  # optional dependency: only QLoRA needs it

    rows = w.ndim - 2  # the input axis
    din = w.shape[rows]
    tiled = {rows: tile} if tile and din % tile == 0 and din > tile else None
    channels = tuple(a for a in range(w.ndim) if a != rows)
    q = qwix.quantize(w, _qtype(qtype), channelwise_axes=channels, tiled_axes=tiled)
    qvalue = q.qvalue
    if qvalue.dtype == jnp.uint4:  # nf4's codes, kept as int4 bits: checkpoints have no uint4
        qvalue = jax.lax.bitcast_convert_type(qvalue, jnp.int4)
    return qvalue, q.scale, q.zero_point


def _qtype(name: str):
    return {"int8": jnp.int8, "int4": jnp.int4}.get(name, name)


@functools.partial(jax.jit, static_argnames=("qtype", "dtype"))
def dequantize(qvalue, scale, zero_point, qtype: str, dtype):
    """The float kernel of a quantized kernel's stored fields (QuantLinear, QuantExpertKernel)."""
    import qwix

    if qtype == "nf4" and qvalue.dtype != jnp.uint4:  # stored as int4 bits (`_quantize`)
        qvalue = jax.lax.bitcast_convert_type(qvalue, jnp.uint4)
    return qwix.dequantize(qwix.QArray(qvalue, scale, zero_point, _qtype(qtype))).astype(dtype)


def _quant_matmul(x, qvalue, scale, zero_point, bias, qtype: str, dtype):
    """x @ dequantize(kernel) + bias. XLA (CPU, measured) keeps the dequantized float kernels
    live across the passes of the fused step: the step's stored weights shrink, its
    transient peak does not yet (a fused quantized matmul is the next step)."""
    y = x @ dequantize(qvalue, scale, zero_point, qtype, dtype)
    return y if bias is None else y + bias.astype(dtype)


class LoRALinear(nnx.Module):
    """An nnx.Linear with a low-rank update; `base` keeps the original module and weights
    (an nnx.Linear, or a QuantLinear for QLoRA)."""

    def __init__(self, base, rank: int, alpha: float, dropout: float, *, rngs):
        din, dout = base.in_features, base.out_features
        dtype = base.param_dtype
        bound = 1.0 / math.sqrt(din)  # kaiming_uniform(a=sqrt(5)) of a [r, D_in] torch weight
        self.base = base
        self.layers = _stacked_layers(base)  # None, or L of a stacked layer's Linear
        lead = () if self.layers is None else (self.layers,)
        self.lora_a = nnx.LoRAParam(
            jax.random.uniform(rngs.params(), (*lead, din, rank), dtype, -bound, bound)
        )
        self.lora_b = nnx.LoRAParam(jnp.zeros((*lead, rank, dout), dtype))
        self.scale = alpha / rank
        self.dropout = dropout

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base(x)
        h = x
        key = getattr(self, "dropout_key", None)  # set by set_dropout_key in the gradient pass
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key[...], 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(x.dtype)
        dtype = y.dtype
        a = self.lora_a[...].astype(dtype)
        b = self.lora_b[...].astype(dtype)
        return y + (h.astype(dtype) @ a @ b) * jnp.asarray(self.scale, dtype)


def _stacked_layers(base) -> int | None:
    """L for a Linear (or QuantLinear) of stacked layers (a leading layer axis), else None."""
    w = base.qvalue if isinstance(base, QuantLinear) else base.kernel
    return int(w.shape[0]) if len(w.shape) == 3 else None


def _matches(name: str, targets) -> bool:
    """A target is a module name (`q_proj`: the last path part) or a regex over the dotted
    path (`model\\.layers\\.[0-3]\\..*_proj`) matched in full."""
    last = name.rsplit(".", 1)[-1]
    return any(t == last or re.fullmatch(t, name) for t in targets)


def _linears(model: nnx.Module, prefix: str):
    """(parent, attribute, dotted path) of every nnx.Linear under `prefix`."""
    return _sites(model, nnx.Linear, prefix)


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets,
    *,
    prefix: str | None = None,
    seed: int = 0,
    quantize: str = "none",
    quant_tile: int = 128,
) -> list[str]:
    """Wrap, in place, every nnx.Linear under `prefix` (default: the family's text decoder)
    whose name matches one of `targets` by a LoRALinear. Returns the wrapped paths; raises if
    none matched (a typo in the targets). quantize != "none": every Linear and ExpertKernel
    under `prefix` (targets or not) gets a quantized frozen kernel (QLoRA)."""
    if prefix is None:
        prefix = family_of(model).lora_prefix
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(","))
    rngs = nnx.Rngs(params=seed)
    sites = _linears(model, prefix)
    wrapped = [name for _, _, name in sites if _matches(name, targets)]
    if wrapped and quantize != "none":
        for parent, key, _ in sites:
            setattr(parent, key, QuantLinear(getattr(parent, key), quantize, quant_tile))
        for parent, key, _ in _sites(model, ExpertKernel, prefix):
            setattr(parent, key, QuantExpertKernel(getattr(parent, key), quantize, quant_tile))
    for parent, key, name in sites:
        if name in wrapped:
            setattr(parent, key, LoRALinear(getattr(parent, key), rank, alpha, dropout, rngs=rngs))
    if not wrapped:
        names = sorted({n.rsplit(".", 1)[-1] for _, _, n in _linears(model, prefix)})
        paths = sorted(n for _, _, n in _linears(model, prefix))[:3]
        raise ValueError(
            f"lora.target_modules={tuple(targets)} match no Linear; names: {names}, paths "
            f"like {paths} (scanned layers have no layer index in their paths)"
        )
    return wrapped


def lora_modules(model: nnx.Module) -> list[LoRALinear]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, LoRALinear)]


def set_dropout_key(model: nnx.Module, key: jax.Array) -> None:
    """Turn adapter dropout on, with `key` folded per adapter, on a model merged for one pass
    (the no-grad passes and the sampler run without dropout)."""
    for i, m in enumerate(lora_modules(model)):
        k = jax.random.fold_in(key, i)
        if m.layers is not None:  # stacked adapters: one key per layer, sliced by the scan
            k = jax.random.split(k, m.layers)
        m.dropout_key = nnx.data(LoRADropoutKey(k))


def trainable_filter(lora: bool, train_vision: bool = False):
    """What the optimizer sees: every Param, or the adapters (plus the vision tower if asked)."""
    if not lora:
        return nnx.Param
    if train_vision:
        return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, nnx.PathContains(VISION_PREFIX)))
    return nnx.LoRAParam


def split_params(params: nnx.State, filt) -> tuple[nnx.State, nnx.State]:
    """params -> (trainable, frozen) by `filt`; nnx.merge_state puts them back together."""
    return nnx.split_state(params, filt, ...)


def lora_off(params: nnx.State) -> nnx.State:
    """The same weights with every B = 0: exactly the base model (the reference policy) without
    a second copy of the base weights."""
    flat = []
    for path, var in nnx.to_flat_state(params):
        if path[-1] == "lora_b":
            var = var.replace(jnp.zeros_like(var[...]))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def wrapped(model: nnx.Module) -> bool:
    """Whether `model` holds LoRA adapters or quantized layers (what `merge_lora` undoes)."""
    return bool(_sites(model, (LoRALinear, QuantLinear, QuantExpertKernel)))


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with each LoRALinear replaced by its base Linear holding
    W + A B alpha / r (float32 sum, cast back) and every quantized kernel dequantized: an
    ordinary model for save() and sampling."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    for parent, key, _ in _sites(out, (LoRALinear, QuantLinear, QuantExpertKernel)):
        if isinstance(parent, LoRALinear):
            continue  # its base is merged with it below
        mod = getattr(parent, key)
        if isinstance(mod, QuantExpertKernel):
            setattr(parent, key, mod.to_float())
            continue
        if isinstance(mod, QuantLinear):  # a frozen layer without adapter: dequantize
            setattr(parent, key, mod.to_linear())
            continue
        base = mod.base
        w = base.kernel() if isinstance(base, QuantLinear) else base.kernel[...]
        merged = merged_kernel(w, mod.lora_a[...], mod.lora_b[...], mod.scale)
        if isinstance(base, QuantLinear):
            base = base.to_linear(merged)
        else:
            base.kernel[...] = merged
        setattr(parent, key, base)
    return out


def merged_kernel(w, a, b, scale: float) -> jax.Array:
    """W + A B scale for W float[D_in, D_out], A float[D_in, r], B float[r, D_out] (or all
    with a leading layer axis): summed in float32, cast back to W's dtype (merge_lora, and
    the export from a checkpoint)."""
    w, a, b = jnp.asarray(w), jnp.asarray(a), jnp.asarray(b)
    delta = a.astype(jnp.float32) @ b.astype(jnp.float32)
    return (w.astype(jnp.float32) + delta * scale).astype(w.dtype)


def _sites(model: nnx.Module, types, prefix: str = ""):
    """(parent, attribute, dotted path) of every module of `types` under `prefix`."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for key, child in vars(node).items():
                name = ".".join(str(p) for p in (*path, key))
                if isinstance(child, types) and (not prefix or name.startswith(prefix + ".")):
                    out.append((node, key, name))
    return out


def lora_param_count(model: nnx.Module) -> int:
    """Number of adapter weights: sum over wrapped layers of r (D_in + D_out)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
