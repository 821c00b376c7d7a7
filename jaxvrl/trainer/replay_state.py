"""The replay buffer's groups as bytes for the checkpoint (jaxvrl/checkpoint.py keeps each
process's bytes in the step directory), bit exact: numpy arrays, numpy scalars and bytes go
into one .npz as raw arrays (no pickle, no base64); dicts, lists, tuples, str, int, float,
bool, None and `Group`s go into a JSON skeleton stored beside them that points at the arrays.
A PIL image (a row's in-memory image reference, as the built-in tasks make them) is kept as its
PNG bytes, which read back to the same mode, size and pixels.
"""

from __future__ import annotations

import dataclasses
import io
import json

import ml_dtypes
import numpy as np
from PIL import Image

from jaxvrl import rl
from jaxvrl.trainer.partial import Flight
from jaxvrl.trainer.rollout import Group

FORMAT = 1
# the payload types a buffer (or partial rollouts' carried rows) may hold, by name
_DATACLASSES = {"Group": Group, "Flight": Flight}


class _Writer:
    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def put(self, a: np.ndarray) -> int:
        self.arrays[f"a{len(self.arrays)}"] = a
        return len(self.arrays) - 1

    def encode(self, x):
        """x -> its JSON skeleton node: a JSON scalar as itself, anything else a tagged dict
        (so a dict in the skeleton is always a tag, never the payload's own dict)."""
        if isinstance(x, np.ndarray):
            if x.dtype == object:  # .npz would pickle it: element by element instead
                return {"t": "objects", "shape": list(x.shape), "v": list(map(self.encode, x.flat))}
            if x.dtype.isbuiltin == 2:  # ml_dtypes (bfloat16, ...): .npz would keep only void
                raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
                return {
                    "t": "ml_array",
                    "i": self.put(raw),
                    "dtype": x.dtype.name,
                    "shape": x.shape,
                }
            return {"t": "array", "i": self.put(x)}
        if isinstance(x, np.generic):  # before str/float: np.str_ and np.float64 subclass them
            return {"t": "scalar", "v": self.encode(np.asarray(x))}
        if x is None or isinstance(x, bool | int | str):
            return x
        if isinstance(x, float):  # the JSON text of a float reads back to the same float
            return x
        if isinstance(x, bytes | bytearray):
            kind = "bytes" if isinstance(x, bytes) else "bytearray"
            return {"t": kind, "i": self.put(np.frombuffer(bytes(x), np.uint8))}
        if isinstance(x, list | tuple):
            return {"t": type(x).__name__, "v": [self.encode(v) for v in x]}
        if isinstance(x, dict):
            return {"t": "dict", "v": [[self.encode(k), self.encode(v)] for k, v in x.items()]}
        if isinstance(x, Image.Image):
            png = io.BytesIO()
            x.save(png, "PNG")
            return {"t": "png", "i": self.put(np.frombuffer(png.getvalue(), np.uint8))}
        name = type(x).__name__
        if dataclasses.is_dataclass(x) and _DATACLASSES.get(name) is type(x):
            fields = {f.name: self.encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return {"t": "dataclass", "name": name, "v": fields}
        raise TypeError(f"the replay buffer's checkpoint cannot hold a {type(x).__qualname__}")


def _decode(node, arrays):
    if not isinstance(node, dict):
        return node
    t = node["t"]
    if t == "array":
        return arrays[f"a{node['i']}"]
    if t == "ml_array":
        dtype = np.dtype(getattr(ml_dtypes, node["dtype"]))
        raw = arrays[f"a{node['i']}"].tobytes()
        return np.frombuffer(raw, dtype).reshape(node["shape"]).copy()
    if t == "scalar":
        return _decode(node["v"], arrays)[()]
    if t in ("bytes", "bytearray"):
        raw = arrays[f"a{node['i']}"].tobytes()
        return raw if t == "bytes" else bytearray(raw)
    if t == "png":
        image = Image.open(io.BytesIO(arrays[f"a{node['i']}"].tobytes()))
        image.load()
        return image
    if t == "objects":
        out = np.empty(len(node["v"]), object)
        out[:] = [_decode(v, arrays) for v in node["v"]]
        return out.reshape(node["shape"])
    if t in ("list", "tuple"):
        items = [_decode(v, arrays) for v in node["v"]]
        return items if t == "list" else tuple(items)
    if t == "dict":
        return {_decode(k, arrays): _decode(v, arrays) for k, v in node["v"]}
    if t == "dataclass":
        fields = {k: _decode(v, arrays) for k, v in node["v"].items()}
        return _DATACLASSES[node["name"]](**fields)
    raise ValueError(f"unknown node {t!r} in a saved replay buffer")


def encode_items(items: list) -> bytes:
    """A list of payloads (e.g. the buffer's groups, oldest first) -> .npz bytes."""
    w = _Writer()
    skeleton = {"format": FORMAT, "items": [w.encode(x) for x in items]}
    text = json.dumps(skeleton, allow_nan=True).encode()
    buf = io.BytesIO()
    np.savez(buf, skeleton=np.frombuffer(text, np.uint8), **w.arrays)
    return buf.getvalue()


def decode_items(data: bytes) -> list:
    """encode_items' bytes -> the payloads, equal in type, dtype, shape and bits."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    skeleton = json.loads(arrays.pop("skeleton").tobytes())
    if skeleton.get("format") != FORMAT:
        raise ValueError(f"saved replay buffer format {skeleton.get('format')}, expected {FORMAT}")
    return [_decode(x, arrays) for x in skeleton["items"]]


def save_buffer(buffer: rl.ReplayBuffer) -> bytes:
    return encode_items(buffer.contents())


def load_buffer(buffer: rl.ReplayBuffer, data: bytes) -> None:
    buffer.load(decode_items(data))
