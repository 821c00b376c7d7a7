"""Host-side reward functions (docs/algorithms.md#rewards): the built-ins (TRL's signature,
`fn(completions: list[str], **columns) -> list[float]`), loading a user's function, and
`SafeReward`, one function as the run calls it (its forms: jaxvrl/rl/reward_forms.py; its
calls off the main thread: jaxvrl/rl/reward_pool.py)."""

from __future__ import annotations

import ast
import collections
import logging
import math
import re
import threading
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from jaxvrl.config import RESERVED_NAMES, ConfigError, reward_name, reward_names  # noqa: F401
from jaxvrl.plugins import load_function
from jaxvrl.rl.reward_forms import RowInput, call, detect

log = logging.getLogger(__name__)

LETTERS = "ABCDEFGHIJ"
# Full-width Ａ-Ｊ / ａ-ｊ and brackets / colon / period count as their ASCII forms.
_FULL_WIDTH = str.maketrans(
    {
        **{chr(0xFF21 + i): LETTERS[i] for i in range(10)},
        **{chr(0xFF41 + i): LETTERS[i].lower() for i in range(10)},
        "（": "(",
        "）": ")",
        "：": ":",
        "．": ".",
    }
)
# An option letter: a capital A-J not touching other Latin letters, or a lower-case a-j only
# when nothing word-like follows ("answer is a." but not "answer is a cat").
_OPT = r"(?<![A-Za-z])(?:([A-J])(?![A-Za-z])|([a-j])(?=\s*(?:$|[).,;:!?，。、*\]]|</)))"
_OPEN = r"\s*[*_\"'`]*\s*[(\[]?\s*"
# Ordered by how explicit the marker is; the first pattern with a match wins, and within it
# the last match (a model that corrects itself ends with its final choice).
_ANSWER_PATTERNS = [
    re.compile(r"<answer>" + _OPEN + _OPT),
    re.compile(r"\\boxed\{" + _OPEN + _OPT),
    re.compile(r"(?<![A-Za-z])(?i:answer)\s*(?:(?i:is)\s*:?|:)" + _OPEN + _OPT),
    re.compile(r"答案\s*(?:是|为|為|选|選)?\s*:?" + _OPEN + _OPT),
    re.compile(r"选项\s*(?:是|为)?\s*:?" + _OPEN + _OPT),
    re.compile(r"\(\s*([A-J])\s*\)()"),
]
_STANDALONE = re.compile(r"(?<![A-Za-z])([A-J])(?![A-Za-z])")
# "I think", "I'm": the pronoun. "A cat ..." at a sentence start: the article.
_PRONOUN_I = re.compile(r"I(?=\s+[a-z]|'[a-z])")
_SENTENCE_START = re.compile(r"(?:^|[.!?。！？]\s+|\n\s*)$")


def _explicit_choice(text: str) -> str | None:
    for pattern in _ANSWER_PATTERNS:
        found = pattern.findall(text)
        if found:
            upper, lower = found[-1]
            return (upper or lower).upper()
    return None


def _standalone_choice(text: str) -> str | None:
    for match in reversed(list(_STANDALONE.finditer(text))):
        letter, at = match.group(1), match.start()
        if letter == "I" and _PRONOUN_I.match(text, at):
            continue
        if (
            letter == "A"
            and re.match(r"A\s+[a-z]", text[at:])
            and _SENTENCE_START.search(text[:at])
        ):
            continue
        return letter
    return None


def extract_choice(text: str) -> str | None:
    """Option letter A-J of a completion, or None (the mc_idx answer parsing).

    Full-width forms count as ASCII. Searches the text after the last `</think>` first and the
    whole text only when that finds nothing. Explicit markers first, in this order:
    `<answer>X`, `\\boxed{X}`, "Answer: X" / "answer is X" (any case, optional ** / quotes /
    brackets), "答案: X" / "答案：X" / "答案是X", "选项: X", "(X)"; then the last standalone
    capital A-J, skipping the pronoun "I" ("I think") and the article "A" starting a sentence
    ("A cat sat"). Lower-case a-j count only after an explicit marker and when no word follows
    ("answer: b." yes, "the answer is a dog" no): a bare "a" is an article, not an option.
    """
    text = text.translate(_FULL_WIDTH)
    parts = [text.rsplit("</think>", 1)[1], text] if "</think>" in text else [text]
    for part in parts:
        found = _explicit_choice(part) or _standalone_choice(part)
        if found:
            return found
    return None


