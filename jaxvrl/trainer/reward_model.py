"""A reward model: a sequence classifier (`Qwen2ForSequenceClassification`,
`LlamaForSequenceClassification`, `Qwen3ForSequenceClassification`) that scores each prompt
and completion on the run's mesh after the rollout, as one more weighted reward (`model`).

Each pair is rendered as TRL's GRPOTrainer renders it for a reward model: the reward model's
own chat template over the prompt's turns (a row's chat messages as the dataset gives them,
else one user turn of the prompt text) and an assistant turn (the completion), tokenized
without added special tokens (the template holds them) and right-padded with the tokenizer's
pad token (its EOS where it has none, as TRL sets it); without a chat template, the prompt
text followed by the completion. The score is the classifier's logit at the last token that
is not the pad token, as transformers reads it (`Model.classify`; one label: a classifier
of several labels is refused, which label would be the reward is not known). A non-finite
score is 0 and counted as the reward's failure (`tally`).

    rm = RewardModel.load(path, mesh=mesh, weight=1.0)
    scores = rm(prompts, completions)  # float64[B]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxvrl import models
from jaxvrl.config import ConfigError
from jaxvrl.data.rows import load_tokenizer
from jaxvrl.parallel import runtime
from jaxvrl.parallel.sharding import constrain, param_shardings, process_row_shards
from jaxvrl.rl.rewards import RewardTally

NAME = "model"  # the reward's name: reward/model, the markdown logs, the filters
MIN_LENGTH = 16  # padded lengths are powers of two from here (few programs)


def render(tokenizer, prompts: list, completions: list[str]) -> list[list[int]]:
    """Token ids of each (prompt, completion) as the reward model reads it; a prompt is a text
    or a list of chat messages ({"role", "content": text})."""
    turns = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
    if getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(t + [{"role": "assistant", "content": c}], tokenize=False)
            for t, c in zip(turns, completions)
        ]
    else:
        texts = ["\n\n".join(m["content"] for m in t) + c for t, c in zip(turns, completions)]
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


def pad_id(tokenizer) -> int:
    """The pad token the pairs are padded with and the score skips: the tokenizer's, else its
    EOS (TRL sets pad = eos for a reward model's tokenizer without one), else 0."""
    for i in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if i is not None:
            return int(i)
    return 0


def padded(ids: list[list[int]], pad_id: int, rows: int, length: int):
    """Right-padded (input_ids int32[rows, length], attention_mask int32[rows, length]);
    padding rows hold one pad token (a row with no real token would attend to nothing)."""
    out = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    mask[len(ids) :, 0] = 1
    for i, row in enumerate(ids):
        out[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return out, mask


@functools.partial(jax.jit, static_argnums=(0, 5))
def _scores(graphdef, params, input_ids, attention_mask, position_ids, pad: int):
    """float32[B]: the classifier's only logit at each row's last token that is not `pad`
    (on a mesh split by row as the rows came: each process reads back its own)."""
    model = nnx.merge(graphdef, params)
    scores = model.classify(input_ids, attention_mask, position_ids, pad_token_id=pad)[:, 0]
    return constrain(scores, ("batch",))


@dataclasses.dataclass
class RewardModel:
    """A loaded reward model: its graph and params (on `mesh`: sharded like the policy's,
    by the rules table; None: the default device), tokenizer and weight in the total."""

    graphdef: object
    params: object
    tokenizer: object
    mesh: Mesh | None = None
    weight: float = 1.0
    # its calls and the non-finite scores among them (counted like a reward function's
    # failures: reward/model_failures, reward.max_failure_fraction)
    tally: RewardTally = dataclasses.field(
        default_factory=lambda: RewardTally(
            NAME,
            "reward.model.path",
            "reward model's scoring of each prompt and completion",
            "Check the classifier's weights (config.reward.model.path)",
        )
    )

    @functools.cached_property
    def model_config(self):
        """The classifier's model config (what its positions follow)."""
        return nnx.merge(self.graphdef, self.params).config

    @classmethod
    def load(cls, path: str, *, mesh=None, dtype=jnp.float32, weight=1.0, key="reward.model.path"):
        """The sequence classifier in the HF directory `path` (`key`: the config key that
        named it, for errors)."""

        cfg = models.load_config(path)
        labels = getattr(cfg, "num_labels", None)
        if not labels:
            arch = cfg.to_hf_dict()["architectures"][0]
            raise ConfigError(
                f"config.{key}={path!r}: {arch} is not a sequence classifier (a reward model "
                "is Qwen2/Llama/Qwen3ForSequenceClassification)"
            )
        if labels != 1:
            raise ConfigError(
                f"config.{key}={path!r}: the classifier has {labels} labels; a reward model "
                "has one (its score)"
            )
        with runtime.on_host():
            model = models.load(path, dtype=dtype)
        graphdef, params = nnx.split(model)
        if mesh is None:
            params = jax.device_put(params)
        else:
            params = runtime.put_on_mesh(params, param_shardings(params, mesh))
        return cls(graphdef, params, load_tokenizer(path), mesh, float(weight))

    def __call__(self, prompts: list, completions: list[str]) -> np.ndarray:
        """float64[B] scores of this process's rows (prompts: texts or chat messages; a
        collective on a pod: every process calls it with as many rows); a non-finite score is
        0, the call counted as failed."""
        ids = render(self.tokenizer, prompts, completions)
        n = max(len(r) for r in ids) if ids else 1
        # every process runs the same program: the longest row of them all
        n = max(runtime.gather_json(n))
        length = max(MIN_LENGTH, 2 ** math.ceil(math.log2(max(n, 1))))
        shards = process_row_shards(self.mesh)
        rows = max(1, -(-len(ids) // shards) * shards)
        pad = pad_id(self.tokenizer)
        input_ids, mask = padded(ids, pad, rows, length)
        pos, _ = models.rope_index(self.model_config, input_ids, mask)
        x = {"input_ids": input_ids, "attention_mask": mask, "position_ids": pos}
        if self.mesh is None:
            x = jax.tree.map(jnp.asarray, x)
            out = _scores(self.graphdef, self.params, **x, pad=pad)
        else:
            x = runtime.place_batch(x, self.mesh)  # a dict in sorted order: pass by name
            with jax.set_mesh(self.mesh):
                out = _scores(self.graphdef, self.params, **x, pad=pad)
            out = runtime.host_local(out)
        scores = np.asarray(out, np.float64)[: len(ids)]
        bad = ~np.isfinite(scores)
        self.tally.record(f"{bad.sum()} of {len(ids)} scores not finite" if bad.any() else None)
        return np.where(bad, 0.0, scores)
