"""Matmul FLOPs of an optimized HLO module with its loops counted as often as they run.

XLA's cost analysis (`compiled.cost_analysis()`) prices a while loop's body once, whatever its
trip count: a train step that scans over 4 micro-batches, or a sampler that loops over 1,024
decode steps, is priced as if each loop ran once. This module reads the compiled module's text
and counts the FLOPs of its dot and convolution instructions, multiplying a loop body by its
trip count (the bound of the loop condition's `compare` against a constant, minus the
induction variable's constant start, when both are constants; else 1), so that the cost
model's time can be scaled by how much of the work it left out (`loop_factor`).
"""

from __future__ import annotations

import math
import re

import numpy as np

_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP = re.compile(r"\s*([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^\(?\w+\[([\d,]*)\]")
_PARAM = re.compile(r"%?([\w.\-]+):\s*\w+\[([\d,]*)\]")


def _closing(text: str, i: int) -> int:
    """Index just past the bracket group opening at text[i] ('(' or '{')."""
    pairs = {"(": ")", "{": "}"}
    depth, close = 0, pairs[text[i]]
    for j in range(i, len(text)):
        if text[j] == text[i]:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _instruction(line: str):
    """'%n = f32[2,3]{1,0} dot(%a, %b), ...' -> (name, result type, op, text after '(')."""
    m = _NAME.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":  # a tuple type
        j = _closing(line, i)
    else:
        j = i
        while j < len(line) and line[j] not in " {":
            j += 1
    result = line[i:j]
    if j < len(line) and line[j] == "{":  # its layout
        j = _closing(line, j)
    op = _OP.match(line, j)
    return (m.group(1), result, op.group(1), op.group(2)) if op else None


def _dims(text: str) -> list[int] | None:
    m = _SHAPE.match(text)
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def _operands(rest: str) -> list[str]:
    head = rest.split(")", 1)[0]
    return [a.strip().lstrip("%").split(" ")[-1].lstrip("%") for a in head.split(",") if a.strip()]


def _attr(rest: str, key: str) -> str | None:
    """An attribute's value: a name (`calls=%f`), a word (`direction=LT`), a `{...}` list."""
    m = re.search(r"\b" + key + r"=(\{[^}]*\}|%?[\w.]+(?:-[\w.]+)*)", rest)
    return m.group(1).lstrip("%") if m else None


def _branches(rest: str) -> list[str]:
    """A conditional's branch computations."""
    return re.findall(r"%([\w.\-]+)", _attr(rest, "branch_computations") or "")


def _parse(text: str) -> dict[str, list[tuple]]:
    """computation -> [(name, result text, op, rest)] with parameter shapes as ("param")."""
    comps, cur = {}, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            cur = h.group(1)
            comps[cur] = [(n, f"x[{d}]", "param", "") for n, d in _PARAM.findall(h.group(2))]
            continue
        instr = _instruction(line) if cur else None
        if instr:
            comps[cur].append(instr)
    return comps


def _dot_flops(result: str, op: str, rest: str, shapes: dict) -> float:
    out = _dims(result)
    ops = _operands(rest)
    if out is None or not ops or ops[0] not in shapes:
        return 0.0
    lhs = shapes[ops[0]]
    if op == "dot":
        idx = _attr(rest, "lhs_contracting_dims")
        contract = [int(i) for i in re.findall(r"\d+", idx or "")]
        k = math.prod(lhs[i] for i in contract if i < len(lhs))
        return 2.0 * math.prod(out) * k
    return _conv_flops(out, lhs, rest)


def _window_field(window: str, key: str, n: int) -> list[int]:
    m = re.search(key + r"=([\dx]+)", window)
    return [int(v) for v in m.group(1).split("x")] if m else [1] * n


