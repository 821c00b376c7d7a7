"""Config files and `--config.key=value` overrides (big_vision style, ml_collections).

    python -m jaxvrl.train --config configs/tprl.py --config.rollout.temperature=0.7
    python -m jaxvrl.train --config=configs/grpo.py:runlocal --config.model.path=/ckpt/qwen

A config file defines `get_config(arg=None)`; `path.py:arg` passes `arg` to it. An override's
value is parsed by the type of the value it replaces (bool, int, float, str, tuple, list, or a
typed `placeholder` that may be None). The returned ConfigDict is locked: a misspelt key is an
error naming close keys, never a silently new option.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import ml_collections
from ml_collections.config_dict import FieldReference

_NONE = ("none", "null")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class ConfigError(ValueError):
    """A setting, config file, argument or override that cannot be applied; also a model's
    config.json that cannot be read. Entry points print it as one line and exit 2."""


# --- Settings and their rules -------------------------------------------------------------
# A config file declares a key once, with its default, its comment and its rules:
#     c.optim.lr = setting(3e-4, POSITIVE)  # the policy's AdamW peak learning rate
# A rule is a callable (value, config) -> None when the value is allowed, else the text of
# what is allowed. `validate` checks every declared rule before a run loads anything.


class Setting(FieldReference):
    """A config value with its rules (an ml_collections FieldReference: overrides keep it, so
    the rules hold whatever sets the value). `nullable`: None is allowed (rules are then
    skipped); a setting declared with None as its default is nullable."""

    def __init__(self, default, rules=(), field_type=None, nullable=None):
        super().__init__(default, field_type=field_type or type(default))
        self.rules = tuple(rules)
        self.nullable = default is None if nullable is None else nullable


def setting(default, *rules, type=None, nullable=None) -> Setting:  # noqa: A002
    """`default` checked by `rules` (each `rule(value, config) -> None | what is allowed`);
    `type` for a None default (a typed placeholder)."""
    return Setting(default, rules, type, nullable)


@dataclasses.dataclass(frozen=True)
class OneOf:
    choices: tuple

    def __call__(self, value, config=None):
        if value not in self.choices:
            return "one of " + ", ".join("null" if c is None else str(c) for c in self.choices)
        return None


def one_of(*choices) -> OneOf:
    return OneOf(tuple(choices))


@dataclasses.dataclass(frozen=True)
class Range:
    """lo <= value <= hi (either end open, or None: unbounded); +-inf only where `finite` is
    False (a cap or a bound that inf turns off)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    finite: bool = True

    def __call__(self, value, config=None):
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            return f"a number {self.text()}"
        if self.finite and math.isinf(value):
            bounded = self.lo is not None or self.hi is not None
            return f"a finite number {self.text()}" if bounded else "a finite number"
        low_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return None if low_ok and high_ok else self.text()

    def text(self) -> str:
        if self.hi is None and self.lo is None:
            return "(not NaN)"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi}"
        return (
            f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        )


@dataclasses.dataclass(frozen=True)
class Each:
    """Every item of a sequence passes `rule`; `length`: the count it must have, or the key of
    a sequence setting it must be as long as."""

    rule: Callable | None = None
    length: int | str | None = None
    allow_empty: bool = True

    def __call__(self, value, config=None):
        if not isinstance(value, tuple | list):
            return "a list"
        if isinstance(self.length, str):
            n = len(get(config, self.length))
            if len(value) != n and (value or not self.allow_empty):
                return f"{n} values, one per {self.length} item ({len(value)} given)"
        elif self.length is not None and len(value) != self.length:
            return f"{self.length} values ({len(value)} given)"
        elif not value and not self.allow_empty:
            return "at least one value"
        for x in value:
            why = self.rule(x, config) if self.rule else None
            if why:
                return f"each value {why} ({x!r} is not)"
        return None


def ordered(value, config=None):
    """A (low, high) pair with low <= high."""
    if len(value) == 2 and value[0] <= value[1]:
        return None
    return "(low, high) with low <= high"


def increasing(value, config=None):
    """A (low, high) pair with low < high."""
    if len(value) == 2 and value[0] < value[1]:
        return None
    return "(low, high) with low < high"


@dataclasses.dataclass(frozen=True)
class Agree:
    """`test(value, config)` is true; `text` says what it asks."""

    test: Callable
    text: str

    def __call__(self, value, config=None):
        return None if self.test(value, config) else self.text


def agree(test: Callable, text: str) -> Agree:
    return Agree(test, text)


