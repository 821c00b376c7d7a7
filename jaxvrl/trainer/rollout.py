"""The rollout phase of a step, on the host (docs/algorithms.md: rewards, overlong completions,
rollout filtering): sample completions for a batch of prompts, score them, apply the overlong
and truncation rules, filter groups (dynamic sampling with refill, online filtering, replay
buffer) and assemble one RolloutBatch of fixed shape for the train step.

Shapes: P = prompts per step, G = completions per prompt (a group), B = P * G rows, N =
max_new_tokens. The batch always holds P groups: when fewer informative groups were found,
the missing ones are padding groups with completion mask 0, so the train step never sees a
new shape (no recompilation) and padding rows take no part in the loss.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxvrl import models, rl
from jaxvrl.data.prompts import content_text
from jaxvrl.models import positions
from jaxvrl.parallel import runtime
from jaxvrl.parallel.sharding import row_shards
from jaxvrl.rl.reward_forms import TrainerState, is_messages
from jaxvrl.sampling import Sampler
from jaxvrl.trainer.groups import (
    Collected,
    FilterOptions,
    Group,
    collect_groups,
    entropies,
)
from jaxvrl.trainer.groups import masses as group_masses
from jaxvrl.trainer.groups import routes as group_routes
from jaxvrl.trainer.passes import RolloutBatch
from jaxvrl.trainer.scoring import RewardScorer


def assemble_prompts(
    prompts: dict,
    tokens: np.ndarray,
    completion_mask: np.ndarray,
    rewards: np.ndarray,
    *,
    with_pools: bool = False,
    baseline: np.ndarray | None = None,
    old_logprobs: np.ndarray | None = None,
    old_entropy: np.ndarray | None = None,
    routes: np.ndarray | None = None,
    masses: tuple | None = None,
) -> RolloutBatch:
    """`assemble` over a collated prompt batch (the data loader's dict: input_ids,
    attention_mask, position_ids, deltas, has_image, images, videos and, with_pools, pools)."""
    return assemble(
        prompts["input_ids"],
        prompts["attention_mask"],
        prompts["position_ids"],
        prompts["deltas"],
        tokens,
        completion_mask,
        rewards,
        prompts["has_image"],
        images=prompts.get("images"),
        videos=prompts.get("videos"),
        pools=prompts["pools"] if with_pools else None,
        baseline=baseline,
        old_logprobs=old_logprobs,
        old_entropy=old_entropy,
        routes=routes,
        masses=masses,
    )


def completion_positions(
    prompt_positions: np.ndarray, prompt_mask: np.ndarray, deltas: np.ndarray, n: int
) -> np.ndarray:
    """The family's positions of the completions [..., B, n] (the prompts' rank): the i-th
    completion token of row b sits at n_valid + delta + i."""
    start = (prompt_mask.sum(axis=1) + deltas).astype(np.int32)  # [B]
    return models.continue_positions(prompt_positions, start, n)


def assemble(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    prompt_positions: np.ndarray,
    deltas: np.ndarray,
    tokens: np.ndarray,
    completion_mask: np.ndarray,
    rewards: np.ndarray,
    has_image: np.ndarray,
    *,
    images=None,
    videos=None,
    pools: dict | None = None,
    baseline: np.ndarray | None = None,
    old_logprobs: np.ndarray | None = None,
    old_entropy: np.ndarray | None = None,
    routes: np.ndarray | None = None,
    masses: tuple | None = None,
) -> RolloutBatch:
    """Concatenate prompt [B, P] and completion [B, N] into one RolloutBatch (numpy arrays).

    Completion tokens after the first EOS get attention_mask 0; they never influence a loss.
    old_logprobs: the sampler's log-probs of the completion tokens float32[B, N], or None;
    old_entropy: the sampler's entropies there, or None; routes: the sampler's routes of
    every token [B, P + N, L', k], or None; masses: the sampler's (A_V, A_X) float32[B, L, N]
    of the completion tokens, or None.
    """
    n = tokens.shape[1]
    comp_mask = completion_mask.astype(np.int32)
    completion = completion_positions(prompt_positions, prompt_mask, deltas, n)
    pos = np.concatenate([prompt_positions, completion], axis=-1).astype(np.int32)
    if pools is not None:
        pad = np.zeros((tokens.shape[0], n), bool)
        pools = {k: np.concatenate([v, pad], axis=1) for k, v in pools.items()}
    return RolloutBatch(
        input_ids=np.concatenate([prompt_ids, tokens], axis=1).astype(np.int32),
        attention_mask=np.concatenate([prompt_mask, comp_mask], axis=1).astype(np.int32),
        position_ids=pos,
        completion_mask=completion_mask.astype(np.float32),
        rewards=np.asarray(rewards, np.float32),
        has_image=np.asarray(has_image, bool),
        baseline=np.zeros(len(tokens), np.float32) if baseline is None else baseline,
        images=images,
        videos=videos,
        pools=pools,
        old_logprobs=None if old_logprobs is None else np.asarray(old_logprobs, np.float32),
        old_entropy=None if old_entropy is None else np.asarray(old_entropy, np.float32),
        old_vision_mass=None if masses is None else np.asarray(masses[0], np.float32),
        old_text_mass=None if masses is None else np.asarray(masses[1], np.float32),
        routes=routes,
    )


@dataclasses.dataclass(frozen=True)
class Drawn:
    """One logged sample: completion `j` of `group`; `row` its row in the step's batch, or -1
    for a group the filters dropped (or beyond the step's P)."""

    group: Group
    j: int
    row: int

    @property
    def kept(self) -> bool:
        return self.row >= 0


@dataclasses.dataclass
class Rollout:
    """A step's rollout: the train step's batch and what the logs read.

    batch: RolloutBatch of numpy arrays (B = P * G rows); groups: its P groups in row order
    (padding groups included); real: bool[P], False for padding groups; metrics: scalars about
    everything sampled this step (reward means, lengths, filtering counts, timing); sampled:
    every group generated this step, kept or filtered, in order (empty: only `groups` are
    known); assemble_rows([(group, j), ...]) -> a RolloutBatch of those completions, one row
    each (the diagnostic pass's rows where some are not in `batch`).
    """

    batch: RolloutBatch
    groups: list[Group]
    real: np.ndarray
    metrics: dict
    sampled: list[Group] = dataclasses.field(default_factory=list)
    assemble_rows: Callable | None = None
    _drawn_batch: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def drawn_batch(self, n: int) -> tuple[list[Drawn], RolloutBatch | None]:
        """(`draw_samples(self, n)`, their rows as a RolloutBatch: taken from `batch` when all
        are kept, else assembled; None when neither can be had). Kept per `n` for the step."""
        if n not in self._drawn_batch:
            drawn = draw_samples(self, n)
            rows = np.asarray([d.row for d in drawn], np.int64)
            if all(d.kept for d in drawn):
                batch = _take_rows(self.batch, rows)
            elif self.assemble_rows is not None:
                batch = self.assemble_rows([(d.group, d.j) for d in drawn])
            else:
                batch = None
            self._drawn_batch[n] = (drawn, batch)
        return self._drawn_batch[n]


def draw_samples(rollout, n: int) -> list[Drawn]:
    """The first `n` completions of all a step's groups, kept or filtered: the batch's real
    groups first (those trained on, in batch order), then the groups sampled this step that
    are not in the batch, in order (a rollout without `sampled`: only the batch's)."""
    groups, real = rollout.groups, rollout.real
    g = len(groups[0].texts) if groups else 0
    at = {id(x): i for i, x in enumerate(groups) if bool(real[i])}
    sampled = list(getattr(rollout, "sampled", None) or [])
    order = [x for x in groups if id(x) in at] + [x for x in sampled if id(x) not in at]
    out = []
    for x in order:
        for j in range(len(x.texts)):
            if len(out) == n:
                return out
            out.append(Drawn(x, j, at[id(x)] * g + j if id(x) in at else -1))
    return out


def _finite_mean(vals: np.ndarray) -> float:
    """The mean of the finite values (NaN: rows without one), NaN when there are none."""
    finite = np.isfinite(vals)
    return float(np.mean(vals[finite])) if finite.any() else float("nan")


def _take_rows(batch: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
    """Rows of a host batch (the positions' rows are their own axis)."""
    take = lambda x: None if x is None else np.asarray(x)[rows]  # noqa: E731
    out = jax.tree.map(take, batch.replace(position_ids=None))
    return out.replace(position_ids=positions.take_rows(np.asarray(batch.position_ids), rows))


# the soft overlong punishment's part of each row's total (rollout_results.md, reward/<it>)
OVERLONG = "overlong_penalty"


def reward_statistics(att: dict, rows=slice(None)) -> dict:
    """The per-row rollout statistics the rewards may read besides the rows' columns, for
    `rows` of the per-row attention metrics `att` (`RolloutPhase.attention_metrics`): the
    mdi reward's MDI, where measured."""
    return {"mdi": list(att["mdi"][rows])} if "mdi" in att else {}


def reward_constants(mdi_balance_ratio: float, max_steps: int = 0) -> dict:
    """Batch-wide keywords of TRL-form rewards: the built-in mdi's balance ratio, and TRL's
    `trainer_state` (its global_step set per batch by `RewardScorer.submit`)."""
    return {
        "mdi_balance_ratio": mdi_balance_ratio,
        "trainer_state": TrainerState(max_steps=int(max_steps)),
    }


def model_prompt(row: dict):
    """What the reward model reads of a row's prompt: the dataset's chat messages, each turn
    as its text (TRL passes a conversational prompt whole), else the prompt text."""
    prompt = row.get("prompt")
    if is_messages(prompt):
        return [{"role": m["role"], "content": content_text(m["content"])} for m in prompt]
    return str(row.get("problem", prompt) or "")


def completion_ids(tokens, mask) -> list[np.ndarray]:
    """Each completion's token ids (its EOS included, no padding), as TRL passes them."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    return [t[m > 0] for t, m in zip(tokens, mask)]


@dataclasses.dataclass
class PhaseWeights:
    """What the samplers make from the policy's parameters once per rollout phase and share
    (the sampler and the greedy sampler: the same layout): the parameters in the rollout's
    layout (`Sampler.prepare`: LoRA merged, cast to rollout.dtype, on rollout.mesh) and the
    decode weights for each row count (`Sampler.decode_weights`: on the CPU, the decoder's
    weights as rows or packed for the CPU kernels). `end_phase` drops them; packed decode
    weights are kept for the next phase, whose parameters are packed into the same buffer."""

    current: dict = dataclasses.field(default_factory=dict)  # rows -> this phase's
    kept: dict = dataclasses.field(default_factory=dict)  # rows -> the last phase's, packed
    source: object = None  # the parameters `ready` was made from
    ready: object = None  # RolloutParams

    def params(self, sampler, params):
        """`params` in the sampler's layout, prepared at the phase's first call."""
        if params is not self.source:
            if self.source is not None:  # other parameters within a phase: start afresh
                self.end_phase()
            self.source, self.ready = params, sampler.prepare(params)
        return self.ready

    def get(self, sampler, params, rows: int):
        if rows not in self.current:
            reuse = self.kept.pop(rows, None)
            self.current[rows] = sampler.decode_weights(params, rows, reuse=reuse)
        return self.current[rows]

    def end_phase(self) -> None:
        """Forget this phase's parameters; keep the packed buffers for the next phase."""
        self.kept = {r: w for r, w in self.current.items() if w is not None and w.packed}
        self.current, self.source, self.ready = {}, None, None


def repeat_prompts(batch: dict, g: int) -> dict:
    """A collated prompt batch of R rows as R * g rows, each repeated g times in a row: what
    `collate` with g repeats gives (the positions' rows are their own axis)."""
    if g == 1:
        return batch

    def rep(x):
        return None if x is None else np.repeat(np.asarray(x), g, axis=0)

    trees = ("position_ids", "rows", "images", "videos", "pools")  # repeated below
    out = {k: rep(v) for k, v in batch.items() if k not in trees}
    out["position_ids"] = positions.repeat_rows(np.asarray(batch["position_ids"]), g)
    for k in ("images", "videos"):  # per-row VisionInputs
        out[k] = None if batch.get(k) is None else jax.tree.map(rep, batch[k])
    out["pools"] = (
        None if batch["pools"] is None else {k: rep(v) for k, v in batch["pools"].items()}
    )
    out["rows"] = [r for r in batch["rows"] for _ in range(g)]
    return out


def prefills_once(prompts: int, mesh) -> bool:
    """Whether a process's `prompts` are sampled with one prefill each: where the mesh's row
    shards (the prefill's: `prompt_mesh`) divide them (else they are repeated on the host,
    `sample_completions`)."""
    return prompts * jax.process_count() % row_shards(mesh) == 0


def prompt_mesh(sampler, mesh):
    """The mesh `sampler` takes its prompts on: its prefill's (`Sampler.prefill_mesh`: the
    rollout mesh `mesh` with data groups joined where each prompt's tokens split over
    several), else `mesh`."""
    return mesh if mesh is None else getattr(sampler, "prefill_mesh", None) or mesh


def sample_completions(
    sampler,
    params,
    batch: dict,
    key,
    pools=None,
    mesh=None,
    decode: PhaseWeights | None = None,
    num_samples: int = 1,
    timed: bool = False,
    limits=None,
    groups=None,
    need=None,
    prompt_of=None,
):
    """Runs the jitted sampler on a collated prompt batch; a SampleOutput of numpy arrays
    (with `timed`, and the seconds of its prefill and decode programs: `Sampler.timed`).

    num_samples: completions per prompt (G): the sampler prefills each of the batch's R
    prompts once and returns R * G rows, prompt-major. Where the mesh's row shards do not
    divide the R prompts, the prompts are repeated on the host and each row prefilled (the
    same tokens: per-row keys, `steps.row_keys`).

    mesh: None puts the inputs on the default device. With a mesh (the rollout's; the
    prompts go to the sampler's prefill mesh, `prompt_mesh`) the prompt arrays become
    global arrays with rows split over (data, fsdp) (`runtime.place_batch`: on a pod each
    process passes its own rows), the key is replicated, and the outputs come back as this
    process's rows (`runtime.host_local`; np.asarray fails on a pod). decode: where the
    phase keeps `params` in the sampler's layout and their decode weights (None: the
    sampler prepares its own each call). limits int[rows], groups int[rows], need and
    prompt_of int[rows] (the sampler's: `sampling.sample`) are passed on, None: not given.
    On a pod they are each process's own (groups and prompts numbered from 0 on each; need
    counts the groups of every process), and the processes' rows take slots in turn
    (`pod_rows`), so that no process's rows wait behind another's."""
    mesh = prompt_mesh(sampler, mesh)
    prefill_once = prefills_once(len(batch["input_ids"]), mesh)
    if not prefill_once:
        batch = repeat_prompts(dict(batch, pools=pools), num_samples)
        pools = batch["pools"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "deltas")}
    inputs.update(images=batch["images"], videos=batch.get("videos"), pools=pools)
    mine = len(batch["input_ids"]) * (num_samples if prefill_once else 1)  # this process's
    mine = mine if prompt_of is None else len(prompt_of)
    given = dict(limits=limits, groups=groups, prompt_of=prompt_of)
    stop = {k: v for k, v in given.items() if v is not None}
    if stop and not prefill_once:  # per output row: repeated with the prompts' rows
        raise ValueError("sample_completions: limits and groups need one prefill per prompt")
    if mesh is None:
        inputs = jax.tree.map(jnp.asarray, inputs)
        stop = jax.tree.map(jnp.asarray, stop)
    else:
        inputs = runtime.place_batch(inputs, mesh)
        if stop and jax.process_count() > 1:  # numbered over the pod's prompts and rows
            prompts = runtime.row_starts(mesh, len(batch["input_ids"]))
            rows = runtime.row_starts(mesh, len(next(iter(stop.values()))))
            stop = pod_rows(stop, prompts, rows, jax.process_index())
        order = stop.pop("order", None)
        stop = runtime.place_batch(stop, mesh) if stop else stop
        if order is not None:
            stop["order"] = runtime.replicate(order, mesh)
        key = runtime.replicate(key, mesh)
    if need is not None:
        stop["need"] = np.int32(need) if mesh is None else runtime.replicate(np.int32(need), mesh)
    weights = None
    rows = int(inputs["input_ids"].shape[0]) * (num_samples if prefill_once else 1)
    rows = rows if prompt_of is None else len(prompt_of)
    rows = sampler.decode_rows(rows, prefill_once)
    if decode is not None:
        params = decode.params(sampler, params)
        weights = decode.get(sampler, params, rows)
    out, times = sampler.timed(
        params,
        inputs["input_ids"],
        inputs["attention_mask"],
        inputs["position_ids"],
        inputs["deltas"],
        key,
        images=inputs["images"],
        videos=inputs["videos"],
        pools=inputs["pools"],
        decode_weights=weights,
        num_samples=num_samples,
        prefill_once=prefill_once,
        **stop,
    )
    out = runtime.host_local(out)
    if len(out.tokens) != mine:  # a pod's process reads its own rows, never another's
        raise ValueError(
            f"sample_completions: {len(out.tokens)} rows came back to this process, not its "
            f"{mine}: the sampler's outputs are not split by row over the rollout mesh"
        )
    return (out, times) if timed else out


def pod_rows(stop: dict, prompt_starts: list, row_starts: list, pid: int) -> dict:
    """Process `pid`'s stop rule (`sample_completions`: limits, groups, prompt_of over its
    rows, numbered from 0) as its part of the pod's, each process's prompts and rows a run of
    the global ones starting at `prompt_starts[p]` and `row_starts[p]` (`runtime.row_starts`):
    its prompts and groups numbered from there, and with groups the order the
    pod's rows take slots in (`order`: the processes' k-th rows one after another, by
    process index)."""
    rows = len(next(iter(stop.values())))
    out = dict(stop)
    if "prompt_of" in stop:
        out["prompt_of"] = np.asarray(stop["prompt_of"], np.int32) + prompt_starts[pid]
    if "groups" in stop:
        groups = np.asarray(stop["groups"], np.int32)
        out["groups"] = np.where(groups >= 0, groups + row_starts[pid], -1).astype(np.int32)
        starts = np.asarray(row_starts, np.int32)
        out["order"] = (np.arange(rows, dtype=np.int32)[:, None] + starts[None, :]).reshape(-1)
    return out


def sampler_info(sampler, out, times: dict, prefill_once: bool = True) -> dict:
    """A sampler call's figures for the rollout's metrics: the tokens it generated and its
    rows (`out`: this process's), the seconds of its two programs (`times`: prefill_s,
    decode_s), its decode steps and the rows x steps they ran (every row, or the sampler's
    slots, fewer where its loop narrowed: `decode_work` in times); on a pod, whose call runs
    every process's rows in one program, this process's share of them."""
    lengths = np.asarray(out.mask).sum(1)
    steps = float(out.steps)
    n = jax.process_count()
    rows = sampler.decode_rows(len(lengths) * n, prefill_once)  # the pod's (slots: global)
    return dict(
        times,
        tokens=float(lengths.sum()),
        rows=len(lengths),
        decode_steps=steps,
        decode_work=float(times.get("decode_work", rows * steps)) / n,
    )


def decode_completions(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    return [
        tokenizer.decode(row[: int(m.sum())].tolist(), skip_special_tokens=True)
        for row, m in zip(tokens, mask)
    ]


@dataclasses.dataclass
class RolloutPhase:
    """The static pieces of the rollout phase; `run` does one step's rollout.

    collate(examples, repeat) -> the collated prompt batch, each example on `repeat` rows
    (pipeline.collate): the sampler gets each prompt once and samples it G times (one prefill
    per prompt), the train batch has G rows per prompt;
    reward_weights(step) -> {name: weight}; attention: None, or (layer_set, last_k) to compute
    rollout attention metrics from the sampler's masses (needed by the MDI reward and the
    attention log); with_pools: the train batch carries the attention pools (VGR weights);
    sampled_masses: L (the decoder's layers) where the train batch carries the sampler's
    attention masses (VGR weights shaped from the sampler: no clean pass), else 0;
    greedy: the greedy sampler, to score each prompt's greedy completion as the remax baseline
    (reward columns only: the MDI reward sees no attention statistics there and gives 0);
    accuracy: the reward whose mean is also logged as `accuracy` (None: none is).
    """

    sampler: Sampler
    tokenizer: object
    collate: Callable[[list, int], dict]
    rewards: dict  # {name: SafeReward}
    reward_weights: Callable[[int], dict]
    opts: FilterOptions
    attention: tuple[str, int] | None = None
    with_pools: bool = False
    sampled_masses: int = 0
    mdi_balance_ratio: float = 2.0
    replay: rl.ReplayBuffer | None = None
    greedy: Sampler | None = None
    mesh: Mesh | None = None  # where the sampler's inputs go (None: the default device)
    accuracy: str | None = "mc_idx"
    decode: PhaseWeights = dataclasses.field(default_factory=PhaseWeights)
    # a reward model (trainer/reward_model.py: RewardModel): (prompts, completions) -> its
    # scores, the reward `model` with its `weight` in the total; None: none
    reward_model: Callable | None = None
    # ((L', k), dtype) of the routes the sampler records (None: none): a batch of padding
    # groups alone carries zeros, so that every process's part of a step's batch has them
    routes: tuple | None = None
    # the rewards' calls (trainer/scoring.py: RewardScorer; None: `rewards` in-process, no
    # timeout); stop() -> whether to abandon them (SIGTERM), set by `run`
    scorer: RewardScorer | None = None
    stop: Callable[[], bool] | None = None
    # partial rollouts (trainer/partial.py: PartialRollouts, the rows carried between steps);
    # None: every row of a step is sampled to its end within the step
    partial: object = None

    def __post_init__(self):
        if self.scorer is None:
            self.scorer = RewardScorer(
                self.rewards, constants=reward_constants(self.mdi_balance_ratio)
            )

    def close(self) -> None:
        """Stop the reward workers."""
        self.scorer.close()

    @property
    def tallies(self) -> dict:
        """{name: RewardTally}: each reward function's, and the reward model's as `model`."""
        tally = getattr(self.reward_model, "tally", None)
        return {**self.rewards, **({"model": tally} if tally is not None else {})}

    def end_step(self) -> str | None:
        """Close the step's reward tallies -> why the run must end, or None."""
        return self.scorer.end_step(self.tallies.values())

    def generate(self, params, examples: list, key, step: int) -> tuple[list[Group], dict]:
        """One generation batch: sample, score, overlong / truncation rules -> its groups."""
        t0 = time.time()
        g = self.opts.group_size
        prompts = self.collate(examples, 1)
        pools = None
        if self.attention is not None:
            pools = prompts["pools"]
        out, times = sample_completions(
            self.sampler,
            params,
            prompts,
            key,
            pools,
            self.mesh,
            self.decode,
            num_samples=g,
            timed=True,
        )
        t_sample = time.time() - t0
        batch = repeat_prompts(prompts, g)  # the completions' rows: G per prompt
        att = self.attention_metrics(out, batch)
        groups = self.make_groups(params, examples, batch["rows"], out, step, att, batch)
        once = prefills_once(len(examples), prompt_mesh(self.sampler, self.mesh))
        return groups, dict(sampler_info(self.sampler, out, times, once), sample_s=t_sample)

    def make_groups(
        self, params, examples: list, rows: list, out, step: int, att=None, batch=None
    ) -> list[Group]:
        """The groups of ended completions: G rows per example (`rows` the examples per row,
        `out` their tokens, mask, truncated, logprobs and entropies as numpy arrays), decoded,
        scored, with the greedy baseline (needs the collated `batch`) and the truncation rule.
        att: per-row attention metrics {name: float32[B]} (None: none)."""
        g, att = self.opts.group_size, att or {}
        width = None if batch is None else batch["attention_mask"].shape[1]
        real = None if batch is None else batch["attention_mask"].sum(axis=1)
        texts = decode_completions(self.tokenizer, out.tokens, out.mask)
        extra = reward_statistics(att)
        mask = np.asarray(out.mask, np.float32)
        masses = (out.vision_mass, out.text_mass)
        ids = completion_ids(out.tokens, mask)
        totals, parts = self._score(step, rows, texts, mask.sum(1), extra, ids)
        totals, parts = self._score_model(totals, parts, rows, texts)
        baseline = np.zeros(len(texts))
        if self.greedy is not None:
            baseline = self._greedy_baseline(params, batch, step)
        if self.opts.mask_truncated_completions:
            mask = rl.mask_truncated_completions(mask, out.truncated)
        groups = []
        for i, ex in enumerate(examples):
            s = slice(i * g, (i + 1) * g)
            groups.append(
                Group(
                    example=ex,
                    tokens=np.asarray(out.tokens[s], np.int32),
                    mask=mask[s],
                    truncated=np.asarray(out.truncated[s], bool),
                    totals=totals[s],
                    parts={k: v[s] for k, v in parts.items()},
                    texts=texts[s],
                    att={k: v[s] for k, v in att.items()},
                    baseline=baseline[s],
                    logprobs=np.asarray(out.logprobs[s], np.float32),
                    entropies=None
                    if out.entropies is None
                    else np.asarray(out.entropies[s], np.float32),
                    masses=None
                    if not self.sampled_masses
                    else tuple(np.moveaxis(np.asarray(m[:, s]), 0, 1) for m in masses),
                    # the real prompt tokens' and the completion's (width-independent)
                    routes=None
                    if out.routes is None
                    else np.asarray(out.routes[s, width - int(real[i * g]) :]),
                )
            )
        return groups

    def _score(self, step: int, rows: list, texts: list, lengths, extra: dict, ids=None):
        """-> (totals float64[B] incl. the soft overlong punishment, {name: float64[B]} and
        the sub-scores {name/key: float64[B]}). ids: the completions' token ids. Raises
        RewardsInterrupted at a stop."""
        values, subs = self.scorer.score(
            rows, texts, lengths, extra, stop=self.stop, ids=ids, step=step
        )
        totals = rl.rewards.weighted_total(values, self.reward_weights(step), len(texts))
        parts = {**values, **subs}
        o = self.opts
        if o.overlong_buffer_len:  # in the totals, and shown beside the rewards
            penalty = rl.soft_overlong_punishment(
                lengths, o.max_new_tokens, o.overlong_buffer_len, o.overlong_penalty_factor
            )
            totals = totals + penalty
            parts[OVERLONG] = np.asarray(penalty, np.float64)
        return totals, parts

    def _score_model(self, totals: np.ndarray, parts: dict, rows: list, texts: list):
        """The reward model's scores of the rows' prompt texts and the completions, added to
        the totals with its weight and to the parts as reward `model`."""
        if self.reward_model is None:
            return totals, parts
        scores = self.reward_model([model_prompt(r) for r in rows], texts)
        return totals + self.reward_model.weight * scores, {**parts, "model": scores}

    def _greedy_baseline(self, params, batch: dict, step: int) -> np.ndarray:
        """float64[B]: the total reward of each prompt's greedy completion, on its G rows
        (the mdi reward from the greedy completion's own attention, where the rollout
        measures it). The greedy sampler runs on the whole batch (the validation shape: no
        new program)."""
        g = self.opts.group_size
        key = jax.random.key(0)
        pools = None if self.attention is None else batch["pools"]
        out = sample_completions(self.greedy, params, batch, key, pools, self.mesh, self.decode)
        att = self.attention_metrics(out, batch)
        extra = reward_statistics(att, slice(None, None, g))
        tokens, mask = out.tokens[::g], out.mask[::g]
        texts = decode_completions(self.tokenizer, tokens, mask)
        ids = completion_ids(tokens, mask)
        totals, _ = self._score(step, batch["rows"][::g], texts, mask.sum(1), extra, ids)
        totals, _ = self._score_model(totals, {}, batch["rows"][::g], texts)
        return np.repeat(totals, g)

    def attention_metrics(self, out, batch) -> dict:
        """Per-row rollout attention metrics {mdi, mdi_early, ..., aei_*: float32[B]} from the
        sampler's masses (`out`: vision_mass, text_mass, mask) over the pools of `batch` (the
        collated rows' own prompts); {} without masses."""
        if self.attention is None or out.vision_mass is None:
            return {}
        layer_set, last_k = self.attention
        pools = batch["pools"]
        m = rl.attention_metrics(
            jnp.asarray(out.vision_mass),
            jnp.asarray(out.text_mass),
            jnp.asarray(pools["vision"].sum(1)),
            jnp.asarray(pools["text"].sum(1)),
            jnp.asarray(out.mask),
            layer_set=layer_set,
            last_k=last_k,
        )
        return {k: np.asarray(v) for k, v in m.items() if np.ndim(v) == 1}

    def run(
        self,
        params,
        step: int,
        key,
        examples: Iterator[list],
        max_prompts: int | None = None,
        stop: Callable[[], bool] | None = None,
        version: int | None = None,
    ) -> Rollout:
        """Generation batches from `examples` (an iterator of P-example lists) until the
        filters are satisfied, then the fixed-shape batch of P groups for train step `step`,
        sampled by the policy of `version` (None: `step`'s). stop() -> true abandons the
        running reward calls (RewardsInterrupted)."""
        infos = []
        self.stop = stop

        def generate(i):
            k = jax.random.fold_in(key, i)
            if self.partial is not None:  # carried rows first; stops once P groups are whole
                groups, info = self.partial.generate(self, params, examples, k, step, version)
            else:
                groups, info = self.generate(params, next(examples), k, step)
            infos.append(info)
            return groups

        try:
            got = collect_groups(generate, self.opts, replay=self.replay, max_prompts=max_prompts)
        finally:
            self.decode.end_phase()
        real = np.array([x is not None for x in got.groups])
        n = self.opts.max_new_tokens
        groups = [
            x if x is not None else Group.padding(got.sampled[0].example, self.opts.group_size, n)
            for x in got.groups
        ]
        batch = self._assemble(groups)
        metrics = self._metrics(got, infos, real)
        if self.partial is not None:  # the staleness of the rows trained
            metrics.update(
                self.partial.take_metrics([x for x in got.groups if x is not None], step)
            )
        if version is not None and self.partial is None:  # a batch sampled a step ahead
            lag = float(step - version)
            metrics.update({"rollout/staleness_mean": lag, "rollout/staleness_max": lag})
        return Rollout(batch, groups, real, metrics, got.sampled, self._assemble_rows)

    def _assemble(self, groups: list[Group]) -> RolloutBatch:
        prompts = self.collate([x.example for x in groups], self.opts.group_size)
        return assemble_prompts(
            prompts,
            np.concatenate([x.tokens for x in groups]),
            np.concatenate([x.mask for x in groups]),
            np.concatenate([x.totals for x in groups]),
            with_pools=self.with_pools,
            baseline=np.concatenate([x.baseline for x in groups]).astype(np.float32),
            old_logprobs=np.concatenate([x.logprobs for x in groups]),
            old_entropy=entropies(groups) if self.sampler.cfg.entropies else None,
            routes=group_routes(groups, prompts["input_ids"].shape[1], self.routes),
            masses=group_masses(groups, self.sampled_masses) if self.sampled_masses else None,
        )

    def _assemble_rows(self, rows: list[tuple[Group, int]]) -> RolloutBatch:
        """Completion j of each (group, j) as one row of a batch (the logged samples)."""
        return assemble_prompts(
            self.collate([x.example for x, _ in rows], 1),
            np.stack([x.tokens[j] for x, j in rows]),
            np.stack([x.mask[j] for x, j in rows]),
            np.asarray([x.totals[j] for x, j in rows]),
            with_pools=self.with_pools,
        )

    def _metrics(self, got: Collected, infos: list[dict], real: np.ndarray) -> dict:
        """Means over every completion sampled this step on every process (what the policy
        does), plus the filtering counts."""
        sampled = got.sampled
        totals = np.concatenate([x.totals for x in sampled])
        lengths = np.concatenate([x.mask.sum(1) for x in sampled])
        sample_s = sum(i["sample_s"] for i in infos)
        names = [*self.rewards, *(["model"] if self.reward_model is not None else [])]
        names += [OVERLONG] if all(OVERLONG in x.parts for x in sampled) else []
        m = {f"reward/{k}": float(np.mean([x.parts[k] for x in sampled])) for k in names}
        # sub-scores and metrics of dict-returning rewards (NaN: rows without the key)
        subs = dict.fromkeys(k for x in sampled for k in x.parts if "/" in k)
        for k in subs:
            vals = [x.parts.get(k, np.full(len(x.texts), np.nan)) for x in sampled]
            m[f"reward/{k}"] = _finite_mean(np.concatenate(vals))
        # failures and timeouts over the run (SafeReward counts them; the checkpoint keeps them)
        m.update({f"reward/{k}_failures": float(fn.failures) for k, fn in self.tallies.items()})
        m.update({f"reward/{k}_timeouts": float(fn.timeouts) for k, fn in self.rewards.items()})
        # wall time waiting for the reward functions (greedy baseline's included)
        m["rollout/reward_s"] = self.scorer.take_seconds()
        m["reward/total"] = float(totals.mean())
        if self.accuracy in self.rewards:
            m["accuracy"] = m[f"reward/{self.accuracy}"]
        m.update(
            {
                "response_length": float(lengths.mean()),
                "tokens_per_s": sum(i["tokens"] for i in infos) / max(sample_s, 1e-6),
                "rollout/gen_batches": float(got.gen_batches),
                "rollout/kept_groups_fraction": got.kept / max(len(sampled), 1),
                "rollout/filled_fraction": float(real.mean()),
                "rollout/sample_s": sample_s,
                # the sampler's two programs (compiling included at a new shape)
                "rollout/prefill_s": sum(i["prefill_s"] for i in infos),
                "rollout/decode_s": sum(i["decode_s"] for i in infos),
                # decode steps per generation batch (the loop stops once every row ended)
                "rollout/decode_steps": float(np.mean([i["decode_steps"] for i in infos])),
                # generated tokens over the rows x decode steps the sampler ran: the share
                # of its decode work that produced tokens (finished rows idle until the end)
                "rollout/slot_utilization": sum(i["tokens"] for i in infos)
                / max(sum(i["decode_work"] for i in infos), 1.0),
            }
        )
        m["rollout/tokens_per_s"] = m["tokens_per_s"]
        if self.greedy is not None:
            m["reward/greedy_baseline"] = float(np.mean([x.baseline for x in sampled]))
        if self.replay is not None:
            m["replay/replaced"] = float(got.replaced)
            m["replay/buffer_size"] = float(len(self.replay))
        att = [x.att for x in sampled if x.att]
        for k in att[0] if att else ():
            m[f"attn/{k}"] = _finite_mean(np.concatenate([a[k] for a in att]))
        # every process samples its own rows: log what all of them did, not process 0's share
        sums = {"tokens_per_s", "rollout/tokens_per_s", "replay/replaced", "replay/buffer_size"}
        sums |= {k for k in m if k.endswith(("_failures", "_timeouts"))}
        return runtime.metrics_across_processes(m, weight=len(totals), sums=sums)
