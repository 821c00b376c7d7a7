"""CPU kernels for decode steps, built on first use (XLA FFI custom calls, `decode_kernels.cc`).

- `rows_by_weight(buf, x, N, offset)` = x @ w.T for float32 w [N, K] and a few rows x [M, K]:
  the weights, packed once per set of parameters into panels of 8 rows at their offsets of
  one flat buffer (`pack_into`, in place, so that the sampler's caller reuses one buffer from
  call to call rather than faulting in fresh pages for a copy of the weights every call; see
  `decode.prepare`), are streamed once
  per step with software prefetch, split between the caller and XLA's intra-op threads.
  XLA's own CPU dot reads such weights at about half the memory bandwidth, and a decode step
  is little else (bench/RESULTS.md).
- `categorical_pick(logits, u, suppress, temperature)`: a draw from softmax(logits /
  temperature) outside `suppress` by inverse CDF with one uniform number per row, and its
  log-prob, in three passes (XLA: ~3.5 ms per step at B = 8, V = 152k).
- `decode_attention(q, keys, values, mask, scale)`: a decode step's attention over the cache
  (the model's masked softmax), where XLA's CPU backend spends ~4 us per cached position
  and layer at B = 8.
- `greedy_pick(logits, suppress)`: each row's first maximum outside `suppress` and its
  log-prob under the full softmax, in two vectorised passes (XLA: ~3 ms at B = 8, V = 152k).

The shared library is compiled with the host's C++ compiler (`$CXX`, default g++) against
jaxlib's FFI headers, `-march=native`, into `$JAXVRL_CACHE/kernels` (default
`~/.cache/jaxvrl/kernels`), keyed by the source, jaxlib's version, the compiler and the CPU.
Nothing is downloaded. Where it cannot be built (no compiler, a read-only cache) a warning says
why, once, and callers fall back to XLA; `JAXVRL_CPU_KERNELS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxvrl.parallel import sharding

_SOURCE = Path(__file__).with_name("decode_kernels.cc")
# FFI target name -> exported handler symbol
_TARGETS = {
    "jaxvrl_rows_by_weight": "JaxvrlRowsByWeight",
    "jaxvrl_pack_rows": "JaxvrlPackRows",
    "jaxvrl_pack_columns": "JaxvrlPackColumns",
    "jaxvrl_empty": "JaxvrlEmpty",
    "jaxvrl_greedy_pick": "JaxvrlGreedyPick",
    "jaxvrl_categorical_pick": "JaxvrlCategoricalPick",
    "jaxvrl_decode_attention": "JaxvrlDecodeAttention",
}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# Above this many rows XLA's dot (a real GEMM, weights reused across row blocks) is used.
MAX_ROWS = 32


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    # the same root as the remote-checkpoint cache (jaxvrl/remote.py)
    root = os.environ.get("JAXVRL_CACHE", os.path.expanduser("~/.cache/jaxvrl"))
    return Path(root) / "kernels"


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it already compiled); returns the shared library's path.
    Raises OSError or subprocess.CalledProcessError (with the compiler's output) on failure."""
    import jaxlib

    cxx = os.environ.get("CXX", "g++")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, jaxlib.__version__.encode(), cxx.encode(), " ".join(_FLAGS).encode()]
            + [_cpu_signature().encode(), platform.machine().encode()]
        )
    ).hexdigest()[:20]
    out_dir = out_dir or _cache_dir()
    lib = out_dir / f"decode_kernels-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, lib)  # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


@functools.cache
def _library():
    """The kernels' library, built, loaded and registered with XLA once per process (XLA keeps
    one handler per target name for the life of the process), or None where it cannot be
    built or loaded (a warning says why)."""
    if os.environ.get("JAXVRL_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in _TARGETS.items():
            handler = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, handler, platform="cpu")
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        warnings.warn(
            f"jaxvrl: the CPU decode kernels {_SOURCE.name} could not be built or loaded, "
            f"decode steps use XLA instead (set JAXVRL_CPU_KERNELS=0 to silence): "
            f"{detail.strip()[-2000:]}",
            stacklevel=3,
        )
        return None
    return lib


def available() -> bool:
    """Whether the kernels can run here (builds, loads and registers them on first use)."""
    return _library() is not None


PANEL = 8  # output columns per packed panel (kPanel in decode_kernels.cc)


def _call(target: str, out, **kw):
    """jax.ffi.ffi_call for one of the kernels, after making sure they are registered."""
    if not available():
        raise RuntimeError(f"jaxvrl: {target} needs the CPU decode kernels, which are not built")
    return jax.ffi.ffi_call(target, out, **kw)


def usable() -> bool:
    """Whether the kernels can run in the program being traced: compiled for one CPU device
    (no sharded operands; the mesh in context decides, see `sharding.target_platform`) and
    the kernels built."""
    one_cpu = sharding.target_platform() == "cpu" and sharding.target_device_count() == 1
    return one_cpu and available()


