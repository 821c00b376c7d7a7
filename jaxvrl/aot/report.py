"""Per-device figures of a compiled program: HBM, the XLA cost model's FLOPs and time (scaled
for loops, see `cost_model.py`), MFU, the largest arrays; and how `python -m jaxvrl.aot` prints
them."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re

import numpy as np

from jaxvrl.aot.cost_model import (
    DTYPE_BYTES,
    Module,
    collectives,
    loop_factor,
    matmul_flops,
    type_bytes,
)

GiB = 2**30
FIT_FRACTION = 1.0  # of HBM; the compiler's own figures already include its reserves
KNOBS = (
    "mesh.fsdp (split parameters and optimizer state over more chips)",
    "model.remat_policy=full (recompute activations in the backward pass)",
    "optim.micro_batches (fewer rows per forward/backward; above 1 the gradients are summed "
    "in a float32 copy of the parameters' share per chip, which 1 does not hold)",
    "mesh.sequence (every row's tokens split over more chips, taken from fsdp: long rows)",
    "rollout.max_new_tokens / data.max_prompt_length (shorter rows)",
    "actor.offload_optimizer=true (the optimizer state in host memory, streamed through the "
    "chips a layer at a time in the update)",
    "model.remat_policy=offload (as full, with each layer's saved input in host memory)",
)


def knobs(c, mesh) -> list[str]:
    """The KNOBS that config `c` on the train step's `mesh` has not used up: no remat knob
    when model.remat_policy is full, no offload knob when it is on, no sequence knob when the
    sequence axis has every chip; a larger slice instead of
    mesh.fsdp when no chip is left on the data axis (every chip already holds a share of the
    state)."""
    out = []
    for k in KNOBS:
        if k.startswith("model.remat_policy=full") and c.model.remat_policy in ("full", "offload"):
            continue
        if k.startswith("model.remat_policy=offload") and c.model.remat_policy == "offload":
            continue
        if k.startswith("actor.offload_optimizer") and c.actor.offload_optimizer:
            continue
        if k.startswith("mesh.sequence") and mesh.shape.get("fsdp", 1) * mesh.shape["data"] == 1:
            continue  # no chip left to take
        if k.startswith("mesh.fsdp") and mesh.shape["data"] == 1:
            k = "a larger slice (every chip already holds a share of the parameters and optimizer)"
        out.append(k)
    return out


@dataclasses.dataclass
class Report:
    """One compiled program's figures, per device."""

    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    hbm_bytes: int
    flops: float  # XLA cost model, per device
    bytes_accessed: float
    optimal_s: float | None  # the cost model's time; None where it cannot price the program
    # the cost model's time (or, unpriced, the roofline max(flops / peak, bytes / bandwidth))
    # times loop_factor
    estimate_s: float
    model_flops: float  # per device: 6 (train) or 2 (sampling) x params x tokens / devices
    mfu: float
    largest: list  # [(shape, bytes, op)], the five largest arrays the program materialises
    breakdown: dict  # argument bytes per device by part (params, optimizer, batch, ...)
    bound_s: float | None = None  # decode step: weights + cache bytes over HBM bandwidth
    error: str | None = None  # the compiler's refusal (out of HBM)
    # the program's time with loop bodies run as often as they do over its time with each run
    # once (what XLA's cost analysis prices: micro-batches, scanned layers, decode steps), by
    # a roofline over its instructions (`cost_model.loop_factor`)
    loop_factor: float = 1.0
    matmul_flops: float = 0.0  # per device, loops counted
    decode_steps: int = 0  # sampler: estimate = prefill + this many decode steps
    # cross-device collectives the program runs, loops counted: {op: [times, bytes moved]}
    # (bytes: each one's result, per device)
    collectives: dict = dataclasses.field(default_factory=dict)
    # the estimate with loops whose trip count the program does not say left out (the
    # sampler's decode loop: what remains is its prefill)
    fixed_s: float = 0.0
    # sampler: its prefill, one decode step (the decode_step program's estimate) and that
    # step's HBM-bandwidth bound; estimate_s = prefill_s + decode_steps x decode_step_s
    prefill_s: float | None = None
    decode_step_s: float | None = None
    decode_bound_s: float | None = None
    # the compiler's own peak of HBM per device (`peak_memory_in_bytes`: arguments and the
    # buffers its heap packing keeps alive at once, less arguments in host memory:
    # `_device_peak`); 0 where it reports none
    compiler_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """HBM per device: the compiler's peak where it reports one, else arguments + outputs
        not aliased to them + temporaries. On TPUs the two differ where the temporaries XLA
        reports (`temp_size_in_bytes`) are more than its heap holds at once: the 7B tprl step
        at 4,096 tokens with splash reports 17.4 GiB of temporaries and a peak of 23.3 GiB
        (11.6 GiB of them temporaries, what its buffer assignment allocates)."""
        if self.compiler_peak_bytes > 0:
            return self.compiler_peak_bytes
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def peak_temp_bytes(self) -> int:
        """Temporaries alive at the peak: the peak less arguments and unaliased outputs."""
        return self.peak_bytes - self.argument_bytes - self.output_bytes + self.alias_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= FIT_FRACTION * self.hbm_bytes

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, peak_temp_bytes=self.peak_temp_bytes, fits=self.fits)
        d["largest"] = [{"shape": s, "bytes": b, "op": o} for s, b, o in self.largest]
        return d