def _label_letter(label) -> str | None:
    """0-based index (int or digit string) or letter ("B", "b", "Ｂ", "(B)", "B. dog") ->
    "A".."J"."""
    if missing_label(label):
        return None
    if isinstance(label, str):
        label = label.strip().translate(_FULL_WIDTH)
        if label.isdigit():
            return LETTERS[int(label)] if int(label) < len(LETTERS) else None
        found = re.match(r"[(\[]?\s*([A-Ja-j])(?![A-Za-z])", label)
        return found.group(1).upper() if found else None
    idx = int(label)
    return LETTERS[idx] if 0 <= idx < len(LETTERS) else None


def missing_label(label) -> bool:
    """No label: None, or a NaN (a pandas column's empty cell)."""
    return label is None or (isinstance(label, float) and math.isnan(label))


def mc_idx_reward(
    completions: Sequence[str],
    label_idx: Sequence | None = None,
    answer: Sequence | None = None,
    **_,
) -> list[float]:
    """Multiple-choice reward (weight 4.0 in the presets): 1.0 when extract_choice() equals the label (0-based index or
    letter), else 0.0. The label is the row's `label_idx`, else its `answer` (a row with an
    option letter or index in `answer` only, as the evaluation reads it); none gives 0.0."""
    if label_idx is None and answer is None:
        raise ValueError("mc_idx needs a `label_idx` or `answer` column")
    labels = list(label_idx) if label_idx is not None else [None] * len(completions)
    if answer is not None:
        labels = [a if missing_label(lbl) else lbl for lbl, a in zip(labels, answer)]
    if len(labels) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(labels)} labels")
    out = []
    for c, lbl in zip(completions, labels):
        choice, want = extract_choice(c), _label_letter(lbl)
        out.append(float(choice is not None and choice == want))
    return out


_THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.S)


def think_format_reward(completions: Sequence[str], **_) -> list[float]:
    """Format reward (weight 1.0 in the presets): 1.0 when the completion is exactly one
    <think>...</think> block (only whitespace before it) followed by a non-empty answer, else
    0.0."""
    out = []
    for c in completions:
        ok = c.count("<think>") == 1 and c.count("</think>") == 1
        m = _THINK.match(c) if ok else None
        out.append(float(bool(m) and bool(m.group(2).strip())))
    return out


_ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?%?")
_ANSWER_LINE = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*:?|:)|答案\s*(?:是|为)?\s*:?")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return text[i + 1 :]


def marked_answer(text: str) -> str | None:
    """The answer part of a completion or reference, where something marks it: after the
    last </think>, the last <answer>...</answer>, else the last \\boxed{...}, else what
    follows the last "####" (GSM8K's references) or "Answer:" / "answer is" / "答案:" on its
    line; None when nothing marks it."""
    text = text.translate(_FULL_WIDTH).rsplit("</think>", 1)[-1]
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[-1].split("\n", 1)[0]
    marks = list(_ANSWER_LINE.finditer(text))
    if marks:
        return text[marks[-1].end() :].split("\n", 1)[0]
    return None


def answer_span(text: str) -> str:
    """`marked_answer`, else the whole text after the last </think>."""
    marked = marked_answer(text)
    return text.translate(_FULL_WIDTH).rsplit("</think>", 1)[-1] if marked is None else marked


def last_number(text: str) -> str | None:
    """The last number written in `text` (1,234.5 / -3 / 50% / 1/4), or None."""
    found = _NUMBER.findall(text.translate(_FULL_WIDTH))
    return found[-1] if found else None


def _normalise(s: str) -> str:
    """Lower case, no LaTeX text wrappers / $ / trailing punctuation, single spaces."""
    s = s.strip().lower()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"[$*`]", "", s)
    s = re.sub(r"[\s\.,;:!?\"']+", " ", s)
    return s.strip()


_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,234.5: its commas group digits
_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_INTEGER = re.compile(r"[-+]?\d+")
# words only (no digits, no LaTeX): compared as text, never as products of one-letter symbols
_WORDS = re.compile(r"[^\W\d_]+(?:[\s'’-]+[^\W\d_]+)*[.!?]?")


