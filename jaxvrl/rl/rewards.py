"""Host-side reward functions (SPEC section 6). Signature like TRL:
`fn(completions: list[str], **columns) -> list[float]`."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
import traceback
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

LETTERS = "ABCDEFGHIJ"
_FULL_WIDTH = str.maketrans({chr(0xFF21 + i): LETTERS[i] for i in range(10)})
_L = r"([A-J])"
# Ordered by how explicit the marker is; the first pattern with a match wins, last match in it.
_ANSWER_PATTERNS = [
    re.compile(r"<answer>\s*\(?" + _L + r"\)?[^<]*</answer>", re.I),
    re.compile(r"answer\s*(?:is|:)\s*\(?" + _L + r"\b\)?", re.I),
    re.compile(r"答案\s*(?:是|为)?\s*[:：]?\s*[(（]?" + _L + r"(?![A-Za-z])"),
    re.compile(r"选项\s*[:：]?\s*[(（]?" + _L + r"(?![A-Za-z])"),
    re.compile(r"\(" + _L + r"\)"),
]
_STANDALONE = re.compile(r"(?<![A-Za-z])" + _L + r"(?![A-Za-z])")


def extract_choice(text: str) -> str | None:
    """Option letter A-J from a completion, or None.

    Looks after the last `</think>` when there is one; tries explicit markers ("Answer: X",
    "answer is X", "答案: X", "选项: X", "(X)", "<answer>X</answer>"), then the last standalone
    capital letter A-J. Full-width Ａ-Ｊ count as A-J. Lower-case letters count only after an
    explicit marker (a bare "a" is an article, not an option).
    """
    text = text.translate(_FULL_WIDTH)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    for pattern in _ANSWER_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    found = _STANDALONE.findall(text)
    return found[-1] if found else None


def _label_letter(label) -> str | None:
    if label is None or (isinstance(label, float) and math.isnan(label)):
        return None
    if isinstance(label, str):
        label = label.strip().translate(_FULL_WIDTH).upper()
        if label.isdigit():
            return LETTERS[int(label)] if int(label) < len(LETTERS) else None
        return label[:1] if label[:1] in LETTERS else None
    idx = int(label)
    return LETTERS[idx] if 0 <= idx < len(LETTERS) else None


def mc_idx_reward(completions: Sequence[str], label_idx: Sequence, **_) -> list[float]:
    """1.0 when the extracted option letter equals the label (0-based index or letter)."""
    return [
        float(extract_choice(c) is not None and extract_choice(c) == _label_letter(lbl))
        for c, lbl in zip(completions, label_idx)
    ]


_THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.S)


def think_format_reward(completions: Sequence[str], **_) -> list[float]:
    """1.0 for exactly one <think>...</think> block followed by a non-empty answer."""
    out = []
    for c in completions:
        ok = c.count("<think>") == 1 and c.count("</think>") == 1
        m = _THINK.match(c) if ok else None
        out.append(float(bool(m) and bool(m.group(2).strip())))
    return out


def _normalise(s: str) -> str:
    s = s.strip().lower()
    s = re.sub(r"<answer>|</answer>|\\boxed\{|\}|\$", " ", s)
    s = re.sub(r"[\s\.,;:!?\"'`]+", " ", s)
    return s.strip()


def _as_number(s: str):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def accuracy_reward(
    completions: Sequence[str],
    answer: Sequence[str] | None = None,
    solution: Sequence[str] | None = None,
    **_,
) -> list[float]:
    """1.0 if the completion's answer matches: math_verify when installed, else normalised
    string equality or numeric equality (rel. 1e-6) of the text after </think>."""
    refs = answer if answer is not None else solution
    if refs is None:
        raise ValueError("accuracy_reward needs an `answer` or `solution` column")
    try:
        from math_verify import parse, verify  # type: ignore
    except ImportError:
        parse = verify = None
    out = []
    for c, ref in zip(completions, refs):
        text = c.rsplit("</think>", 1)[-1]
        if verify is not None:
            try:
                out.append(float(verify(parse(str(ref)), parse(text))))
                continue
            except Exception:  # noqa: BLE001 -- fall back to string match
                pass
        a, b = _normalise(text), _normalise(str(ref))
        na, nb = _as_number(text.strip().rstrip(".")), _as_number(str(ref).strip())
        if na is not None and nb is not None:
            out.append(float(abs(na - nb) <= 1e-6 * max(1.0, abs(nb))))
        else:
            out.append(float(a == b))
    return out


def mdi_reward(
    completions: Sequence[str], mdi: Sequence | None = None, mdi_balance_ratio=2.0, **_
) -> list[float]:
    """Seed 000: 2 * clip(1 - |ln MDI| / ln R, 0, 1) - 1 per row; 0 without statistics."""
    if mdi is None:
        return [0.0] * len(completions)
    out = []
    for v in mdi:
        if v is None or not np.isfinite(v) or v <= 0:
            out.append(0.0)
            continue
        bal = min(max(1.0 - abs(math.log(v)) / math.log(mdi_balance_ratio), 0.0), 1.0)
        out.append(2.0 * bal - 1.0)
    return out


BUILTIN = {
    "mc_idx": mc_idx_reward,
    "think_format": think_format_reward,
    "accuracy": accuracy_reward,
    "mdi": mdi_reward,
}


def load_reward_fn(spec: str) -> Callable:
    """A built-in name, `package.module:function` or `path/to/file.py:function`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward {spec!r}: use a built-in name {sorted(BUILTIN)}, 'module:function' or "
            "'path.py:function'"
        )
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise FileNotFoundError(f"reward {spec!r}: file {target} not found")
        mod_spec = importlib.util.spec_from_file_location(
            f"jaxvrl_user_reward_{abs(hash(target))}", target
        )
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    if not hasattr(module, name):
        raise AttributeError(f"reward {spec!r}: {target} has no function {name!r}")
    return getattr(module, name)


class SafeReward:
    """Calls a reward function; if it raises or returns the wrong length or non-finite values,
    that call yields zeros, the traceback is logged once per function, and `failures` counts
    it. Training never stops because of a reward."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn
        self.failures = 0
        self._logged = False

    def __call__(self, completions: Sequence[str], **columns) -> np.ndarray:
        try:
            vals = np.asarray(self.fn(list(completions), **columns), np.float64)
            if vals.shape != (len(completions),):
                raise ValueError(f"returned shape {vals.shape}, expected ({len(completions)},)")
            return np.where(np.isfinite(vals), vals, 0.0)
        except Exception:  # noqa: BLE001 -- a user reward must never stop training
            self.failures += 1
            if not self._logged:
                log.error(
                    "reward %s failed; it gives 0 for this batch:\n%s",
                    self.name,
                    traceback.format_exc(),
                )
                self._logged = True
            return np.zeros(len(completions))


def total_reward(
    rewards: dict[str, SafeReward], weights: dict[str, float], completions, **columns
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """sum_k weight_k * reward_k, and each reward's raw values."""
    parts = {name: fn(completions, **columns) for name, fn in rewards.items()}
    total = np.zeros(len(completions))
    for name, vals in parts.items():
        total += weights.get(name, 1.0) * vals
    return total, parts