@dataclasses.dataclass(frozen=True)
class AutoOr:
    """ "auto", or a value `rule` allows (a setting declared with `type=object`, so that an
    override parses as either)."""

    rule: Callable

    def __call__(self, value, config=None):
        if value == "auto":
            return None
        why = self.rule(value, config)
        return None if why is None else f"'auto' or {why}"


def half_divisor(count: FieldReference) -> FieldReference:
    """A count that follows `count` (a config reference): its largest divisor at most half of
    it (half of an even count, 1 for a prime or for 1), e.g. the prompts of each of at least
    two equal mini-batches."""
    return count._apply_op(_half_divisor)


def _half_divisor(n: int) -> int:
    """n over its smallest prime factor (1 for a prime or for 1), trying factors up to 10^6
    (a count past 10^12 without one is refused by its own setting's bound anyway)."""
    for p in range(2, min(math.isqrt(n), 10**6) + 1):
        if n % p == 0:
            return n // p
    return 1


def at_least(n) -> Range:
    return Range(n)


NON_EMPTY = Agree(lambda v, c: bool(v), "a non-empty value")
POSITIVE = Range(0, lo_open=True)
CAP = Range(0, lo_open=True, finite=False)  # > 0, inf = no cap
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, lo_open=True)  # a share that keeps something: (0, 1]
PROBABILITY = Range(0, 1)
COUNT = Agree(
    lambda v, c: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"
)


def get(config, key: str):
    """The value at dotted `key` of `config`."""
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def set_values(cfg: ml_collections.ConfigDict, values) -> ml_collections.ConfigDict:
    """Sets each dotted key of `values` (a mapping) in `cfg` as an override would (type-checked;
    an unknown key is a ConfigError naming close ones); returns `cfg`."""
    keys = flat_keys(cfg)
    for key, value in values.items():
        if key not in keys:
            raise ConfigError(_unknown_key_message(key, keys, "the values"))
        *parents, leaf = key.split(".")
        node = get(cfg, ".".join(parents)) if parents else cfg
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.{key}={value!r}: {e}") from None
    return cfg


def settings(cfg: ml_collections.ConfigDict, prefix: str = ""):
    """(dotted key, Setting) for every declared setting of `cfg`."""
    for k, field in cfg._fields.items():
        if isinstance(field, ml_collections.ConfigDict):
            yield from settings(field, f"{prefix}{k}.")
        elif isinstance(field, Setting):
            yield prefix + k, field