def _plain(s: str) -> str:
    """A number's text without $, a trailing full stop, % and digit-grouping commas."""
    s = s.strip().replace("$", "").replace("\u2212", "-").rstrip(".").strip()
    s = s.rstrip("%").strip()
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def _as_number(s: str) -> float | None:
    """A plain number (1,234.5 / -3 / 50% / 1/4 / 2.5e3), else None: a comma that does not
    group digits in threes ("3,5": a list, a decimal comma) or a word (inf, nan) is none."""
    pct = s.strip().rstrip(".").strip().endswith("%")
    s = _plain(s)
    fraction = _FRACTION.fullmatch(s)
    if fraction:
        num, den = map(int, fraction.groups())
        if den == 0:
            return None
        value = num / den
    elif _DECIMAL.fullmatch(s):
        value = float(s)
    else:
        return None
    return value / 100 if pct else value


def _match(pred: str, ref: str) -> bool:
    """Numbers: equal when both are integers, else within 1e-6 (relative above 1); otherwise
    normalised text."""
    a, b = _as_number(pred), _as_number(ref)
    if a is not None and b is not None:
        p, r = _plain(pred), _plain(ref)
        if _INTEGER.fullmatch(p) and _INTEGER.fullmatch(r) and "%" not in pred + ref:
            return int(p) == int(r)
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return _normalise(pred) == _normalise(ref)


def _for_math_verify(text: str, reference: bool = False) -> str:
    """What math_verify parses: a marked answer (`marked_answer`) as one LaTeX expression,
    else a reference as one, else the completion's text after the last </think>."""
    marked = marked_answer(text)
    if marked is None and reference and "$" not in text:
        marked = text
    return text.rsplit("</think>", 1)[-1] if marked is None else f"${marked.strip()}$"


def accuracy_reward(
    completions: Sequence[str],
    answer: Sequence[str] | None = None,
    solution: Sequence[str] | None = None,
    **_,
) -> list[float]:
    """1.0 when the completion's answer_span matches the reference's (column `answer`, else
    `solution`): math_verify's parse/verify (LaTeX, fractions, sets, \\boxed{}) when
    installed and it says equal (on the marked answers, `_for_math_verify`; answers of words
    alone are compared as text); otherwise numeric equality (integers exactly, other numbers
    within 1e-6, relative above 1; "50%" = 0.5, "1/4" = 0.25, "1,000" = 1000 but "3,5" is no
    number) or normalised string equality; a
    completion whose answer nothing marks, against a numeric reference, is read by its last
    number (a model answering in prose)."""
    refs = answer if answer is not None else solution
    if refs is None:
        raise ValueError("accuracy_reward needs an `answer` or `solution` column")
    try:
        from math_verify import parse, verify  # type: ignore
    except ImportError:
        parse = verify = None
    out = []
    for c, ref in zip(completions, refs):
        if ref is None:
            out.append(0.0)
            continue
        pred, gold = answer_span(c), answer_span(str(ref))
        ok = False
        words = _WORDS.fullmatch(pred.strip()) and _WORDS.fullmatch(gold.strip())
        if verify is not None and not words:
            # its own timeouts use SIGALRM, which works on the main thread only; elsewhere the
            # reward pool's timeout bounds the call
            main = threading.current_thread() is threading.main_thread()
            limit = {"parsing_timeout": 5} if main else {"parsing_timeout": None}
            try:
                gold_p = parse(_for_math_verify(str(ref), reference=True), **limit)
                pred_p = parse(_for_math_verify(c), **limit)
                ok = bool(verify(gold_p, pred_p, timeout_seconds=5 if main else None))
            except Exception:  # noqa: BLE001 -- math_verify failing means: compare as text
                ok = False
        ok = ok or _match(pred, gold)
        if not ok and marked_answer(c) is None and _as_number(gold) is not None:
            last = last_number(pred)
            ok = last is not None and _match(last, gold)
        out.append(float(ok))
    return out


def mdi_reward(
    completions: Sequence[str], mdi: Sequence | None = None, mdi_balance_ratio=2.0, **_
) -> list[float]:
    """MDI balance reward (weight 1.0 in configs/mdi.py): 2 * clip(1 - |ln MDI| / ln R, 0, 1)
    - 1 per row, R = mdi_balance_ratio (-1 at MDI = 0); 0 (neutral) for rows without
    statistics (None, NaN, MDI < 0) and for every row when the column is absent (e.g. a
    sampler without attention statistics)."""
    if mdi is None:
        return [0.0] * len(completions)
    out = []
    for v in mdi:
        if v is None or not np.isfinite(v) or v < 0:
            out.append(0.0)
            continue
        far = math.inf if v == 0 else abs(math.log(v))
        bal = min(max(1.0 - far / math.log(mdi_balance_ratio), 0.0), 1.0)
        out.append(2.0 * bal - 1.0)
    return out


