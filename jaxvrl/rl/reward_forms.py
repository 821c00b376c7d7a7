"""Reward functions as their users write them, recognised by signature (no wrapper), and one
call of each form on a list of rows. Pure Python (no jax): the reward workers import it.

Forms (`detect`):
- trl: `fn(completions, **columns) -> list[float]` (TRL's GRPOTrainer) on a batch, by keyword:
  `completions`, `prompts`, `completion_ids` (EOS included), `trainer_state`, the columns.
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)` per row
  (verl's reward managers), -> a float or a dict with `score` (other keys: sub-scores).
- verl_batch: `compute_score(data_sources, solution_strs, ground_truths, extra_infos)` on a
  batch (verl's batch reward manager), -> a list of such values.
- scorer: `compute_score(predict_str, ground_truth, ...)` per row, the completion and the label
  by position (verl's built-in scorers, EasyR1's first reward functions); `extra_info` and
  `data_source` by keyword when named; -> a float or a dict with `score` or `overall`.
- easyr1_batch: `compute_score(reward_inputs: list[dict]) -> list[dict]` (EasyR1's
  `REWARD_TYPE = "batch"`, its default), each dict with `overall` plus sub-scores.
- easyr1_sequential: `compute_score(reward_input: dict) -> dict` (`REWARD_TYPE =
  "sequential"`), per row; easyr1_lists: `compute_score(predicts, ground_truths)` (its
  earlier batch form), the completions and the labels as two lists.
- data_dict: `reward_function(data_dict) -> (reward, metrics)` per row; data_dict holds
  `prompt`, `response`, `ground_truth`, `images` and the row's columns.
`async def` functions (or ones returning an awaitable) are awaited. Keyword arguments
(`reward.kwargs`) go to the functions whose signature takes them; `Form.unfilled` names the
parameters without a default that neither the form nor those fill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math

TRL, VERL, VERL_BATCH, SCORER, EASYR1_BATCH, EASYR1_SEQUENTIAL, EASYR1_LISTS, DATA_DICT = (
    "trl",
    "verl",
    "verl_batch",
    "scorer",
    "easyr1_batch",
    "easyr1_sequential",
    "easyr1_lists",
    "data_dict",
)
PER_ROW = (VERL, SCORER, EASYR1_SEQUENTIAL, DATA_DICT)
_CALLS = {
    TRL: "fn(completions=[...], prompts=[...], **columns) on a batch",
    VERL: "fn(data_source, solution_str, ground_truth, extra_info) per row",
    VERL_BATCH: "fn(data_sources, solution_strs, ground_truths, extra_infos) on a batch",
    SCORER: "fn(completion, ground_truth, extra_info=..., data_source=...) per row",
    EASYR1_BATCH: "fn(reward_inputs: list[dict]) on a batch (EasyR1 REWARD_TYPE='batch')",
    EASYR1_SEQUENTIAL: "fn(reward_input: dict) per row (EasyR1 REWARD_TYPE='sequential')",
    EASYR1_LISTS: "fn(predicts, ground_truths) on a batch (EasyR1's earlier batch form)",
    DATA_DICT: "fn(data_dict) -> (reward, metrics) per row",
}
# the main value of a dict result, by form (the other numeric keys are sub-scores)
_MAIN = {
    VERL: ("score",),
    VERL_BATCH: ("score",),
    EASYR1_BATCH: ("overall",),
    EASYR1_SEQUENTIAL: ("overall",),
    EASYR1_LISTS: ("overall",),
}
_MAIN_ANY = ("score", "overall", "reward")
# the keywords a form's call passes, and how many leading parameters it fills by position
_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_SCORER_KEYWORDS = ("extra_info", "data_source")
_FILLED = {
    VERL: _VERL_ARGS,
    VERL_BATCH: tuple(f"{a}s" for a in _VERL_ARGS),
    SCORER: _SCORER_KEYWORDS,
}
_BY_POSITION = {SCORER: 2, EASYR1_BATCH: 1, EASYR1_SEQUENTIAL: 1, EASYR1_LISTS: 2, DATA_DICT: 1}
# the keywords TRL's GRPOTrainer passes every reward function besides the dataset's columns
_TRL_KEYWORDS = ("prompts", "completion_ids", "trainer_state")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a TRL-form reward reads of `trainer_state` (TRL passes its Trainer's state):
    global_step, the updates made before this batch; max_steps, the run's total_steps."""

    global_step: int = 0
    max_steps: int = 0