def parse_argv(argv: list[str]) -> tuple[str, list[str]]:
    """Command line -> (config path[:arg], ['key=value' | 'key', ...]).

    Accepts `--config PATH`, `--config=PATH`, `--config.key=value`, `--config.key value` and a
    bare `--config.flag` (True for a bool option)."""
    path, overrides, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config needs a path, e.g. --config configs/tprl.py")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a.startswith("--config."):
            body = a[len("--config.") :]
            if "=" not in body and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                body, i = f"{body}={argv[i + 1]}", i + 1
            overrides.append(body)
        else:
            raise ConfigError(
                f"unknown argument {a!r}; use --config PATH and --config.key=value overrides"
            )
        i += 1
    if not path:
        raise ConfigError("missing --config, e.g. --config configs/tprl.py")
    return path, overrides


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
    """big_vision's `get_config(arg)` argument: 'runlocal,steps=3' -> ConfigDict with the
    defaults of `spec` (their types parse the values); a bare name sets a bool to True."""
    out = ml_collections.ConfigDict(spec)
    for item in filter(None, (s.strip() for s in (arg or "").split(","))):
        key, eq, raw = item.partition("=")
        if key not in spec:
            raise ConfigError(f"unknown config argument {key!r}; known: {', '.join(spec)}")
        out[key] = _parse_value(raw if eq else None, spec[key], type(spec[key]), False, key)
    return out


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of all leaf options, e.g. 'rollout.temperature'."""
    out = []
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            out += flat_keys(v, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return out


def _scalar(raw: str, typ: type, key: str):
    if typ is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"--config.{key}: expected a bool (true/false), got {raw!r}")
    if typ is int:
        try:
            value = int(raw)
        except ValueError:
            try:  # 1e4
                f = float(raw)
            except ValueError:
                f = None
            if f is None or not f.is_integer():
                raise ConfigError(f"--config.{key}: expected an int, got {raw!r}") from None
            value = int(f)
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"--config.{key}: expected a 64-bit int, got {raw!r}")
        return value
    if typ is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected a float, got {raw!r}") from None
    if typ is str:
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            return raw[1:-1]
        return raw
    try:  # no type to go by: a Python literal, else the text (inf and nan: floats)
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return float(raw) if raw.strip().lower().lstrip("+-") in ("inf", "nan") else raw


def _sequence(raw: str, current, key: str):
    try:
        items = ast.literal_eval(raw) if raw.strip() else ()
    except (ValueError, SyntaxError):
        items = None
    if isinstance(items, str):  # one quoted item: '' is none
        items = [items] if items else []
    elif not isinstance(items, list | tuple):
        body = raw.strip().strip("()[]")
        items = [s.strip() for s in body.split(",") if s.strip()]
    types = {type(x) for x in current}
    typ = types.pop() if len(types) == 1 else None
    out = []
    for x in items:
        if typ is not None and not isinstance(x, typ):
            x = _scalar(str(x), typ, key)
        elif typ is None and isinstance(x, str):
            x = _scalar(x, None, key)
        out.append(x)
    return type(current)(out)


def _parse_value(raw: str | None, current, typ: type, nullable: bool, key: str):
    if raw is None:  # bare --config.flag
        if typ is bool:
            return True
        raise ConfigError(f"--config.{key} needs a value, e.g. --config.{key}=...")
    if raw.strip().lower() in _NONE and (nullable or current is None):
        return None
    if isinstance(current, tuple | list) or typ in (tuple, list):  # typ: an unset sequence's
        return _sequence(raw, current if current is not None else typ(), key)
    if typ in (bool, int, float, str):
        return _scalar(raw.strip() if typ is not str else raw, typ, key)
    return _scalar(raw, None, key)


# other tools' names (EasyR1 / verl YAML keys) for settings of ours with another name, matched
# against any part of an unknown key (custom_reward_function.path: the reward's file)
THEIR_NAMES = {
    "ulysses_size": "mesh.sequence",
    "ulysses_sequence_parallel_size": "mesh.sequence",
    "max_grad_norm": "optim.grad_clip",
    "enable_gradient_checkpointing": "model.remat_policy",
    "optimizer_offload": "actor.offload_optimizer",
    "tensor_model_parallel_size": "rollout.mesh.tensor",
    "tensor_parallel_size": "rollout.mesh.tensor",
    "expert_model_parallel_size": "mesh.expert",
    "expert_parallel_size": "rollout.mesh.expert",
    "gpu_memory_utilization": "rollout.memory_fraction",
    "apply_chat_template_kwargs": "data.chat_template_kwargs",
    "n": "rollout.num_generations",
    "response_length": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "custom_reward_function": "reward.funcs",
    "reward_function": "reward.funcs",
    "reward_kwargs": "reward.kwargs",
    "reward_function_kwargs": "reward.kwargs",
    "overlong_buffer": "filter.overlong_buffer_len",
    "filter_groups": "filter.dynamic_sampling",
    "train_batch_size": "prompts_per_step",
    "rollout_batch_size": "prompts_per_step",
    "ppo_mini_batch_size": "actor.global_batch_size",
    "ppo_micro_batch_size_per_gpu": "optim.micro_batches",
    "micro_batch_size_per_device_for_update": "optim.micro_batches",
    "use_dynamic_bsz": "actor.dynamic_batching",
    "ppo_max_token_len_per_gpu": "actor.max_token_len_per_device",
    "clip_ratio": "actor.clip_ratio_low",
    "entropy_coeff": "actor.entropy_coef",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "lr_warmup_steps": "optim.warmup_steps",
    "warmup_style": "optim.schedule",
    "total_training_steps": "total_steps",
    "max_steps": "total_steps",
    "test_freq": "val_freq",
    "model_path": "model.path",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "experiment_name": "logging.run_name",
    "project_name": "logging.project",
    "logger": "logging.backends",
    "default_local_dir": "workdir",
    "save_checkpoint_path": "workdir",
}


def _unknown_key_message(key: str, keys: list[str], source: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    parts = key.split(".")[::-1]  # the leaf first
    close = list(dict.fromkeys(THEIR_NAMES[p] for p in parts if THEIR_NAMES.get(p) in keys))
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close]
    close += [k for k in difflib.get_close_matches(key, keys, n=5, cutoff=0.6) if k not in close]
    groups = sorted({k.split(".")[0] for k in keys if "." in k})
    hint = f"; close names: {', '.join(close[:6])}" if close else f"; groups: {', '.join(groups)}"
    return f"unknown config key {key!r} in {source}{hint}"


def apply_override(cfg: ml_collections.ConfigDict, item: str, source: str = "the config") -> None:
    """Applies 'a.b=value' (or a bare 'a.b' for a bool) to an unlocked or locked cfg."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    keys = flat_keys(cfg)
    if key not in keys:
        inside = [k for k in keys if k.startswith(key + ".")]
        if inside:
            raise ConfigError(
                f"config key {key!r} in {source} is a group; set one of: {', '.join(inside)}"
            )
        raise ConfigError(_unknown_key_message(key, keys, source))
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    current = node[leaf]
    field = node._fields.get(leaf)
    # placeholder(type), or a setting declared nullable
    nullable = isinstance(field, FieldReference) and getattr(field, "nullable", True)
    typ = node.get_type(leaf) if current is not None or nullable else type(None)
    value = _parse_value(raw if eq else None, current, typ, nullable, key)
    try:
        node[leaf] = value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--config.{key}={raw}: {e}") from None


