"""Partial rollouts (`rollout.partial`): a step's rollout stops once its groups are complete
and carries the unfinished rows into the next step's rollout, so that no step waits for its
longest completion (docs/algorithms.md, partial rollouts).

A step's rollout (`PartialRollouts.generate`, one generation batch of the filters' loop):

1. Groups carried from earlier steps whose oldest token is more than `max_staleness` policy
   versions behind are dropped whole (their rows counted).
2. One sampler call of `oversample` x the step's prompts places, G rows each (the slots
   engine): the carried rows that have not ended first, oldest first, each as a prompt of its
   own (its prompt and tokens so far, prefilled) with the tokens it has left; then fresh
   prompts (those carried before any of their rows started, then new ones). The call stops
   once the step's groups are complete: the slots never idle in a long row's tail.
3. The complete groups, oldest first, are scored and handed to the filters; the rest are
   carried (in the checkpoint: `Flight`s in the replay item's format).

Every token keeps the log-prob and the version (step) of the policy that sampled it: the
loss's behaviour log-probs are the sampler's, off-policy tokens corrected by
`algorithm.rollout_is` / `rollout_is_band`. Shapes: G rows per group, N = max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxvrl.parallel import runtime
from jaxvrl.sampling import SampleOutput
from jaxvrl.trainer.groups import Group


@dataclasses.dataclass
class Flight:
    """One prompt's G rows in flight (host numpy): tokens int32[G, N] and the sampler's
    logprobs float32[G, N] so far; versions int32[G, N] the step whose policy sampled each
    token (-1: none yet); length int32[G] the tokens so far; ended / truncated bool[G];
    entropies float32[G, N] or None; vision_mass / text_mass float32[L, G, N], the sampler's
    per-layer attention masses of each token (`attention_pools`), or None."""

    example: dict
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    length: np.ndarray
    ended: np.ndarray
    truncated: np.ndarray
    entropies: np.ndarray | None = None
    vision_mass: np.ndarray | None = None
    text_mass: np.ndarray | None = None

    @staticmethod
    def fresh(example: dict, g: int, n: int, entropies: bool, layers: int = 0) -> Flight:
        """A prompt whose G rows have no token yet (layers > 0: with attention masses)."""
        mass = (lambda: np.zeros((layers, g, n), np.float32)) if layers else (lambda: None)
        return Flight(
            example=example,
            tokens=np.zeros((g, n), np.int32),
            logprobs=np.zeros((g, n), np.float32),
            versions=np.full((g, n), -1, np.int32),
            length=np.zeros(g, np.int32),
            ended=np.zeros(g, bool),
            truncated=np.zeros(g, bool),
            entropies=np.zeros((g, n), np.float32) if entropies else None,
            vision_mass=mass(),
            text_mass=mass(),
        )

    @property
    def complete(self) -> bool:
        return bool(self.ended.all())

    @property
    def started(self) -> bool:
        return bool((self.length > 0).any())

    def staleness(self, step: int) -> np.ndarray:
        """int[G]: the policy versions between each row's first token and `step` (0 for a row
        with no token yet)."""
        return staleness(self.versions, step)

    def extend(self, j: int, out, b: int, version: int) -> int:
        """Appends output row `b` of a sampler call (numpy SampleOutput) to row `j`, sampled
        by the policy of `version`; -> the tokens added."""
        k0, m = int(self.length[j]), int(np.asarray(out.mask[b]).sum())
        end = k0 + m
        self.tokens[j, k0:end] = out.tokens[b, :m]
        self.logprobs[j, k0:end] = out.logprobs[b, :m]
        self.versions[j, k0:end] = version
        if self.entropies is not None and out.entropies is not None:
            self.entropies[j, k0:end] = out.entropies[b, :m]
        if self.vision_mass is not None:
            self.vision_mass[:, j, k0:end] = out.vision_mass[:, b, :m]
            self.text_mass[:, j, k0:end] = out.text_mass[:, b, :m]
        self.length[j] = end
        self.ended[j] = bool(out.ended[b])
        self.truncated[j] = bool(out.ended[b]) and bool(out.truncated[b])
        return m

    def output(self) -> SampleOutput:
        """The rows as a SampleOutput of numpy arrays (tokens, logprobs, mask, truncated,
        entropies, the attention masses): what `RolloutPhase.make_groups` reads."""
        n = self.tokens.shape[1]
        mask = (np.arange(n)[None, :] < self.length[:, None]).astype(np.float32)
        return SampleOutput(
            tokens=self.tokens,
            logprobs=self.logprobs,
            mask=mask,
            truncated=self.truncated,
            vision_mass=self.vision_mass,
            text_mass=self.text_mass,
            entropies=self.entropies,
        )


def _stack_rows(rows: list[SampleOutput]) -> SampleOutput:
    """Flights' outputs as one, rows in order (the masses' rows are their second axis)."""
    masses = ("vision_mass", "text_mass")

    def cat(name):
        xs = [getattr(r, name) for r in rows]
        return None if xs[0] is None else np.concatenate(xs, axis=1 if name in masses else 0)

    fields = ("tokens", "logprobs", "mask", "truncated", "entropies", *masses)
    return SampleOutput(**{k: cat(k) for k in fields})


def call_width(prompts_per_step: int, oversample: float, row_groups: int = 1) -> int:
    """Groups a partial rollout's sampler call holds: oversample x the step's prompts, at
    least the step's, rounded up to a multiple of the rollout mesh's `row_groups` on this
    process (so that the call's prompts and rows split over them)."""
    width = max(prompts_per_step, math.ceil(oversample * prompts_per_step))
    return -(-width // row_groups) * row_groups


@dataclasses.dataclass
class PartialRollouts:
    """The rows carried between steps and the rules that carry them. `flights`: the groups in
    flight, oldest first (restored from the checkpoint on resume)."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    oversample: float = 1.0
    max_staleness: int = 1
    entropies: bool = False
    # the text decoder's layers where the rollout keeps each token's attention masses (the
    # MDI reward, attention token methods, the attention log); 0: none
    layers: int = 0
    # (example, j) -> the most tokens row j of the example may have (at most max_new_tokens;
    # a benchmark's forced lengths), None: max_new_tokens for every row
    row_limit: Callable[[dict, int], int] | None = None
    # the rollout mesh's row groups on this process (`call_width`)
    row_groups: int = 1
    flights: list[Flight] = dataclasses.field(default_factory=list)
    # this step's counts, read and reset by `take_metrics`
    dropped: int = 0

    @property
    def width(self) -> int:
        """Groups a sampler call holds (width x G work rows): `call_width`."""
        return call_width(self.prompts_per_step, self.oversample, self.row_groups)

    def drop_stale(self, step: int) -> int:
        """Drops the flights with a row more than max_staleness versions behind `step`;
        -> the rows dropped."""
        keep, dropped = [], 0
        for f in self.flights:
            if f.staleness(step).max() > self.max_staleness:
                dropped += len(f.length)
            else:
                keep.append(f)
        self.flights = keep
        self.dropped += dropped
        return dropped

    def generate(
        self, phase, params, examples, key, step: int, version: int | None = None
    ) -> tuple[list[Group], dict]:
        """One generation batch of the step (see the module's docstring): its complete
        groups, oldest first, at most the step's prompts, and the sampler's info.
        `phase`: the RolloutPhase (its collate, sampler, mesh, decode weights and scoring);
        examples: the iterator of P-example lists; the batch trains at `step`, sampled by the
        policy of `version` (default: `step`; one-step-off training samples a step ahead)."""
        t0 = time.time()
        self.drop_stale(step)
        p = self.prompts_per_step
        need, infos = p - sum(f.complete for f in self.flights), []
        # a call whose rows all end completes all its groups: few calls; on a pod every
        # process takes part in each call (one program) until each has its groups
        while runtime.any_process(need > 0):
            k = jax.random.fold_in(key, len(infos))
            infos.append(
                self._call(phase, params, examples, k, need, step if version is None else version)
            )
            need = p - sum(f.complete for f in self.flights)
        done = [f for f in self.flights if f.complete][:p]
        groups = []
        if done:  # scored before they leave the flights: a stop while the rewards run
            # (RewardsInterrupted) leaves them carried, and the checkpoint holds them
            out = _stack_rows([f.output() for f in done])
            examples = [f.example for f in done]
            rows = [f.example for f in done for _ in range(self.group_size)]
            att = None
            if self.layers:  # the masses over the prompts' own pools
                batch = phase.collate(examples, self.group_size)
                att = phase.attention_metrics(out, batch)
            groups = phase.make_groups(params, examples, rows, out, step, att)
            for x, f in zip(groups, done):
                x.versions = f.versions
            chosen = {id(f) for f in done}
            self.flights = [f for f in self.flights if id(f) not in chosen]
        return groups, _merge(infos, time.time() - t0)

    def _call(self, phase, params, examples, key, need: int, version: int) -> dict:
        """One sampler call of width x G work rows until `need` groups are complete. The
        carried groups' rows that have not ended go first, oldest group first (whole groups,
        while they fit), each row a prompt of its own (its prompt and tokens so far, prefilled)
        with the tokens it has left; fresh prompts (those carried before any row started, then
        new ones) take the rows left, G each; spare rows (one token, no group) fill the rest,
        queued last. The prompts are padded to width x 2^i (copies: a few prefill shapes)."""
        g, rows = self.group_size, self.width * self.group_size
        moving, c = [], 0
        for f in self.flights:
            left = int((~f.ended).sum())
            if f.started and not f.complete and c + left <= rows:
                moving += [(f, j) for j in range(g) if not f.ended[j]]
                c += left
        waiting = [f for f in self.flights if not f.started]
        while len(waiting) < (rows - c) // g:
            fresh = [
                Flight.fresh(ex, g, self.max_new_tokens, self.entropies, self.layers)
                for ex in next(examples)
            ]
            self.flights += fresh
            waiting += fresh
        waiting = waiting[: (rows - c) // g]
        ids = {}  # each flight's group id in the call
        for f in [f for f, _ in moving] + waiting:
            ids.setdefault(id(f), len(ids))
        prompts, order = [], []  # order: (flight, row, prompt, limit, group) in queue order
        prefixes = []  # each prompt's tokens that are a carried row's own (its last ones)
        for f, j in moving:
            k = int(f.length[j])
            prefixes.append(k)
            prompts.append(
                dict(f.example, prompt_ids=list(f.example["prompt_ids"]) + f.tokens[j, :k].tolist())
            )
            order.append((f, j, len(prompts) - 1, self._limit(f.example, j) - k, ids[id(f)]))
        for f in waiting:
            prefixes.append(0)
            prompts.append(f.example)
            order += [
                (f, j, len(prompts) - 1, self._limit(f.example, j), ids[id(f)]) for j in range(g)
            ]
        queue = order + [(None, -1, 0, 1, -1)] * (rows - len(order))
        places = self.width
        while places < len(prompts):
            places *= 2
        # on a pod: as many prompts on every process, and the groups that every process
        # still needs (a process with its groups complete stops no call: its rows count
        # in no group)
        pod = runtime.gather_json([places, max(need, 0)])
        places = max(x for x, _ in pod)
        group_of = np.asarray([q[4] if need > 0 else -1 for q in queue], np.int32)
        prefixes += [prefixes[0]] * (places - len(prompts))
        prompts += [prompts[0]] * (places - len(prompts))
        out, info = self._sample(
            phase,
            params,
            prompts,
            key,
            prefixes,
            prompt_of=np.asarray([q[2] for q in queue], np.int32),
            limits=np.asarray([q[3] for q in queue], np.int32),
            groups=group_of,
            need=sum(n for _, n in pod),
        )
        for b, (f, j, *_) in enumerate(order):
            f.extend(j, out, b, version)
        return info

    def _limit(self, example: dict, j: int) -> int:
        n = self.max_new_tokens
        return n if self.row_limit is None else min(n, int(self.row_limit(example, j)))

    def _sample(self, phase, params, examples, key, prefixes, **rows):
        from jaxvrl.trainer.rollout import sample_completions, sampler_info

        prompts = phase.collate(examples, 1)
        pools = None
        if self.layers:  # a carried row's own tokens are its completion's, in no pool
            own = np.arange(prompts["input_ids"].shape[1])[None, :] >= (
                prompts["input_ids"].shape[1] - np.asarray(prefixes)[:, None]
            )
            pools = {k: v & ~own for k, v in prompts["pools"].items()}
        out, times = sample_completions(
            phase.sampler,
            params,
            prompts,
            key,
            pools,
            phase.mesh,
            phase.decode,
            timed=True,
            **rows,
        )
        out = jax.tree.map(np.asarray, out)
        return out, sampler_info(phase.sampler, out, times)

    def take_metrics(self, trained: list, step: int) -> dict:
        """This step's partial-rollout metrics (then reset): rows carried into the next step,
        rows dropped as stale, and the staleness of the rows of the `trained` groups (the
        batch's, after the filters; a group without versions was sampled at `step`); on a
        pod, every process's (a collective)."""
        g = self.group_size
        stale = [
            np.zeros(g) if x.versions is None else staleness(x.versions, step) for x in trained
        ]
        rows = sum(len(x) for x in stale)
        stale = np.concatenate(stale) if stale else np.zeros(1)
        m = {
            "rollout/carried_rows": float(sum((f.length > 0).sum() for f in self.flights)),
            "rollout/carried_groups": float(len(self.flights)),
            "rollout/dropped_stale_rows": float(self.dropped),
            "rollout/staleness_mean": float(stale.mean()),
            "rollout/staleness_max": float(stale.max()),
        }
        self.dropped = 0
        counts = {"rollout/carried_rows", "rollout/carried_groups", "rollout/dropped_stale_rows"}
        return runtime.metrics_across_processes(
            m, weight=rows, sums=counts, maxes={"rollout/staleness_max"}
        )


def staleness(versions: np.ndarray, step: int) -> np.ndarray:
    """int[G]: the policy versions between each row's first token (`versions` int[G, N], -1:
    no token) and `step` (0 for a row with no token)."""
    first = np.where(versions >= 0, versions, step).min(axis=1)
    return step - first


def _merge(infos: list[dict], seconds: float) -> dict:
    """One info for a generation batch of several sampler calls (`_sample`'s; none where the
    carried groups were complete): tokens, rows, times and decode steps summed, with the
    decode work (rows x steps) and the wall time."""
    out = {"sample_s": seconds}
    for k in ("tokens", "rows", "prefill_s", "decode_s", "decode_steps"):
        out[k] = float(sum(i[k] for i in infos))
    out["decode_work"] = float(sum(i["decode_work"] for i in infos))
    return out