def _conv_flops(out: list[int], lhs: list[int], rest: str) -> float:
    """A convolution's FLOPs: 2 x the output's batch and feature elements x the lhs features
    per group x, for each spatial dimension, the (output position, window tap) pairs that
    meet the input. Taps that fall on padding or on the holes of a dilated lhs do nothing:
    XLA's TPU compiler writes some matmuls as convolutions whose output dimension is a
    padded window over an input of size 1 (`size=32 pad=31_31`: one tap in 32 meets it; a
    projection to 32 heads), and some gradients and batched matmuls with a dilated lhs."""
    parts = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not parts:
        return 0.0
    lhs_labels, out_labels = parts.group(1), parts.group(3)
    k = math.prod(lhs[i] for i, c in enumerate(lhs_labels) if c == "f" and i < len(lhs))
    groups = int(_attr(rest, "feature_group_count") or 1)
    k //= max(groups, 1)
    flat = math.prod(d for d, c in zip(out, out_labels) if not c.isdigit())
    spatial = sorted(int(c) for c in lhs_labels if c.isdigit())
    if not spatial:
        return 2.0 * flat * k
    window = re.search(r"window=\{([^}]*)\}", rest)
    window = window.group(1) if window else ""
    n = len(spatial)
    size = _window_field(window, "size", n)
    stride = _window_field(window, "stride", n)
    lhs_dilate = _window_field(window, "lhs_dilate", n)
    rhs_dilate = _window_field(window, "rhs_dilate", n)
    pad_m = re.search(r"pad=([\d_x-]+)", window)
    pads = [tuple(int(v) for v in p.split("_")) for p in pad_m.group(1).split("x")] if pad_m else []
    pads = pads or [(0, 0)] * n
    pairs = 1
    for d in spatial:
        size_in = lhs[lhs_labels.index(str(d))]
        size_out = out[out_labels.index(str(d))]
        lo = pads[d][0] if d < len(pads) else 0
        pos = (
            np.arange(size_out)[:, None] * stride[d]
            + np.arange(size[d])[None, :] * rhs_dilate[d]
            - lo
        )
        hit = (pos >= 0) & (pos <= (size_in - 1) * lhs_dilate[d]) & (pos % lhs_dilate[d] == 0)
        pairs *= int(hit.sum())
    return 2.0 * flat * k * pairs


def _step(comps, body: str, index: int) -> int | None:
    """The constant the body adds to tuple element `index` (the induction variable), or None
    where the update is anything else (e.g. advanced by an inner loop)."""
    instrs = comps.get(body, [])
    if not instrs or instrs[-1][2] != "tuple":
        return None
    defs = {n: (r, o, rest) for n, r, o, rest in instrs}
    elems = _operands(instrs[-1][3])
    if index >= len(elems) or elems[index] not in defs:
        return None
    _, op, rest = defs[elems[index]]
    if op != "add":
        return None
    a, b = (_operands(rest) + ["", ""])[:2]
    for x, y in ((a, b), (b, a)):
        while x in defs and defs[x][1] in ("copy", "bitcast"):  # the counter, moved
            x = _operands(defs[x][2])[0]
        if x in defs and defs[x][1] == "get-tuple-element":
            if int(_attr(defs[x][2], "index") or -1) == index:
                return _constant_value(y, defs)
    return None