def validate(cfg: ml_collections.ConfigDict, source: str = "the config") -> None:
    """Checks every declared setting's rules (`setting`); raises ConfigError naming the first
    key whose value breaks one, the value, and what is allowed."""
    for key, field in settings(cfg):
        value = field.get()
        if value is None:
            if field.nullable:
                continue
            raise ConfigError(f"config.{key}=null in {source}: expected a value")
        for rule in field.rules:
            why = rule(value, cfg)
            if why:
                raise ConfigError(f"config.{key}={value!r} in {source}: expected {why}")


def reward_names_rule(names, cfg):
    """Rule of `reward.names`: the functions' metric names are distinct and allowed."""
    try:
        out = reward_names(tuple(get(cfg, "reward.funcs")), tuple(names))
    except ValueError as e:
        return f"names that identify each reward: {e}"
    if get(cfg, "reward.model.path") and "model" in out:
        return "names other than 'model', the reward model's (reward.model.path)"
    return None


def reward_metric_rule(value, cfg):
    """Rule of a filter's reward key: overall (the total) or a reward's name (`model`: the
    reward model's, when reward.model.path is set)."""
    funcs = tuple(get(cfg, "reward.funcs"))
    names = reward_names(funcs, tuple(get(cfg, "reward.names")))
    if get(cfg, "reward.model.path"):
        names += ("model",)
    allowed = ("overall", *names, *(f for f in funcs if f not in names))
    if value in allowed:
        return None
    return f"overall (the total reward) or a reward's name: {', '.join(('overall', *names))}"


# reward metric names the run uses for its own metrics (reward/total, ...)
RESERVED_NAMES = ("total", "greedy_baseline", "overall")


def reward_name(spec: str) -> str:
    """The name a reward is logged under: a built-in's own name (`mc_idx`), else the function's
    name (`path/to/flaky.py:flaky` and `pkg.mod:flaky` -> `flaky`), or for a file named without
    its function the file's (`path/to/geo3k.py` -> `geo3k`)."""
    if ":" in spec:
        return spec.rsplit(":", 1)[1]
    if spec.endswith(".py"):
        return os.path.basename(spec)[: -len(".py")]
    return spec


def reward_names(funcs: Sequence[str], names: Sequence[str] = ()) -> tuple[str, ...]:
    """The names `funcs` are logged under (`reward/<name>`, `reward/<name>_failures`, the
    markdown logs): `names` when given (one per function), else `reward_name` of each.
    Raises ValueError when two metric names coincide or a name is empty, holds a `/` or is
    reserved (`reward/total`, ...)."""
    if names and len(names) != len(funcs):
        raise ValueError(f"{len(names)} reward names {tuple(names)} for {len(funcs)} functions")
    out = tuple(names) if names else tuple(reward_name(f) for f in funcs)
    where = "config.reward.names" if names else "config.reward.funcs"
    fix = "" if names else ": give each function a name in config.reward.names"
    owner = dict.fromkeys(RESERVED_NAMES)  # metric name -> the function logged under it
    for name, spec in zip(out, funcs):
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"{where}: reward {spec!r} has the name {name!r}, expected a "
                "non-empty string without '/'"
            )
        for metric in (name, f"{name}_failures"):
            if metric not in owner:
                owner[metric] = spec
                continue
            if owner[metric] is None:
                raise ValueError(
                    f"{where}: reward {spec!r} would be logged as reward/{metric}, a name the "
                    f"run uses for another metric{fix}"
                )
            same = "are both named" if metric == name else "clash as"
            raise ValueError(
                f"{where}: rewards {owner[metric]!r} and {spec!r} {same} {metric!r}: their "
                f"metrics would share reward/{metric}{fix}, e.g. "
                f'--config.reward.names="{tuple(f"{n}_{i}" for i, n in enumerate(out))}"'
            )
    return out