class RewardFormError(TypeError):
    """A result that the form's users could not have meant (wrong count, wrong type)."""


@dataclasses.dataclass(frozen=True)
class Form:
    """How jaxvrl calls one reward function: `kind` (one of the module's form names), whether
    it is async, the parameter names it declares and whether it takes **kwargs."""

    kind: str
    is_async: bool = False
    params: frozenset = frozenset()
    var_kw: bool = True
    positional: str | None = None  # trl: the completions' parameter when not `completions`
    required: tuple = ()  # the parameters without a default, in order

    @property
    def per_row(self) -> bool:
        return self.kind in PER_ROW

    @property
    def takes_images(self) -> bool:
        """Whether its calls carry the rows' PIL images (loading them costs time)."""
        return self.kind == DATA_DICT or (self.kind == TRL and "images" in self.params)

    def describe(self) -> str:
        return f"{self.kind} form, {'awaited ' if self.is_async else ''}{_CALLS[self.kind]}"

    def unfilled(self, kwargs: dict) -> list[str]:
        """The parameters without a default that neither the form's call nor `kwargs`
        (reward.kwargs) fills. The trl form's are taken to be dataset columns (not known
        before the data is read): none."""
        if self.kind == TRL:
            return []
        by_position = self.required[: _BY_POSITION.get(self.kind, 0)]
        filled = {*_FILLED.get(self.kind, ()), *kwargs, *by_position}
        return [p for p in self.required if p not in filled]

    def accepted(self, kwargs: dict) -> dict:
        """The keyword arguments of `kwargs` its signature takes."""
        return (
            dict(kwargs) if self.var_kw else {k: v for k, v in kwargs.items() if k in self.params}
        )


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C functions have none
        return None