def _trip_count(comps, cond: str, body: str, init_tuple: list[str], defs: dict) -> int:
    """(bound - start) / step for a loop whose condition compares an induction variable with
    a constant bound, starts it from a constant and adds a constant step in the body; 1 where
    any of them cannot be read (the count is then a lower bound)."""
    consts, gte_index = {}, {}
    for name, _r, op, rest in comps.get(cond, []):
        if op == "constant":
            consts[name] = (
                int(re.match(r"(-?\d+)", rest).group(1)) if re.match(r"-?\d", rest) else None
            )
        elif op == "get-tuple-element":
            gte_index[name] = int(_attr(rest, "index") or 0)
    for _n, _r, op, rest in comps.get(cond, []):
        if op != "compare":
            continue
        a, b = (_operands(rest) + ["", ""])[:2]
        direction = _attr(rest, "direction")
        if b in consts and a in gte_index and direction in ("LT", "LE", "NE"):
            i = gte_index[a]
            step = _step(comps, body, i)
            start = _constant_value(init_tuple[i], defs) if i < len(init_tuple) else None
            if not step or step <= 0 or start is None or consts[b] is None:
                return None
            bound = consts[b] + (1 if direction == "LE" else 0)
            return max(1, -(-(bound - start) // step))
    return None


def _constant_value(name: str, defs: dict):
    seen = 0
    while name in defs and seen < 8:
        result, op, rest = defs[name]
        if op == "constant":
            m = re.match(r"(-?\d+)", rest)
            return int(m.group(1)) if m else None
        if op != "copy":
            return None
        name = _operands(rest)[0]
        seen += 1
    return None


DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
# no work of their own: views, plumbing, the second half of an asynchronous pair
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency",
}  # fmt: skip
_SLICES = ("dynamic-slice", "slice", "gather")


def type_bytes(text: str) -> float:
    """Bytes of an HLO type: an array 'bf16[8,128]' or a tuple of them."""
    return float(
        sum(
            math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[t]
            for t, dims in _ARRAY.findall(text)
            if t in DTYPE_BYTES
        )
    )


def _entry(text: str) -> str | None:
    for line in text.splitlines():
        if line.lstrip().startswith("ENTRY"):
            return _HEADER.match(line).group(1)
    return None


class Module:
    """An optimized HLO module's computations, walked with loop bodies counted once or per
    iteration: matmul FLOPs, and a roofline time (each instruction outside fusions at the
    larger of its FLOPs over the chip's peak and the bytes it reads and writes over the
    chip's HBM bandwidth)."""

    def __init__(self, text: str):
        self.comps = _parse(text)
        self.entry = _entry(text)
        self._fusions: dict = {}

    def _defs(self, comp: str) -> dict:
        return {n: (r, o, rest) for n, r, o, rest in self.comps.get(comp, [])}

    def _fusion(self, callee: str):
        """(bytes read per operand index, or None for the whole operand; bytes written, or
        None for the whole result) of a fused computation: an operand only sliced inside
        is read by its slices, an operand updated in place by a dynamic-update-slice at the
        root is neither read nor written whole."""
        if callee in self._fusions:
            return self._fusions[callee]
        instrs = self.comps.get(callee, [])
        users: dict[str, list] = {}
        index = {}
        for n, r, op, rest in instrs:
            if op == "parameter":
                index[n] = int(re.match(r"\s*(\d+)", rest).group(1))
            for o in dict.fromkeys(_operands(rest)):
                users.setdefault(o, []).append((n, r, op, rest))
        root = instrs[-1][0] if instrs else None
        written = None
        if instrs and instrs[-1][2] == "dynamic-update-slice":
            ops = _operands(instrs[-1][3])
            defs = self._defs(callee)
            written = type_bytes(defs[ops[1]][0]) if len(ops) > 1 and ops[1] in defs else None

        def read(name: str, depth: int = 0):
            total = 0.0
            for n, r, op, rest in users.get(name, []):
                first = (_operands(rest) or [""])[0] == name
                if op in _SLICES and first:
                    total += type_bytes(r)
                elif op == "dynamic-update-slice" and first and n == root:
                    continue
                elif op in ("bitcast", "reshape") and depth < 4:
                    sub = read(n, depth + 1)
                    if sub is None:
                        return None
                    total += sub
                else:
                    return None
            return total

        out = ({i: read(n) for n, i in index.items()}, written)
        self._fusions[callee] = out
        return out

    def _trips(self, comp: str, rest: str, defs: dict, loops: bool, unread: int = 1) -> int:
        """A while loop's trip count (1 without `loops`); `unread` where the program does not
        say it (a loop that runs until a condition on data holds)."""
        if not loops:
            return 1
        body, cond = _attr(rest, "body"), _attr(rest, "condition")
        init = _operands(rest)[0] if _operands(rest) else ""
        tup = _operands(defs[init][2]) if init in defs and defs[init][1] == "tuple" else []
        n = _trip_count(self.comps, cond, body, tup, defs)
        return unread if n is None else n

    def _flops(self, comp: str, loops: bool, memo: dict, depth: int = 0) -> float:
        """Matmul FLOPs of computation `comp` (fusions and calls inside it included), loop
        bodies times their trip count (`loops`) or once."""
        if comp in memo or depth > 64:
            return memo.get(comp, 0.0)
        instrs = self.comps.get(comp, [])
        shapes = {n: (_dims(r) or []) for n, r, _, _ in instrs}
        defs = self._defs(comp)
        flops = 0.0
        for _name, result, op, rest in instrs:
            if op in ("dot", "convolution"):
                flops += _dot_flops(result, op, rest, shapes)
            elif op in ("fusion", "call"):
                callee = _attr(rest, "calls") or _attr(rest, "to_apply")
                if callee:
                    flops += self._flops(callee, loops, memo, depth + 1)
            elif op == "while":
                n = self._trips(comp, rest, defs, loops)
                flops += n * self._flops(_attr(rest, "body"), loops, memo, depth + 1)
            elif op == "conditional":
                flops += max(
                    (self._flops(b, loops, memo, depth + 1) for b in _branches(rest)), default=0.0
                )
        memo[comp] = flops
        return flops

    def flops(self, loops: bool = True) -> float:
        return self._flops(self.entry, loops, {}) if self.entry else 0.0

    def seconds(self, peak: float, bandwidth: float, loops: bool = True, unread: int = 1) -> float:
        memo: dict = {}
        flop_memo: dict = {}  # fused computations' FLOPs (no loops inside a fusion)

        def total(comp: str, depth: int = 0) -> float:
            if comp in memo or depth > 64:
                return memo.get(comp, 0.0)
            instrs = self.comps.get(comp, [])
            shapes = {n: (_dims(r) or []) for n, r, _, _ in instrs}
            defs = self._defs(comp)
            size = {n: type_bytes(r) for n, r, _, _ in instrs}
            secs = 0.0
            for _name, result, op, rest in instrs:
                if op in _FREE or op.endswith("-done"):
                    continue
                ops = [o for o in _operands(rest) if o in size]
                if op == "while":
                    n = self._trips(comp, rest, defs, loops, unread)
                    secs += n * total(_attr(rest, "body"), depth + 1)
                    continue
                if op == "call":
                    secs += total(_attr(rest, "to_apply") or _attr(rest, "calls") or "", depth + 1)
                    continue
                if op == "conditional":
                    secs += max((total(b, depth + 1) for b in _branches(rest)), default=0.0)
                    continue
                flops, moved = 0.0, None
                if op in ("dot", "convolution"):
                    flops = _dot_flops(result, op, rest, shapes)
                elif op == "fusion":
                    callee = _attr(rest, "calls") or ""
                    flops = self._flops(callee, loops, flop_memo)
                    reads, written = self._fusion(callee)
                    moved = written if written is not None else size.get(_name, 0.0)
                    for i, o in enumerate(_operands(rest)):
                        if o in size:
                            r = reads.get(i)
                            moved += size[o] if r is None else min(r, size[o])
                elif op in _SLICES:
                    moved = 2 * size.get(_name, 0.0)
                elif op == "dynamic-update-slice":
                    moved = 2 * (size[ops[1]] if len(ops) > 1 else 0.0)
                elif op in ("copy", "copy-start"):
                    moved = 2 * (size[ops[0]] if ops else 0.0)
                if moved is None:
                    moved = size.get(_name, 0.0) + sum(size[o] for o in ops)
                secs += max(flops / peak, moved / bandwidth)
            memo[comp] = secs
            return secs

        return total(self.entry) if self.entry else 0.0

    def collectives(self, loops: bool = True) -> dict[tuple[str, str], int]:
        """{(op, result array type): times run} of the module's cross-device collectives
        (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute; an
        asynchronous pair counted once), loop bodies times their trip counts (`loops`)."""
        counts: dict[tuple[str, str], int] = {}

        def walk(comp: str, times: int, depth: int = 0) -> None:
            if depth > 64:
                return
            defs = self._defs(comp)
            for _n, result, op, rest in self.comps.get(comp, []):
                kind = op.removesuffix("-start")
                if kind in COLLECTIVES:
                    arrays = _ARRAY.findall(result)
                    # an asynchronous start's tuple holds its operand, then its result
                    t, dims = arrays[-1] if op.endswith("-start") else arrays[0]
                    key = (kind, f"{t}[{dims}]")
                    counts[key] = counts.get(key, 0) + times
                elif op == "while":
                    n = self._trips(comp, rest, defs, loops)
                    walk(_attr(rest, "body"), times * n, depth + 1)
                elif op in ("call", "fusion"):  # a fusion may wrap one (all-reduce-scatter)
                    walk(_attr(rest, "to_apply") or _attr(rest, "calls") or "", times, depth + 1)
                elif op == "conditional":
                    for b in _branches(rest):
                        walk(b, times, depth + 1)

        if self.entry:
            walk(self.entry, 1)
        return counts


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _parsed(module: str | Module) -> Module:
    """An optimized HLO module's text parsed, or a module already parsed (several figures
    read off one module parse it once)."""
    return module if isinstance(module, Module) else Module(module)


def collectives(module: str | Module, loops: bool = True) -> dict[tuple[str, str], int]:
    """{(op, result array type): times run} of an optimized HLO module (`Module.collectives`)."""
    return _parsed(module).collectives(loops)


def matmul_flops(module: str | Module, loops: bool = True) -> float:
    """Dot/convolution FLOPs of the module's entry computation, loop bodies times their trip
    count (`loops`), or once each (`loops=False`, what XLA's cost analysis assumes)."""
    return _parsed(module).flops(loops)


def loop_factor(module: str | Module, peak: float, bandwidth: float, unread: int = 1) -> float:
    """How many times longer the module runs than with each loop body run once (what XLA's
    cost analysis prices), by a roofline over its instructions: each at the larger of its
    FLOPs over `peak` and its HBM bytes over `bandwidth`, loop bodies times their trip count.
    Work outside the loops (an optimizer update, a gather of the LM head) counts once, at its
    own cost, not scaled with the loops' matmuls. A loop whose trip count the program does
    not say (a sampler's decode loop, run until every row ends) counts `unread` times: 1 (the
    default; the factor is then >= 1, and 1 without loops), or 0 to leave such loops out."""
    m = _parsed(module)
    once = m.seconds(peak, bandwidth, loops=False)
    if not once:
        return 1.0
    ratio = m.seconds(peak, bandwidth, unread=unread) / once
    return max(1.0, ratio) if unread else ratio