# ----------------------------------------------------------------------------- analysis
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\w+)\[([\d,]*)\][^ ]*\s+([\w\-]+)\(")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_NO_BUFFER = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"}


def largest_arrays(hlo_text: str, k: int = 5) -> list[tuple[str, int, str]]:
    """The k largest arrays an optimized HLO module materialises: instruction results outside
    fusion bodies (a fusion's insides live in registers/VMEM), parameters and views left out.
    Returns [(shape like 'f32[1,4,7,4096,4096]', bytes, op)], largest first, one per shape."""
    fused = set()
    for line in hlo_text.splitlines():
        if " fusion(" in line:
            fused.update(_CALLS.findall(line))
    out, comp = {}, None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            comp = h.group(1)
            continue
        if comp in fused:
            continue
        m = _INSTR.match(line)
        if not m or m.group(3) in _NO_BUFFER or m.group(1) not in DTYPE_BYTES:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = int(math.prod(dims) * DTYPE_BYTES[m.group(1)])
        shape = f"{m.group(1)}[{m.group(2)}]"
        if size > out.get(shape, (0, ""))[0]:
            out[shape] = (size, m.group(3))
    ranked = sorted(out.items(), key=lambda kv: -kv[1][0])[:k]
    return [(shape, size, op) for shape, (size, op) in ranked]


_ALLOC = re.compile(r"^allocation \d+: size (\d+)(.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ ([^ >]+)[^>]*> \(size=(\d+),offset=\d+\): (\w+\[[\d,]*\])")


def temporaries_from_dump(dump_dir: str, k: int = 5) -> list[tuple[str, int, str]]:
    """The k largest temporaries of a compile, from the buffer assignment XLA dumps with
    `xla_dump_to` (written for a program that ran out of memory too): values held in HBM
    allocations that are not parameters or constants. [(shape, bytes, instruction)]."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt")))
    if not files:
        return []
    out, skip = {}, True
    with open(files[-1]) as f:
        for line in f:
            a = _ALLOC.match(line)
            if a:
                attrs = a.group(2)
                skip = any(w in attrs for w in ("parameter", "constant", "color "))
                continue
            v = None if skip else _VALUE.match(line)
            if v:
                shape, size = v.group(3), int(v.group(2))
                if size > out.get(shape, (0, ""))[0]:
                    out[shape] = (size, v.group(1))
    ranked = sorted(out.items(), key=lambda kv: -kv[1][0])[:k]
    return [(shape, size, name) for shape, (size, name) in ranked]


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize if shape else 0
    return int(total)


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def out_of_memory(name, error: str, compile_s, chip_slice, model_flops, breakdown, largest):
    """A Report for a program the compiler refused for lack of HBM: the temporaries it asked
    for (from its message) and the largest of them (`temporaries_from_dump`)."""
    from jaxvrl.parallel import topology

    m = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", error)
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = int(float(m.group(1)) * scale[m.group(2)]) if m else 0
    args = sum(v for k, v in breakdown.items() if not k.startswith("host:"))  # HBM only
    return Report(
        name=name,
        compile_s=compile_s,
        argument_bytes=args,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=max(temp, topology.hbm_bytes(chip_slice) - args + 1),
        code_bytes=0,
        hbm_bytes=topology.hbm_bytes(chip_slice),
        flops=0.0,
        bytes_accessed=0.0,
        optimal_s=None,
        estimate_s=0.0,
        model_flops=model_flops,
        mfu=0.0,
        largest=largest,
        breakdown=breakdown,
        error=error.strip().splitlines()[0][:500],
    )


def analyse(name, compiled, compile_s, chip_slice, model_flops, breakdown, bound_s=None):
    """A Report from a compiled program (per-device figures); the largest arrays are read
    from its optimized HLO."""
    from jaxvrl.parallel import topology

    mem = compiled.memory_analysis()
    cost = _cost(compiled)
    text = compiled.as_text()
    module = Module(text)  # parsed once for the figures below
    # XLA prices each loop body once: scale its time by the loops' trip counts
    peak, bandwidth = topology.peak_flops(chip_slice), topology.bandwidth(chip_slice)
    factor = loop_factor(module, peak, bandwidth)
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    optimal = float(cost.get("optimal_seconds", -1.0))
    roofline = max(flops / peak, accessed / bandwidth)
    once = optimal if optimal > 0 else roofline
    estimate = factor * once
    mfu = model_flops / (estimate * peak) if estimate > 0 else 0.0
    return Report(
        name=name,
        compile_s=compile_s,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        compiler_peak_bytes=_device_peak(mem),
        code_bytes=int(mem.generated_code_size_in_bytes),
        hbm_bytes=topology.hbm_bytes(chip_slice),
        flops=flops,
        bytes_accessed=accessed,
        optimal_s=optimal if optimal > 0 else None,
        estimate_s=estimate,
        model_flops=model_flops,
        mfu=mfu,
        largest=largest_arrays(text),
        loop_factor=factor,
        matmul_flops=matmul_flops(module),
        collectives=collectives_by_op(module),
        fixed_s=once * loop_factor(module, peak, bandwidth, unread=0),
        breakdown=breakdown,
        bound_s=bound_s,
    )


def collectives_by_op(module: str | Module) -> dict:
    """{op: [times run, bytes of their results]} of an optimized HLO module, loops counted."""
    out: dict = {}
    for (op, shape), n in sorted(collectives(module).items()):
        times, moved = out.get(op, (0, 0))
        out[op] = [times + n, int(moved + n * type_bytes(shape))]
    return out


def with_decode_steps(sampler: Report, decode: Report, steps: int, chip_slice) -> Report:
    """The sampler's time as its prefill plus `steps` decode steps: the decode loop runs
    until every row ends, a trip count the program does not say, so the sampler's program is
    priced without it (`fixed_s`: the prefill) and each decode step at the decode step
    program's own estimate (every row running to max_new_tokens: the worst case)."""
    from jaxvrl.parallel import topology

    estimate = sampler.fixed_s + steps * decode.estimate_s
    mfu = (
        sampler.model_flops / (estimate * topology.peak_flops(chip_slice)) if estimate > 0 else 0.0
    )
    return dataclasses.replace(
        sampler,
        estimate_s=estimate,
        mfu=mfu,
        decode_steps=steps,
        prefill_s=sampler.fixed_s,
        decode_step_s=decode.estimate_s,
        decode_bound_s=decode.bound_s,
    )