def detect(fn) -> Form:
    """The form of `fn` by its parameter names, arity and its module's `REWARD_TYPE`:
    `solution_str` -> verl; `solution_strs` -> verl_batch; `completions` or `completion_ids`
    (or **kwargs with `prompts` / `trainer_state`) -> trl;
    `REWARD_TYPE` batch or sequential -> EasyR1's; a first parameter named `reward_inputs` /
    `reward_input` / `data_dict` -> that form; one other parameter and **kwargs -> trl
    (completions passed by position); one parameter alone -> easyr1_batch (EasyR1's default
    type); two or more, the second `ground_truth` -> scorer, `ground_truths` -> easyr1_lists
    (before `REWARD_TYPE`). Raises TypeError for a signature no form fits."""
    target = inspect.unwrap(fn)
    is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        type(target).__call__  # an object whose __call__ is async
    )
    sig = _signature(fn)
    if sig is None:
        return Form(TRL, is_async)
    ps = list(sig.parameters.values())
    names = frozenset(p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    var_kw = any(p.kind == p.VAR_KEYWORD for p in ps)
    form = _form_of(names, var_kw, ps, _reward_type(fn))
    if form is None:
        raise TypeError(
            f"reward function {_name(fn)}{sig}: no reward form fits its parameters; expected "
            + "; ".join(_CALLS.values())
        )
    positional = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_position = form == TRL and "completions" not in names and bool(positional)
    by_position = by_position and positional[0] not in _TRL_KEYWORDS
    required = tuple(
        p.name
        for p in ps
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    first = positional[0] if by_position else None
    return Form(form, is_async, names, var_kw, first, required)


def _form_of(names, var_kw, ps, reward_type) -> str | None:
    """The form name for parameter `names` (see `detect`), or None."""
    positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    required = [p for p in positional if p.default is p.empty]
    if "solution_str" in names:
        return VERL
    if "solution_strs" in names:
        return VERL_BATCH
    if "completions" in names or "completion_ids" in names:
        return TRL
    if var_kw and names & set(_TRL_KEYWORDS):  # fn(prompts, trainer_state, **kwargs)
        return TRL
    if len(positional) >= 2 and positional[1].name == "ground_truths":
        return EASYR1_LISTS  # fn(predicts, ground_truths, ...)
    if isinstance(reward_type, str) and reward_type.lower() in ("batch", "sequential"):
        return EASYR1_BATCH if reward_type.lower() == "batch" else EASYR1_SEQUENTIAL
    by_name = {"reward_inputs": EASYR1_BATCH, "reward_input": EASYR1_SEQUENTIAL}
    if first in (*by_name, "data_dict"):
        return by_name.get(first, DATA_DICT)
    if var_kw and len(required) <= 1:  # fn(completions_under_another_name, **columns)
        return TRL
    if len(required) == 1:
        return EASYR1_BATCH
    if len(positional) >= 2 and positional[1].name == "ground_truth":
        return SCORER  # fn(predict_str, ground_truth, ...)
    return None


def _reward_type(fn):
    """The `REWARD_TYPE` of the module that defines `fn` (its globals: a file loaded by path
    is in no sys.modules entry)."""
    target = inspect.unwrap(getattr(fn, "func", fn))  # functools.partial: its function
    return getattr(target, "__globals__", {}).get("REWARD_TYPE")


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclasses.dataclass
class RowInput:
    """What a reward sees of one completion: the rendered prompt, the completion, its length
    in tokens, the label (ground truth), the row's columns (every column of the dataset row,
    plus per-row rollout statistics such as `mdi`), its PIL images (None unless the form
    takes images) and its token ids (None where the caller has only texts)."""

    prompt: str
    response: str
    response_length: int
    ground_truth: object
    columns: dict
    images: list | None = None
    response_ids: list | None = None


def _resolve(value):
    if inspect.isawaitable(value):

        async def wait():
            return await value

        return asyncio.run(wait())
    return value


def _number(value, what: str) -> float:
    if value is None:  # a function that fell through without its return
        raise RewardFormError(f"{what} is None (a missing return?), expected a number")
    if isinstance(value, bool | int | float) or hasattr(value, "__float__"):
        return float(value)
    raise RewardFormError(f"{what} is {type(value).__name__} {value!r:.80}, expected a number")


def _extras(d: dict, skip) -> dict:
    """The numeric entries of a result dict but its main value (sub-scores, metrics)."""
    out = {}
    for k, v in d.items():
        if k in skip or v is None or isinstance(v, str):
            continue
        try:
            out[str(k)] = _number(v, str(k))
        except RewardFormError:
            continue  # verl's extra info may hold anything: only numbers are metrics
    return out


def score_of(value, kind: str) -> tuple[float, dict]:
    """One row's result -> (reward, {sub-score or metric: value})."""
    if value is None and kind == TRL:  # TRL: None = this reward does not apply to the row
        return 0.0, {}
    if isinstance(value, dict):
        for key in _MAIN.get(kind, _MAIN_ANY):
            if key in value:
                return _number(value[key], key), _extras(value, {key})
        want = " or ".join(repr(k) for k in _MAIN.get(kind, _MAIN_ANY))
        raise RewardFormError(f"returned a dict without {want}: keys {sorted(map(str, value))}")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict | type(None)):
        return _number(value[0], "the reward"), _extras(value[1] or {}, ())
    return _number(value, "the result"), {}


def _trl_kwargs(fn, form: Form, rows: list[RowInput], kwargs: dict, constants: dict) -> dict:
    """The trl form's arguments. For a conversational dataset (every row's `prompt` a list of
    chat messages), as TRL passes them there: each completion [{"role": "assistant",
    "content": text}], each prompt its messages (functions marked `plain_completions`, the
    built-in rewards, keep the texts)."""
    keys = dict.fromkeys(k for r in rows for k in r.columns)
    cols = {k: [r.columns.get(k) for r in rows] for k in keys}
    cols.update(constants)
    chat = not getattr(fn, "plain_completions", False) and _conversational(rows)
    cols["prompts"] = [list(r.columns["prompt"]) if chat else r.prompt for r in rows]
    if form.takes_images:
        cols["images"] = [r.images or [] for r in rows]
    if rows and all(r.response_ids is not None for r in rows):
        cols["completion_ids"] = [list(r.response_ids) for r in rows]
    cols.update(kwargs)
    cols = form.accepted(cols)
    cols.pop(form.positional, None)
    if form.var_kw or form.positional or "completions" in form.params:
        cols["completions"] = [
            [{"role": "assistant", "content": r.response}] if chat else r.response for r in rows
        ]
    return cols


def is_messages(value) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _conversational(rows: list[RowInput]) -> bool:
    """Rows whose `prompt` column is a list of chat messages (TRL's conversational datasets,
    verl's layout)."""
    return bool(rows) and all(is_messages(r.columns.get("prompt")) for r in rows)


def _row_dict(r: RowInput, kind: str) -> dict:
    """EasyR1's reward_input (response, response_length, ground_truth) and the design
    document's data_dict (prompt, response, ground_truth, images), each with the row's
    columns besides."""
    d = dict(r.columns)
    d.update(prompt=r.prompt, response=r.response, ground_truth=r.ground_truth)
    if kind == DATA_DICT:
        d["images"] = r.images or []
    else:
        d["response_length"] = r.response_length
    return d


def _verl_args(r: RowInput) -> dict:
    """verl's arguments for one row: data_source ("" when the row has none), solution_str,
    ground_truth, extra_info (a copy; {} when the row has none)."""
    extra = r.columns.get("extra_info")
    return {
        "data_source": r.columns.get("data_source") or "",
        "solution_str": r.response,
        "ground_truth": r.ground_truth,
        "extra_info": dict(extra) if isinstance(extra, dict) else ({} if extra is None else extra),
    }


def _keyword_call(fn, form: Form, args: dict, kwargs: dict, *positional):
    """fn(*positional, the form's `args` and the reward.kwargs not among them, each where its
    signature takes it)."""
    more = form.accepted({k: v for k, v in kwargs.items() if k not in args})
    return fn(*positional, **form.accepted(args), **more)


def _scorer_call(fn, form: Form, r: RowInput, kwargs: dict):
    """fn(completion, label, **{extra_info, data_source that it names}, **its reward.kwargs)."""
    args = _verl_args(r)
    named = {k: args[k] for k in _SCORER_KEYWORDS if k in form.params}
    return _keyword_call(fn, form, named, kwargs, r.response, r.ground_truth)


def _verl_batch(fn, form: Form, rows: list[RowInput], kwargs: dict):
    """One call of verl's batch form: each of the row form's arguments as a list over the
    rows, named in the plural (data_sources, solution_strs, ground_truths, extra_infos)."""
    if not rows:
        return []
    per_row = [_verl_args(r) for r in rows]
    args = {f"{k}s": [a[k] for a in per_row] for k in per_row[0]}
    return _keyword_call(fn, form, args, kwargs)


def call(fn, form: Form, rows: list[RowInput], kwargs: dict | None = None, constants=None):
    """-> [(reward, {sub-score: value})] per row of `rows`, from one call of `fn` per batch
    (trl, verl_batch, easyr1_batch) or one per row. kwargs: `reward.kwargs` for this function
    (those its signature takes); constants: batch-wide keywords of the trl form (mdi_balance_ratio).
    Raises what `fn` raises, or RewardFormError for a result of the wrong count or type."""
    kwargs, kind = kwargs or {}, form.kind
    if kind == TRL:
        cols = _trl_kwargs(fn, form, rows, kwargs, constants or {})
        if form.positional is not None:
            got = fn(cols.pop("completions"), **cols)
        else:
            got = fn(**cols)
        return _scores(_resolve(got), len(rows), kind)
    if kind == EASYR1_BATCH:
        got = _resolve(fn([_row_dict(r, kind) for r in rows], **form.accepted(kwargs)))
        return _scores(got, len(rows), kind)
    if kind == VERL_BATCH:
        return _scores(_resolve(_verl_batch(fn, form, rows, kwargs)), len(rows), kind)
    if kind == EASYR1_LISTS:
        texts, labels = [r.response for r in rows], [r.ground_truth for r in rows]
        return _scores(_resolve(fn(texts, labels, **form.accepted(kwargs))), len(rows), kind)
    out = []
    for r in rows:
        if kind == VERL:
            got = _keyword_call(fn, form, _verl_args(r), kwargs)
        elif kind == SCORER:
            got = _scorer_call(fn, form, r, kwargs)
        else:
            got = fn(_row_dict(r, kind), **form.accepted(kwargs))
        out.append(score_of(_resolve(got), kind))
    return out


def _scores(got, n: int, kind: str) -> list[tuple[float, dict]]:
    if isinstance(got, dict | str | bytes) or not hasattr(got, "__len__"):
        raise RewardFormError(f"returned {type(got).__name__}, expected a list of {n} values")
    if len(got) != n:
        raise RewardFormError(f"returned {len(got)} values for {n} rows")
    return [score_of(v, kind) for v in got]


def all_finite(scores: list[tuple[float, dict]]) -> bool:
    return all(math.isfinite(v) for v, _ in scores)