BUILTIN = {
    "mc_idx": mc_idx_reward,
    "think_format": think_format_reward,
    "accuracy": accuracy_reward,
    "mdi": mdi_reward,
}
for _fn in BUILTIN.values():  # they read completions as texts, conversational data or not
    _fn.plain_completions = True


# the function a reward file named without one provides: verl's custom_reward_function.name
# default, then EasyR1's
DEFAULT_FUNCTIONS = ("compute_score", "main")


def load_reward_fn(spec: str) -> Callable:
    """A built-in name, `package.module:function`, `path/to/file.py:function` or
    `path/to/file.py` (its `compute_score`, else its `main`)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec and not spec.endswith(".py"):
        raise ValueError(
            f"reward {spec!r}: use a built-in name {sorted(BUILTIN)}, 'module:function', "
            "'path.py:function' or 'path.py'"
        )
    return load_function(spec, "reward", DEFAULT_FUNCTIONS)


def reward_kwargs_error(text) -> str | None:
    """Why `reward.kwargs` is not a Python dict literal with string keys, or None."""
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError) as e:
        return f"not a Python literal ({e})"
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return "not a dict with string keys"
    return None


def reward_kwargs(text: str, names, specs) -> dict[str, dict]:
    """`reward.kwargs` -> {reward name: its keyword arguments}: a key that is a reward's name
    (or spec) with a dict value goes to that reward, any other key to every reward."""
    value = ast.literal_eval(text) if isinstance(text, str) else dict(text)
    targets = {**dict(zip(specs, names)), **{n: n for n in names}}
    common = {k: v for k, v in value.items() if not (k in targets and isinstance(v, dict))}
    out = {n: dict(common) for n in names}
    for k, v in value.items():
        if k in targets and isinstance(v, dict):
            out[targets[k]].update(v)
    return out


def unused_reward_kwargs(text, rewards: dict) -> str | None:
    """Why a key of `reward.kwargs` would reach no function, or None: a common key that no
    reward's signature names (nor a user function's `**kwargs` takes; the built-in rewards'
    `**kwargs` are dataset columns), or a key under one reward's name that it does not take.
    rewards: {name: SafeReward}."""
    value = ast.literal_eval(text) if isinstance(text, str) else dict(text)
    by_spec = {r.spec: n for n, r in rewards.items()}

    def takes(r, key) -> bool:
        return key in r.form.params or (r.form.var_kw and r.spec not in BUILTIN)

    def params(r) -> str:
        return f"{r.name} takes {', '.join(sorted(r.form.params)) or 'nothing'}"

    for key, v in value.items():
        own = key if key in rewards else by_spec.get(key)
        if own is not None and isinstance(v, dict):
            r = rewards[own]
            for k in v:
                if not takes(r, k):
                    return f"{k!r} under {key!r}: reward {own} ({r.spec}) has no such parameter ({params(r)})"
        elif not any(takes(r, key) for r in rewards.values()):
            return (
                f"{key!r} is a parameter of no reward function "
                f"({'; '.join(params(r) for r in rewards.values())}); under a reward's name, "
                "a dict of its own keywords"
            )
    return None


class RewardFailing(ConfigError):
    """A reward function failed on more than reward.max_failure_fraction of its calls over
    the last reward.failure_window steps: the run saves and ends (one `error:` line, exit 2)."""


class RewardTally:
    """What a reward's calls did: `failures`, `timeouts` over the run, this step's calls and
    failed calls, the last steps' for `failing`; the first failure logged as one line naming
    the reward (`name`, `spec`), the error and how it is called (`how`); `remedy`: what the
    user can do when it fails too often."""

    def __init__(self, name: str, spec: str, how: str, remedy: str):
        self.name, self.spec, self.how, self.remedy = name, spec, how, remedy
        self.failures = self.timeouts = 0
        self.step_calls = [0, 0]  # this step's calls, failed calls
        self.history: collections.deque = collections.deque()  # earlier steps' [calls, failed]
        self._logged = False

    def record(self, error: str | None = None, trace: str = "", timed_out: bool = False) -> None:
        """Count one call; `error` (one line) when it failed."""
        self.step_calls[0] += 1
        if error is None:
            return
        self.step_calls[1] += 1
        self.failures += 1
        self.timeouts += int(timed_out)
        if not self._logged:
            self._logged = True
            log.error("%s; its rows score 0", self.describe_failure(error))
            if trace:
                log.debug("reward %s traceback:\n%s", self.name, trace)

    def describe_failure(self, error: str) -> str:
        return f"reward {self.name} ({self.spec}) failed: {error} (called in the {self.how})"

    def end_step(self, window: int) -> None:
        """Close the step's tally; keep the last `window` steps'."""
        self.history.append(self.step_calls)
        while len(self.history) > window:
            self.history.popleft()
        self.step_calls = [0, 0]

    def failing(self, fraction: float, window: int) -> str | None:
        """Why the run must end, when over the last `window` steps (all of them run) more than
        `fraction` of this reward's calls failed; else None."""
        calls = sum(c for c, _ in self.history)
        failed = sum(f for _, f in self.history)
        if len(self.history) < window or not calls or failed <= fraction * calls:
            return None
        return (
            f"reward {self.name} ({self.spec}) failed on {failed} of its {calls} calls over the "
            f"last {window} steps, more than config.reward.max_failure_fraction={fraction:g} "
            f"(config.reward.failure_window={window}); it is called in the {self.how}. "
            f"{self.remedy}"
        )