def _line_in(path: str, error: BaseException) -> str:
    """', line N (its source)' of the last frame of `error`'s traceback in the file `path`, the
    line that raised or called what raised; '' if none is."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if f.filename == os.path.abspath(path)
    ]
    if not frames:
        return ""
    line = (frames[-1].line or "").strip()
    return f", line {frames[-1].lineno}" + (f" ({line})" if line else "")


def _load_file(spec: str) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found (cwd {os.getcwd()})")
    # configs/*.py import their siblings as `configs.x`: put the folder above on the path
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)
    stem = os.path.splitext(os.path.basename(path))[0]
    if not path.endswith(".py"):
        raise ConfigError(f"config file {path}: not a Python file defining get_config(arg=None)")
    mod_spec = importlib.util.spec_from_file_location(f"_jaxvrl_config_{stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"{path} defines no get_config(arg=None)")
        cfg = module.get_config(arg or None)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's file: one line, not a traceback
        where = _line_in(path, e)
        raise ConfigError(f"config file {path}{where}: {type(e).__name__}: {e}") from e
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not a ConfigDict")
    return cfg


def default_workdir(spec: str, now: float | None = None) -> str:
    """runs/<config file stem>-<YYYYmmdd-HHMMSS> (local time)."""
    stem = os.path.splitext(os.path.basename(spec.partition(":")[0]))[0]
    return os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")


def base_comments(path: str) -> dict[str, str]:
    """key -> the comment that documents it in `path` (a config file such as configs/base.py):
    the comment on its `c.<key> = ...` line, after the comment lines right above it."""
    out, above = {}, []
    line_re = re.compile(r"^\s*c\.([\w.]+)\s*=\s*[^#]*?(?:#\s*(.*))?$")
    with open(path) as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("#").strip())
                continue
            m = line_re.match(line)
            if m and "ConfigDict(" not in line:  # a group's comment is not a key's
                text = " ".join(x for x in (*above, m.group(2) or "") if x)
                if text:
                    out[m.group(1)] = text
            above = []
    return out


def describe_config(cfg: ml_collections.ConfigDict, spec: str) -> str:
    """Every key of `cfg` with its value and its comment in the base config next to the
    config file `spec` (configs/base.py): the text `--help_config` prints."""
    source = spec.partition(":")[0]
    base = os.path.join(os.path.dirname(os.path.abspath(source)), "base.py")
    comments = base_comments(base) if os.path.exists(base) else {}
    lines = [f"# {source} (comments from {os.path.relpath(base)})"]
    for key, value in _flatten(cfg):
        note = comments.get(key)
        lines.append(f"{key} = {value!r}" + (f"  # {note}" if note else ""))
    return "\n".join(lines)


def _flatten(cfg, prefix: str = ""):
    for key in sorted(cfg.keys()):
        value = cfg[key]
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def _check_declared(cfg: ml_collections.ConfigDict, source: str) -> None:
    """A key that the config file set but the base config it builds on (the `configs.base`
    it imported) does not declare is a misspelling (`c.actor.clip_ratio_hihg = 0.5` would
    otherwise be a new option that nothing reads), unless the file declares it as a new
    option with `setting(...)`."""
    base = sys.modules.get("configs.base")
    if base is None or not callable(getattr(base, "get_config", None)):
        return
    known = flat_keys(base.get_config())
    fields = dict(_leaf_fields(cfg))
    for key in flat_keys(cfg):
        if key not in known and not isinstance(fields.get(key), Setting):
            raise ConfigError(
                _unknown_key_message(key, known, source)
                + "; a new option is declared with setting(default, *rules)"
            )


def _leaf_fields(cfg: ml_collections.ConfigDict, prefix: str = ""):
    for k, field in cfg._fields.items():
        if isinstance(field, ml_collections.ConfigDict):
            yield from _leaf_fields(field, f"{prefix}{k}.")
        else:
            yield prefix + k, field


def load_config(spec: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """'configs/x.py[:arg]' + ['key=value', ...] -> validated, locked ConfigDict."""
    source = spec.partition(":")[0]
    cfg = _load_file(spec)
    _check_declared(cfg, source)
    cfg.lock()
    for item in overrides:
        apply_override(cfg, item, source)
    validate(cfg, source)
    if "workdir" in cfg and not cfg.workdir:
        cfg.workdir = default_workdir(spec)
    return cfg