# ----------------------------------------------------------------------------- printing
def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def format_report(r: Report) -> str:
    if r.error:
        big = "; ".join(f"{s} {_gib(b)} ({o})" for s, b, o in r.largest)
        return (
            f"{r.name}: DOES NOT FIT (compiler gave up after {r.compile_s:.1f} s): {r.error}\n"
            f"  arguments per device {_gib(r.argument_bytes)} ("
            + ", ".join(f"{k} {_gib(v)}" for k, v in r.breakdown.items() if v)
            + f"); largest temporaries: {big or 'not reported'}"
        )
    lines = [f"{r.name}: compiled in {r.compile_s:.1f} s"]
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in r.breakdown.items() if v)
    lines.append(
        f"  HBM per device: {_gib(r.peak_bytes)} of {_gib(r.hbm_bytes)} "
        f"({'fits' if r.fits else 'DOES NOT FIT'}): arguments {_gib(r.argument_bytes)}"
        f"{f' ({parts})' if parts else ''}, temporaries {_gib(r.peak_temp_bytes)} at the peak "
        f"({_gib(r.temp_bytes)} reported), outputs "
        f"{_gib(r.output_bytes)}, aliased {_gib(r.alias_bytes)}"
    )
    how = "cost model" if r.optimal_s else "roofline of FLOPs and bytes: unpriced by the cost model"
    lines.append(
        f"  XLA cost analysis (each loop body once): {r.flops:.3e} FLOPs, "
        f"{r.bytes_accessed:.3e} bytes accessed per device; with loops counted: matmul FLOPs "
        f"{r.matmul_flops:.3e}, time {r.loop_factor:.2f}x (roofline per instruction)"
    )
    if r.decode_steps:
        how = (
            f"prefill {r.prefill_s * 1e3:.2f} ms, plus {r.decode_steps} decode steps at "
            f"decode_step's estimate {r.decode_step_s * 1e3:.2f} ms"
        )
    else:
        how = f"{how}, times {r.loop_factor:.2f}"
    lines.append(f"  estimated {r.estimate_s * 1e3:.2f} ms ({how})")
    lines.append(
        f"  model FLOPs per device {r.model_flops:.3e}: MFU {100 * r.mfu:.1f}% at that estimate"
    )
    if r.bound_s is not None:
        lines.append(
            f"  HBM-bandwidth bound (weights + KV cache read once): {r.bound_s * 1e3:.3f} ms; "
            f"estimate / bound = {r.estimate_s / r.bound_s:.2f}"
        )
    if r.collectives:
        runs = ", ".join(f"{op} {n} x ({_gib(b)})" for op, (n, b) in r.collectives.items())
        lines.append(f"  collectives run (loops counted; bytes of their results): {runs}")
    big = "; ".join(f"{s} {_gib(b)} ({o})" for s, b, o in r.largest)
    lines.append(f"  largest arrays: {big}")
    return "\n".join(lines)


def _device_peak(mem) -> int:
    """The compiler's peak less the arguments it holds in host memory (the offloaded optimizer
    state or reference weights), which its `peak_memory_in_bytes` counts with the devices'
    (the 7B tprl step on v5e-8 with the optimizer offloaded reports 22.19 GiB and compiles on
    16 GiB chips: 7.73 GiB of it are the host's); 0 where it reports none."""
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    return max(peak - int(getattr(mem, "host_argument_size_in_bytes", 0) or 0), 0) if peak else 0
