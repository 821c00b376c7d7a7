"""TPU slices by the names users type (Cloud TPU accelerator types), as abstract devices.

`tpu_devices("v5p-16")` gives the slice's devices from the XLA TPU compiler's topology model
(`jax.experimental.topologies`, needs `libtpu`: `pip install -e '.[tpu]'`), on any host: a
mesh over them compiles real TPU programs without a TPU (`jaxvrl.aot`). `CHIPS` holds each
generation's per-chip figures from Cloud TPU's published specifications.

Naming: v4 and v5p count TensorCores (two per chip: `v5p-16` is 8 chips), v5e (v5litepod) and
v6e count chips. One JAX device is one chip (v4 and v5p run their two cores as one megacore).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip figures: HBM (GiB), dense bf16 peak (TFLOP/s), HBM bandwidth (GB/s)."""

    name: str
    hbm_gib: float
    bf16_tflops: float
    hbm_gbps: float
    cores_in_name: int  # TensorCores per chip counted in the accelerator type's number
    single_host: int  # the most chips one host drives (larger slices: 4 chips per host)


CHIPS = {
    "v4": Chip("TPU v4", 32, 275, 1200, cores_in_name=2, single_host=4),
    "v5e": Chip("TPU v5e", 16, 197, 819, cores_in_name=1, single_host=8),
    "v5p": Chip("TPU v5p", 95, 459, 2765, cores_in_name=2, single_host=4),
    "v6e": Chip("TPU v6e", 32, 918, 1640, cores_in_name=1, single_host=8),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e", "trillium": "v6e"}
# chips -> the slice's torus, for each generation's allowed sizes
_GRID_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_GRID_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its accelerator type, chip generation, chip count and jax topology."""

    name: str  # as typed, normalised: "v5p-16"
    chip: Chip
    chips: int
    topology: str  # jax's topology name, "v5p:2x2x2"

    @property
    def hosts(self) -> int:
        return 1 if self.chips <= self.chip.single_host else self.chips // 4


def known_names() -> list[str]:
    """Every accelerator type this module maps, e.g. for an error message."""
    out = []
    for gen, chip in CHIPS.items():
        grids = _GRID_3D if chip.cores_in_name == 2 else _GRID_2D
        out += [f"{gen}-{n * chip.cores_in_name}" for n in grids]
    return out


def parse(name: str) -> Slice:
    """'v5p-16', 'v5litepod-8', 'v6e-8', 'v4-8' -> Slice. Raises ValueError listing the
    known names for anything else."""
    m = re.fullmatch(r"(v\d+[a-z]*|trillium)-(\d+)", name.strip().lower())
    gen = _ALIASES.get(m.group(1), m.group(1)) if m else None
    chip = CHIPS.get(gen)
    if chip is None or int(m.group(2)) % chip.cores_in_name:
        raise ValueError(f"unknown TPU topology {name!r}; known: {', '.join(known_names())}")
    chips = int(m.group(2)) // chip.cores_in_name
    grids = _GRID_3D if chip.cores_in_name == 2 else _GRID_2D
    if chips not in grids:
        raise ValueError(
            f"{name!r}: {chip.name} slices come with {sorted(grids)} chips; known: "
            f"{', '.join(known_names())}"
        )
    return Slice(f"{gen}-{m.group(2)}", chip, chips, f"{gen}:{grids[chips]}")


def tpu_devices(s: Slice) -> list:
    """The slice's abstract devices (compile-only; `libtpu` must be installed)."""
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - jax always has it
        raise RuntimeError("jax.experimental.topologies is missing from this jax") from e
    # Compile-only devices never touch a chip: without this, libtpu takes a machine-wide lock
    # file (/tmp/libtpu_lockfile) and a second process (another compile, a test worker)
    # fails to load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {}
    if s.chip.cores_in_name == 2:
        kwargs["chip_config_name"] = "megacore"  # one device per chip
    if s.hosts == 1:  # the whole slice on one host (4 chips per host is the default)
        dims = [int(x) for x in s.topology.split(":")[1].split("x")]
        kwargs["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=s.topology, **kwargs)
    except Exception as e:  # no libtpu, or a libtpu that does not know this chip
        raise RuntimeError(
            f"cannot build the {s.name} topology ({s.topology}): {e}. The TPU compiler comes "
            "with libtpu: pip install -e '.[tpu]' (jax[tpu] at the installed jax version)"
        ) from e
    devices = list(desc.devices)
    if len(devices) != s.chips:
        raise RuntimeError(f"{s.topology}: {len(devices)} devices, expected {s.chips} chips")
    return devices


def hbm_bytes(s: Slice) -> int:
    return int(s.chip.hbm_gib * GiB)


def peak_flops(s: Slice) -> float:
    """Dense bf16 FLOP/s of one chip."""
    return s.chip.bf16_tflops * 1e12


def bandwidth(s: Slice) -> float:
    """HBM bytes/s of one chip."""
    return s.chip.hbm_gbps * 1e9


def describe(s: Slice) -> str:
    gb = math.floor(s.chip.hbm_gib)
    return f"{s.name}: {s.chips} x {s.chip.name} ({gb} GiB HBM each), {s.hosts} host(s)"