def applies(rows: int, dtype) -> bool:
    """Whether decode steps with `rows` rows of `dtype` use `rows_by_weight`: `usable()`,
    float32, at most MAX_ROWS rows."""
    return jnp.dtype(dtype) == jnp.float32 and rows <= MAX_ROWS and usable()


def packed_size(n: int, k: int) -> int:
    """Floats that a weight of n rows of k takes packed: ceil(n / 8) panels of [k, 8]."""
    return -(-n // PANEL) * PANEL * k


def empty(size: int) -> jax.Array:
    """float32 [size], uninitialised (nothing is written): a buffer to pack into."""
    return _call("jaxvrl_empty", jax.ShapeDtypeStruct((size,), jnp.float32))()


def pack_into(buf: jax.Array, w: jax.Array, offset: int, *, columns: bool = False) -> jax.Array:
    """`buf` float32 [S] with w packed at `offset`: panels [ceil(N / 8), K, 8] (zero rows pad
    N) of w [N, K], or of w [K, N] (an nnx.Linear kernel) with `columns`, without the
    transpose. In place: where `buf` is not used afterwards (donated, or made inside the same
    program) XLA writes into it rather than into a copy."""
    k, n = w.shape if columns else w.shape[::-1]
    if buf.ndim != 1 or offset < 0 or offset + packed_size(n, k) > buf.shape[0]:
        raise ValueError(f"pack_into: {w.shape} at {offset} does not fit in {buf.shape}")
    target = "jaxvrl_pack_columns" if columns else "jaxvrl_pack_rows"
    call = _call(target, jax.ShapeDtypeStruct(buf.shape, jnp.float32), input_output_aliases={0: 0})
    return call(buf, w.astype(jnp.float32), offset=np.int64(offset))


def pack(w_rows: jax.Array) -> jax.Array:
    """[N, K] weight rows -> the kernel's layout on their own, flat float32 [packed_size]."""
    n, k = w_rows.shape
    return pack_into(empty(packed_size(n, k)), w_rows, 0)


def rows_by_weight(buf: jax.Array, x: jax.Array, n: int, offset: int = 0) -> jax.Array:
    """float32 [M, n] = x [M, K] @ w.T for w [n, K] packed at `offset` of `buf` (`pack_into`;
    check `applies`)."""
    if buf.ndim != 1 or x.ndim != 2 or offset + packed_size(n, x.shape[1]) > buf.shape[0]:
        raise ValueError(
            f"rows_by_weight: no packed [{n}, {x.shape[-1]}] weight at {offset} of {buf.shape}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return _call("jaxvrl_rows_by_weight", out)(buf, x.astype(jnp.float32), offset=np.int64(offset))


def greedy_pick(logits: jax.Array, suppress=()) -> tuple[jax.Array, jax.Array]:
    """(int32[B], float32[B]): each row's first maximum among the ids not in `suppress`, and
    its log-prob under softmax over all V logits (the suppressed ones included), like
    `rules.first_argmax` on the suppressed logits and `rules.token_logprob` on all of them.
    float32 logits [B, V] (check `available`)."""
    b = logits.shape[0]
    out = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32))
    ids = jnp.asarray(tuple(suppress), jnp.int32).reshape(-1)
    return _call("jaxvrl_greedy_pick", out)(logits.astype(jnp.float32), ids)


def categorical_pick(logits, uniform, suppress=(), temperature: float = 1.0):
    """(int32[B], float32[B]): per row, a draw from softmax(logits / temperature) over the ids
    not in `suppress` by inverse CDF with that row's uniform number in [0, 1) (block masses,
    then the chosen block's entries, summed in double: `rules.categorical`'s method), and its
    log-prob under softmax(logits / temperature) over all V entries, the suppressed ones
    included (`rules.token_logprob`). float32 logits [B, V], uniform [B]; temperature > 0
    (check `usable`)."""
    if not temperature > 0:
        raise ValueError(f"categorical_pick: temperature must be > 0, got {temperature}")
    b = logits.shape[0]
    out = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32))
    ids = jnp.asarray(tuple(suppress), jnp.int32).reshape(-1)
    call = _call("jaxvrl_categorical_pick", out)
    u = jnp.asarray(uniform, jnp.float32).reshape(b)
    return call(logits.astype(jnp.float32), u, ids, temperature=np.float32(temperature))


def decode_attention(q, keys, values, mask, scale: float) -> jax.Array:
    """float32 [B, K, G, H]: one query per row over the KV cache, like the model's masked
    softmax attention: q [B, K, G, H] (G query heads per kv head), keys [B, K, H, S], values
    [B, K, S, H], mask bool [B, S]; a fully masked row gives zeros (check `usable`)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    f32 = jnp.float32
    call = _call("jaxvrl_decode_attention", out)
    return call(
        q.astype(f32),
        keys.astype(f32),
        values.astype(f32),
        mask.astype(bool),
        scale=np.float32(scale),
    )
