"""A step's groups on the host: one prompt's G completions with their rewards (`Group`), the
rollout filters and overlong rules (`FilterOptions`, `keep_flags`), and the collection of
groups until the step's P are found (`collect_groups`: dynamic sampling with refill, online
filtering, the replay buffer); docs/algorithms.md (rollout filtering) gives the rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxvrl import rl
from jaxvrl.config import ConfigError
from jaxvrl.parallel import runtime

OVERALL = "overall"  # a filter metric: the total (weighted) reward


class GroupsExhausted(ConfigError):
    """Dynamic sampling without a batch limit read a whole pass over the data without finding
    a step's groups: training cannot go on (the run saves, then stops with one line)."""


@dataclasses.dataclass(frozen=True)
class FilterOptions:
    """The rollout filters and overlong rules (docs/algorithms.md). Metrics / keys name a
    reward, or OVERALL for the total reward."""

    group_size: int
    prompts_per_step: int
    max_new_tokens: int
    mask_truncated_completions: bool = False
    overlong_buffer_len: int = 0  # 0 = no soft overlong punishment
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = False
    dynamic_sampling_metric: str = OVERALL
    max_num_gen_batches: int = 1  # 0 = no limit (guarded: at most one pass over the data)
    online_filtering: bool = False
    filter_key: str = OVERALL
    filter_low: float = 0.01
    filter_high: float = 0.99


@dataclasses.dataclass
class Group:
    """One prompt's G completions (host numpy).

    tokens int32[G, N]; mask float32[G, N] the loss mask (completion incl. EOS, truncated rows
    zeroed when masked); logprobs float32[G, N] the sampler's log-probs of the tokens (under
    the policy that sampled them: for a replayed group, an earlier one); truncated bool[G]; totals float64[G] the weighted total reward after
    the overlong punishment; parts {reward name: float64[G]} unweighted; texts G strings;
    att {name: float32[G]} per-row attention metrics (empty without statistics); baseline
    float64[G] the prompt's greedy-completion reward (remax), else zeros; entropies
    float32[G, N] the sampler's entropies of the distributions it drew from, or None;
    versions int32[G, N] the step whose policy sampled each token (-1: none) where rows were
    carried across steps (partial rollouts), else None (all this step's); routes int[G, p +
    N, L', k] the experts each sparse layer routed every real prompt token (p of them) and
    completion token to in the sampler (`SampleOutput.routes`), or None; masses (A_V, A_X)
    float32[G, L, N] the sampler's attention masses of each token's predictor per decoder
    layer, where the train step reads them (VGR weights shaped from the sampler), else None.
    """

    example: dict
    tokens: np.ndarray
    mask: np.ndarray
    truncated: np.ndarray
    totals: np.ndarray
    parts: dict
    texts: list
    att: dict
    baseline: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    entropies: np.ndarray | None = None
    versions: np.ndarray | None = None
    routes: np.ndarray | None = None
    masses: tuple | None = None

    def __post_init__(self):
        if self.baseline is None:
            self.baseline = np.zeros(len(self.totals))
        if self.logprobs is None:
            self.logprobs = np.zeros(self.tokens.shape, np.float32)

    def metric(self, name: str) -> np.ndarray:
        return self.totals if name == OVERALL else self.parts[name]

    @staticmethod
    def padding(example: dict, group_size: int, length: int) -> Group:
        """A group that takes no part in the loss (completion mask 0, reward 0)."""
        zeros = np.zeros(group_size)
        return Group(
            baseline=zeros,
            example=example,
            tokens=np.zeros((group_size, length), np.int32),
            mask=np.zeros((group_size, length), np.float32),
            truncated=np.zeros(group_size, bool),
            totals=zeros,
            parts={},
            texts=[""] * group_size,
            att={},
        )


def masses(groups: list[Group], layers: int) -> tuple[np.ndarray, np.ndarray]:
    """The groups' sampler masses (A_V, A_X) [rows, L, N] (zeros for groups without them:
    padding)."""

    def of(x, i):
        if x.masses is None:
            return np.zeros((x.tokens.shape[0], layers, x.tokens.shape[1]), np.float32)
        return x.masses[i]

    return tuple(np.concatenate([of(x, i) for x in groups]) for i in (0, 1))


def entropies(groups: list[Group]) -> np.ndarray:
    """The groups' sampler entropies [rows, N] (zeros for padding groups, which have none)."""
    zeros = lambda x: np.zeros(x.tokens.shape, np.float32)  # noqa: E731
    return np.concatenate([zeros(x) if x.entropies is None else x.entropies for x in groups])