class SafeReward(RewardTally):
    """One reward function as the run calls it: its name, spec (`module:function`, for the
    workers), form (`reward_forms.detect`), keyword arguments, and what its calls did.

    A call that raises, times out, returns the wrong count or non-finite values scores 0 for
    its rows and counts in `failures` (`timeouts`: those past reward.timeout_s or whose worker
    died); the first failure is logged as one line naming the function, the error and the form
    it was called in (its traceback at debug level). Per step the calls and failures are kept
    for `failing`. Calling the object scores completions in-process (no timeout) with columns
    as keywords (lists: one value per completion)."""

    def __init__(self, name: str, fn: Callable, spec: str | None = None, kwargs=None):
        self.name, self.fn, self.spec = name, fn, spec or name
        self.form = detect(fn)
        self.kwargs = dict(kwargs or {})
        unfilled = self.form.unfilled(self.kwargs)
        if unfilled:  # every call would raise: say so before the run starts
            example = ", ".join(f"'{p}': ..." for p in unfilled)
            raise TypeError(
                f"reward {self.spec} ({self.form.kind} form): {', '.join(unfilled)} "
                f"{'has' if len(unfilled) == 1 else 'have'} no default and no value in "
                f"reward.kwargs; set {'it' if len(unfilled) == 1 else 'them'} there, e.g. "
                f'--config.reward.kwargs="{{{example}}}"'
            )
        super().__init__(
            name,
            self.spec,
            self.form.describe(),
            "Fix the function (its first failure is logged above) or remove it from "
            "config.reward.funcs",
        )

    def __call__(self, completions: Sequence[str], **columns) -> np.ndarray:
        n = len(completions)
        lists = {k: v for k, v in columns.items() if _per_row(v, n)}
        constants = {k: v for k, v in columns.items() if k not in lists}
        rows = [
            RowInput("", c, 0, None, {k: v[i] for k, v in lists.items()})
            for i, c in enumerate(completions)
        ]
        try:
            vals = np.asarray(
                [v for v, _ in call(self.fn, self.form, rows, self.kwargs, constants)]
            )
        except Exception as e:  # noqa: BLE001 -- a user reward must never stop training
            self.record(f"{type(e).__name__}: {e}", traceback.format_exc())
            return np.zeros(n)
        finite = np.isfinite(vals)
        self.record(None if finite.all() else f"returned non-finite values {vals[~finite][:3]}")
        return np.where(finite, vals, 0.0)


def _per_row(value, n: int) -> bool:
    return isinstance(value, list | tuple | np.ndarray) and len(value) == n


def total_reward(
    rewards: dict[str, SafeReward], weights: dict[str, float], completions, **columns
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """sum_k weight_k * reward_k, and each reward's raw values."""
    parts = {name: fn(completions, **columns) for name, fn in rewards.items()}
    return weighted_total(parts, weights, len(completions)), parts


def weighted_total(values: dict[str, np.ndarray], weights: dict[str, float], n: int) -> np.ndarray:
    """float64[n]: sum_k weight_k * values_k (a reward without a weight weighs 1)."""
    total = np.zeros(n)
    for name, vals in values.items():
        total += weights.get(name, 1.0) * vals
    return total
