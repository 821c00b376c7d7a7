"""Pieces of the train loop that train.py calls each step: validation, the step's scalars and
the run logs (metrics.jsonl, markdown logs, progress line, trackers: TensorBoard, wandb,
MLflow)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import re
import threading

import jax
import numpy as np

from jaxvrl import rl
from jaxvrl.data.prompts import shown_prompt
from jaxvrl.logging import (
    MarkdownLog,
    MetricsWriter,
    Progress,
    RunInfo,
    Trackers,
    attention_section,
    decode_pieces,
    heatmaps,
    rollout_section,
    rollout_table,
    token_weight_section,
)
from jaxvrl.logging.markdown import heatmap_section, token_colour_section
from jaxvrl.trainer.rollout import (
    PhaseWeights,
    Rollout,
    completion_ids,
    decode_completions,
    draw_samples,
    reward_statistics,
    sample_completions,
)

log = logging.getLogger(__name__)
ATTENTION_DIR = "attention"  # <workdir>/attention: the heatmaps' PNGs


def held_out_score(texts: list[str], examples: list[dict]) -> list[float]:
    """1.0 per right completion: a multiple-choice example (a `label_idx`, an option letter
    A-J as its `answer` ("B", "(B)", "B. dog"), or `choices` one of which its `answer` is) by
    `mc_idx`, any other by `accuracy` against its `answer` (else `solution`)."""
    out = []
    for text, ex in zip(texts, examples):
        answer, label = ex.get("answer"), ex.get("label_idx")
        if rl.rewards.missing_label(label):
            label = _option_of(answer, ex.get("choices"))
        if label is not None:
            out += rl.rewards.mc_idx_reward([text], [label])
        else:
            ref = answer if answer is not None else ex.get("solution")
            out += rl.rewards.accuracy_reward([text], answer=[ref])
    return out


def _option_of(answer, choices):
    """The option an `answer` names: a letter form ("B", "(B)", "B. dog", "B) dog"), with
    `choices` an index (0-based, int or digits) or the index of the choice whose text it is;
    None when it names none."""
    if choices and isinstance(answer, int | np.integer) and not isinstance(answer, bool):
        return int(answer)
    if not isinstance(answer, str):
        return None
    if choices and answer.strip().isdigit():
        return answer
    if re.fullmatch(r"\s*[(\[]?[A-J][)\]]?\s*|\s*[(\[]?[A-J][.:)\]]\s+\S.*", answer, re.S):
        return answer
    texts = [str(c).strip().lower() for c in (choices or ())]
    return texts.index(answer.strip().lower()) if answer.strip().lower() in texts else None


def evaluate(
    examples: list,
    greedy,
    params,
    collate,
    tokenizer,
    rows_per_batch: int,
    mesh=None,
    decode: PhaseWeights | None = None,
    scorer=None,
    attention=None,
) -> dict:
    """Greedy accuracy (`held_out_score`) and think-format rate on held-out examples, and
    with `scorer` (trainer/scoring.py: RewardScorer, the training rewards) each reward's mean
    as val/reward/<name> and each of its sub-scores' mean over the rows that have it as
    val/reward/<name>/<key>. attention(out, batch) -> per-row attention metrics (the
    rollout's `RolloutPhase.attention_metrics`, over the collated batch's pools: the
    greedy completions' MDI for the mdi reward); None: the batches carry no pools.

    collate(examples) -> a prompt batch with one row per example; batches are padded to
    `rows_per_batch` rows (one compiled shape) and the padding rows are not counted. mesh:
    where the prompts go (`sample_completions`); on a pod every process evaluates all the
    examples as its rows of the global batch (the same figures on every process). decode:
    where the decode weights are kept (the rollout phase's: the same row count)."""
    if not examples:
        return {}
    correct, fmt, n = 0.0, 0.0, 0
    sums: dict[str, float] = {}
    sub_sums: dict[str, tuple[float, int]] = {}  # a reward's sub-scores: (sum, rows with one)
    try:
        for i in range(0, len(examples), rows_per_batch):
            chunk = examples[i : i + rows_per_batch]
            k = len(chunk)
            chunk = chunk + [chunk[-1]] * (rows_per_batch - k)
            key = jax.random.key(0)
            batch = collate(chunk)
            pools = None if attention is None else batch["pools"]
            out = sample_completions(greedy, params, batch, key, pools, mesh, decode)
            texts = decode_completions(tokenizer, out.tokens, out.mask)[:k]
            correct += sum(held_out_score(texts, chunk[:k]))
            fmt += sum(rl.rewards.think_format_reward(texts))
            if scorer is not None:
                mask = out.mask[:k]
                ids = completion_ids(out.tokens[:k], mask)
                att = {} if attention is None else attention(out, batch)
                extra = reward_statistics(att, slice(k))
                values, subs = scorer.score(chunk[:k], texts, mask.sum(1), extra, ids=ids)
                for name, v in values.items():
                    sums[name] = sums.get(name, 0.0) + float(v.sum())
                for key, v in subs.items():  # NaN where a row has no such sub-score
                    have = ~np.isnan(v)
                    total, count = sub_sums.get(key, (0.0, 0))
                    sub_sums[key] = (total + float(v[have].sum()), count + int(have.sum()))
            n += k
    finally:
        if decode is not None:
            decode.end_phase()
    out = {"val/accuracy": correct / n, "val/format": fmt / n}
    out |= {f"val/reward/{name}": v / n for name, v in sums.items()}
    return out | {f"val/reward/{key}": t / c for key, (t, c) in sub_sums.items() if c}


def step_scalars(rollout: Rollout, step_metrics: dict, step_time_s: float) -> dict:
    """The scalars of one step: the rollout's, the train step's under `train/` (unless
    already grouped, e.g. rollout/logprob_abs_diff_mean) and the headline names (loss, kl,
    entropy, perception_token_fraction, ...) at the top level (docs/algorithms.md#metrics)."""
    m = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    out = dict(rollout.metrics)
    # names with a group of their own (rollout/logprob_abs_diff_mean) keep it
    out.update({(k if "/" in k else f"train/{k}"): v for k, v in m.items()})
    out.update(
        loss=m["loss"],
        kl=m.get("kl", 0.0),
        entropy=m["entropy"],
        perception_token_fraction=m.get("perception_token_fraction", 1.0),
        scaling_factor_mean=m.get("scaling_factor_mean", 1.0),
        sensitivity_score_mean=m.get("sensitivity_score_mean", 0.0),
        step_time_s=step_time_s,
    )
    return out


def trim_markdown(path: str, last_step: int) -> None:
    """Drops `## Step N` sections with N > last_step (written after the checkpoint a run
    resumes from), so no step appears twice."""
    if not os.path.exists(path):
        return
    text = open(path, encoding="utf-8").read()
    parts = re.split(r"(?m)^(?=## Step \d+\s*$)", text)
    kept = [p for p in parts if not (m := re.match(r"## Step (\d+)", p)) or int(m[1]) <= last_step]
    if len(kept) != len(parts):
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(kept))


@dataclasses.dataclass
class RunLogs:
    """metrics.jsonl, rollout_results.md, token_weights.md, attention_diagnostics.md, the
    progress line ("console" in backends) and the trackers (the other backends: every scalar
    row, the rollout samples as a table, `config` once at start). Only the primary process
    writes. resume_step: rows and sections of later steps are dropped (no step repeats); a
    run resumed from a checkpoint (start > 0) continues its tracker runs."""

    workdir: str
    total_steps: int
    start: int = 0
    primary: bool = True
    resume_step: int | None = None
    samples: int = 8  # samples per markdown section
    backends: tuple[str, ...] = ("console", "tensorboard")
    project: str = "jaxvrl"  # the trackers' project (wandb) or experiment (MLflow)
    run_name: str | None = None
    config: dict | None = None  # flat {dotted key: value}, sent to the trackers at start

    def __post_init__(self):
        w, on = self.workdir, self.primary
        self.metrics = MetricsWriter(w, on, resume_step=self.resume_step)
        self.rollouts = MarkdownLog(w, "rollout_results", "Rollout results", on)
        self.tokens = MarkdownLog(w, "token_weights", "Token weights", on)
        self.attention = MarkdownLog(w, "attention_diagnostics", "Attention diagnostics", on)
        if on and self.resume_step is not None:
            for log in (self.rollouts, self.tokens, self.attention):
                trim_markdown(log.path, self.resume_step)
        self.progress = Progress(self.total_steps, self.start, on and "console" in self.backends)
        self.figures = heatmaps.Figures()  # the attention pictures' figures, reused
        self._drawing = None  # the pictures' thread, started at the first logged pictures
        self._tracking = threading.Lock()  # the trackers, from this thread and the drawing one
        self.picture_failures = 0
        info = RunInfo(w, self.project, self.run_name, resume_step=self.resume_step)
        self.trackers = Trackers(self.backends, info, resume=self.start > 0, enabled=on)
        if self.config:
            self.trackers.log_config(self.config)

    def scalars(self, step: int, scalars: dict, progress: bool = True) -> None:
        rows = self.metrics.write(step, scalars)
        with self._tracking:
            self.trackers.log_scalars(step, rows)
        if progress:
            self.progress.update(step - 1, scalars)

    def sample_rows(self, rollout: Rollout, extras, tokenizer) -> list[dict]:
        """This process's first `samples` completions of the step, kept (in the batch) or
        filtered (`rollout.draw_samples`), as JSON-able dicts: prompt (as the model saw it:
        `shown_prompt`), completion, kept, reward parts, total, advantage (the row's, or
        its mean over the completion's tokens for per-token advantages; NaN for a filtered
        one), VGR token pieces `[(text, weight)]` and per-row
        attention metrics where the step has them. Every process computes its own;
        `markdown` writes them all (see `runtime.gather_json`)."""
        drawn = draw_samples(rollout, self.samples)
        if not drawn:
            return []
        adv = np.asarray(extras.advantages, np.float64)
        weights = extras.token_weights
        out = []
        for d in drawn:
            g, j, i = d.group, d.j, d.row
            row = {
                "prompt": _prompt(g.example, tokenizer),
                "text": g.texts[j],
                "kept": d.kept,
                "parts": {k: float(v[j]) for k, v in g.parts.items()},
                "total": float(g.totals[j]),
                "adv": float("nan")
                if not d.kept
                else (_token_mean(adv[i], g.mask[j]) if adv.ndim > 1 else float(adv[i])),
                "att": {k: float(v[j]) for k, v in g.att.items()},
            }
            if weights is not None:
                n = int(g.mask[j].sum())
                w = np.asarray(weights[i])[:n] if d.kept else np.full(n, np.nan)
                row["pieces"] = decode_pieces(tokenizer.decode, g.tokens[j][:n].tolist(), w)
            out.append(row)
        return out

    def markdown(self, step: int, per_process: list[list[dict]]) -> None:
        """The step's samples from every process's `sample_rows` (process order), taken in
        turn from each process up to `samples`: prompts, completions, rewards and advantages;
        VGR token weights `word(w)`; per-row attention metrics."""
        rows = [r for turn in itertools.zip_longest(*per_process) for r in turn if r]
        rows = rows[: self.samples]
        if not rows:
            return
        prompts = [r["prompt"] for r in rows]
        texts = [r["text"] for r in rows]
        # sub-scores of one generation batch may be missing in another's rows: NaN there
        keys = dict.fromkeys(k for r in rows for k in r["parts"])
        parts = {k: [r["parts"].get(k, float("nan")) for r in rows] for k in keys}
        totals = [r["total"] for r in rows]
        adv = np.asarray([r["adv"] for r in rows], np.float64)
        kept = [r.get("kept", True) for r in rows]
        self.rollouts.append(
            rollout_section(step, prompts, texts, parts, totals, adv, self.samples, kept=kept)
        )
        columns, table = rollout_table(prompts, texts, parts, totals, adv, self.samples, kept)
        with self._tracking:
            self.trackers.log_table(step, "rollouts", columns, table)
        if "pieces" in rows[0]:
            pieces = [[tuple(p) for p in r["pieces"]] for r in rows]
            self.tokens.append(token_weight_section(step, pieces, None, limit=self.samples))
        att = {k: [r["att"][k] for r in rows] for k in rows[0]["att"]}
        if att:
            self.attention.append(attention_section(step, att, self.samples, kept))

    def attention_maps(self, step: int, samples: list[dict], tokenizer) -> None:
        """The diagnostic pass's samples (`trainer.diagnostics.AttentionMaps`) as pictures:
        per sample the image(s) under the completion's attention per layer band (clean and
        perturbed) and its tokens coloured by each value, as PNGs
        `<workdir>/attention/step_<n>_sample_<k>[_tokens].png` linked from
        attention_diagnostics.md, TensorBoard / tracker images `attention/sample_<k>` and
        HTML in token_weights.md; per-layer MDI / AEI over steps (`attention/layers.jsonl`)
        redrawn as `attention/layers_over_steps.png`. The markdown is written at once; the
        drawing, the PNGs and the tracker images run on a thread of their own beside training
        (`wait_pictures` and `close` wait for them). Without matplotlib: one warning."""
        if not (self.primary and samples):
            return
        if not heatmaps.available():
            if not getattr(self, "_warned_plots", False):
                log.warning("matplotlib is not installed: attention heatmaps are skipped")
                self._warned_plots = True
            return
        # the markdown (links to PNGs of known names, coloured HTML) and the layers' history
        # now; the drawing, PNGs and tracker images on the drawing thread, beside training
        links, coloured, jobs = [], [], []
        for k, sample in enumerate(samples):
            tokens = [tokenizer.decode([int(t)]) for t in sample["tokens"]]
            suffixes = [""]
            if sample["values"]:
                suffixes.append("_tokens")
                coloured.append(
                    [heatmaps.token_html(tokens, v, name) for name, v in sample["values"].items()]
                )
            mark = "" if sample.get("kept", True) else " (filtered)"
            for suffix in suffixes:
                caption = f"sample {k}{suffix.replace('_', ' ')}{mark}"
                links.append((caption, self._png(step, k, suffix)))
            jobs.append((k, sample, tokens))
        self.attention.append(heatmap_section(step, links))
        if coloured:
            self.tokens.append(token_colour_section(step, coloured))
        history = self._layers_history(step, samples)
        if self._drawing is None:
            self._drawing = concurrent.futures.ThreadPoolExecutor(1, "jaxvrl-pictures")
        self._drawing.submit(self._draw, step, jobs, history)

    @staticmethod
    def _png(step: int, k: int, suffix: str) -> str:
        return f"{ATTENTION_DIR}/step_{step}_sample_{k}{suffix}.png"

    def _draw(self, step: int, jobs: list, history: list[dict]) -> None:
        """The pictures of one logged step (on the drawing thread): a failure is logged and
        counted, never raised into training."""
        try:
            for k, sample, tokens in jobs:
                title = f"step {step}, sample {k}: completion's attention (mean over heads)"
                frames, maps = sample["frames"], sample["maps"]
                image = heatmaps.attention_overlay(
                    frames["clean"], {"clean": maps["clean"]}, title, self.figures
                )
                if "perturbed" in maps:  # the perturbed pass's map over the blackened image
                    aug = {"perturbed": maps["perturbed"]}
                    over = heatmaps.attention_overlay(
                        frames["perturbed"], aug, figures=self.figures
                    )
                    image = _stack(image, over)
                pictures = {"": image}
                if sample["values"]:
                    pictures["_tokens"] = heatmaps.token_panel(
                        tokens, sample["values"], figures=self.figures
                    )
                for suffix, image in pictures.items():
                    heatmaps.save_png(image, os.path.join(self.workdir, self._png(step, k, suffix)))
                    with self._tracking:
                        self.trackers.log_image(step, f"attention/sample_{k}{suffix}", image)
            names = [k for k in history[-1] if k != "step"]
            values = {k: np.asarray([h[k] for h in history]).T for k in names}  # [L, steps]
            image = heatmaps.layers_over_steps([h["step"] for h in history], values, self.figures)
            path = os.path.join(self.workdir, ATTENTION_DIR, "layers_over_steps.png")
            heatmaps.save_png(image, path)
            with self._tracking:
                self.trackers.log_image(step, "attention/layers_over_steps", image)
        except Exception:  # noqa: BLE001 -- a picture that fails must not stop training
            self.picture_failures += 1
            log.exception("attention pictures of step %d failed (%d so far)", step,
                          self.picture_failures)  # fmt: skip

    def wait_pictures(self) -> None:
        """Until every submitted step's pictures are drawn and written."""
        if self._drawing is not None:
            self._drawing.submit(lambda: None).result()

    def _layers_history(self, step: int, samples: list[dict]) -> list[dict]:
        """Per-layer MDI / AEI of every logged step so far (`attention/layers.jsonl`, this
        step's added: the mean over its samples)."""
        path = os.path.join(self.workdir, ATTENTION_DIR, "layers.jsonl")
        row = {"step": step}
        for name in samples[0]["layers"]:
            row[name] = np.nanmean([s["layers"][name] for s in samples], axis=0).tolist()
        history = []
        if os.path.exists(path):
            history = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
        history = [h for h in history if h["step"] < step] + [row]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        return history

    def close(self) -> None:
        if self._drawing is not None:
            self._drawing.shutdown(wait=True)
        self.metrics.close()
        self.trackers.close()


def _token_mean(adv, mask) -> float:
    """A row's per-token advantages float[N] as one value: their mean over the completion's
    tokens (GAE's and REINFORCE++'s differ token by token; an outcome advantage is constant
    over them); a completion without tokens: its first column's."""
    n = int(np.asarray(mask).sum())
    return float(np.mean(adv[:n])) if n else float(adv[0])


def _prompt(example: dict, tokenizer) -> str:
    """The example's prompt as the model saw it (`shown_prompt`), else its text."""
    if tokenizer is None or example.get("prompt_ids") is None:
        return str(example.get("problem", ""))
    return shown_prompt(tokenizer, example["prompt_ids"])


def _stack(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """Two RGB images one above the other (white-padded to one width)."""
    width = max(top.shape[1], bottom.shape[1])
    pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0)), constant_values=255)  # noqa: E731
    return np.concatenate([pad(top), pad(bottom)], axis=0)