def routes(groups: list[Group], prompt_width: int, like: tuple | None = None) -> np.ndarray | None:
    """The groups' routes [rows, prompt_width + N, L', k], each group's prompt part
    left-padded to `prompt_width` as the collated prompts are (zeros on padding, and for a
    group without routes). Where no group has any: zeros with like = ((L', k), dtype), the
    routes the sampler records (a batch of padding groups alone still carries them, as every
    process's part of a step's batch must), else None."""
    known = [x.routes for x in groups if x.routes is not None]
    if not known and like is None:
        return None
    n = groups[0].tokens.shape[1]
    per_token, dtype = (known[0].shape[2:], known[0].dtype) if known else like
    out = np.zeros((sum(len(x.tokens) for x in groups), prompt_width + n, *per_token), dtype)
    row = 0
    for x in groups:
        if x.routes is not None:
            out[row : row + len(x.tokens), prompt_width + n - x.routes.shape[1] :] = x.routes
        row += len(x.tokens)
    return out


def keep_flags(groups: list[Group], opts: FilterOptions) -> np.ndarray:
    """bool[len(groups)]: dynamic sampling (metric not constant within the group) and online
    filtering (filter_low < mean score < filter_high), each when enabled."""
    keep = np.ones(len(groups), bool)
    if not groups:
        return keep
    g = opts.group_size
    if opts.dynamic_sampling:
        metric = np.concatenate([x.metric(opts.dynamic_sampling_metric) for x in groups])
        keep &= rl.dynamic_sampling_keep(metric, g)
    if opts.online_filtering:
        scores = np.concatenate([x.metric(opts.filter_key) for x in groups])
        keep &= rl.online_filter_keep(scores, g, opts.filter_low, opts.filter_high)
    return keep


@dataclasses.dataclass
class Collected:
    """The P groups of a step, in batch order (None where nothing was found for a place), and
    what happened."""

    groups: list
    sampled: list[Group]  # every group generated this step, in order
    gen_batches: int
    kept: int  # groups that passed the filters (before truncation to P)
    replaced: int = 0  # places filled from the replay buffer


def collect_groups(
    generate: Callable[[int], list[Group]],
    opts: FilterOptions,
    *,
    replay: rl.ReplayBuffer | None = None,
    max_prompts: int | None = None,
    any_process: Callable[[bool], bool] = runtime.any_process,
) -> Collected:
    """Calls generate(i) for generation batches i = 0, 1, ... until P groups passed the filters
    or, with dynamic sampling, max_num_gen_batches batches were generated (without it: one).

    max_num_gen_batches = 0 means no limit; then a step that has used `max_prompts` prompts (one
    pass over the data) without filling up raises, rather than looping for ever. With a replay
    buffer, uninformative groups among the P (by the buffer's std/mean rule on the total
    reward) and empty places are filled from the buffer, most recent first; this step's
    informative groups go into the buffer. any_process(flag) -> whether any process has
    `flag` (the loop runs until no process needs more groups).
    """
    p, limit = opts.prompts_per_step, opts.max_num_gen_batches if opts.dynamic_sampling else 1
    sampler = rl.DynamicSampler(target_groups=p, max_num_gen_batches=limit)
    sampled = []
    i = 0
    # generate() runs the sampler on the mesh, a collective: every process calls it equally
    # often, so a process whose groups are complete keeps generating (and drops the groups)
    # while another still needs some.
    while any_process(not sampler.done):
        if limit == 0 and max_prompts is not None and i * p >= max(max_prompts, p):
            raise GroupsExhausted(
                f"dynamic sampling found {len(sampler.groups)} of the {p} groups a step needs "
                f"after {i} generation batches ({i * p} prompts, a full pass over the "
                f"{max_prompts} training prompts): the metric "
                f"{opts.dynamic_sampling_metric!r} is the same for every completion of almost "
                "every prompt. Check the reward, or set config.filter.max_num_gen_batches > 0 "
                "to train on a part-filled batch."
            )
        groups = generate(i)
        i += 1
        if not sampler.done:
            sampled += groups
            sampler.add(groups, keep_flags(groups, opts))
    kept, gen_batches = len(sampler.groups), sampler.num_gen_batches
    chosen = sampler.take()
    chosen += [None] * (p - len(chosen))
    out = Collected(chosen, sampled, gen_batches, kept)
    if replay is not None:
        informative = [
            x is not None and bool(replay.informative(x.totals, opts.group_size)[0]) for x in chosen
        ]
        out.groups, out.replaced = replay.fill(chosen, informative)
    return out
