"""A logged step's samples come from all its groups: those in the batch first, then those the
filters dropped, marked "(filtered)" in rollout_results.md with no advantage, and in
attention_diagnostics.md and the trackers' table (a `kept` column where any was dropped)."""

from __future__ import annotations

import types

import numpy as np

from jaxvrl.trainer.reporting import RunLogs
from jaxvrl.trainer.rollout import draw_samples


def _group(name: str, total: float, lengths=(2, 2), att=None):
    return types.SimpleNamespace(
        mask=[np.arange(3) < n for n in lengths],
        texts=[f"{name}.0", f"{name}.1"],
        parts={"accuracy": [total, total]},
        totals=[total, total],
        example={"problem": f"question {name}"},
        att={} if att is None else att,
    )


def test_samples_are_drawn_from_kept_then_filtered_groups(tmp_path):
    mdi = {"mdi": [0.25, 0.5]}
    kept, dropped = _group("kept", 0.5, att=mdi), _group("dropped", 1.0, att=mdi)
    late, padding = _group("late", 0.0, att=mdi), _group("padding", 0.0, att=mdi)
    rollout = types.SimpleNamespace(
        groups=[padding, kept], real=[False, True], sampled=[dropped, kept, late]
    )
    drawn = draw_samples(rollout, 5)
    assert [(d.group.texts[d.j], d.row, d.kept) for d in drawn] == [
        ("kept.0", 2, True),
        ("kept.1", 3, True),
        ("dropped.0", -1, False),
        ("dropped.1", -1, False),
        ("late.0", -1, False),
    ]
    logs = RunLogs(str(tmp_path), 2, samples=3, backends=())
    tables = []
    logs.trackers.log_table = lambda step, name, columns, rows: tables.append((columns, rows))
    extras = types.SimpleNamespace(advantages=np.array([0, 0, 0.7, -0.7]), token_weights=None)
    logs.markdown(1, [logs.sample_rows(rollout, extras, tokenizer=None)])
    logs.close()
    text = (tmp_path / "rollout_results.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("### Sample")]
    assert heads == ["### Sample 0", "### Sample 1", "### Sample 2 (filtered)"]
    assert "| advantage | 0.700 |" in text and "| advantage | n/a |" in text
    # the attention table and the trackers' table mark the filtered row too
    att = (tmp_path / "attention_diagnostics.md").read_text().splitlines()
    assert [line.split(" |")[0] for line in att if line.startswith("| ")][1:4] == [
        "| 0", "| 1", "| 2 (filtered)"
    ], att  # fmt: skip
    ((columns, rows),) = tables
    assert columns[-1] == "kept" and [r[-1] for r in rows] == [True, True, False]
    # without the sampled groups (an older caller): the batch's real groups, as before
    rollout = types.SimpleNamespace(groups=[padding, kept], real=[False, True])
    assert [d.row for d in draw_samples(rollout, 8)] == [2, 3]


def test_rollout_results_holds_log_samples_rows_past_eight(tmp_path):
    groups = [_group(f"g{i}", 0.1 * i) for i in range(6)]
    rollout = types.SimpleNamespace(groups=groups, real=[True] * 6, sampled=groups)
    logs = RunLogs(str(tmp_path), 2, samples=10, backends=())
    extras = types.SimpleNamespace(advantages=np.zeros(12), token_weights=None)
    logs.markdown(1, [logs.sample_rows(rollout, extras, tokenizer=None)])
    logs.close()
    text = (tmp_path / "rollout_results.md").read_text()
    assert sum(line.startswith("### Sample") for line in text.splitlines()) == 10


def test_per_token_advantages_show_their_mean_over_the_completions_tokens(tmp_path):
    """GAE's and REINFORCE++'s advantages differ token by token: a row's line shows their mean
    over its completion's tokens (padding left out), not its first token's."""
    group = _group("ppo", 0.0, lengths=(3, 1))
    rollout = types.SimpleNamespace(groups=[group], real=[True], sampled=[group])
    adv = np.array([[0.9, -0.3, -0.9], [-0.6, 5.0, 5.0]])  # row 1: one token, then padding
    logs = RunLogs(str(tmp_path), 2, samples=2, backends=())
    logs.markdown(1, [logs.sample_rows(rollout, types.SimpleNamespace(advantages=adv,
                                                                      token_weights=None),
                                       tokenizer=None)])  # fmt: skip
    logs.close()
    text = (tmp_path / "rollout_results.md").read_text()
    assert "| advantage | -0.100 |" in text and "| advantage | -0.600 |" in text
