"""The built-in task: deterministic, balanced, and the answer is in the image, not the text."""

from __future__ import annotations

import numpy as np
import pytest

from jaxvrl.data import synthetic

KINDS = ("colour", "shape", "count", "position")


def _shape_pixels(row) -> np.ndarray:
    """bool[H, W]: pixels of any shape colour (backgrounds are greys)."""
    img = np.asarray(row["images"][0]).astype(int)
    return np.any([np.all(img == c, -1) for c in synthetic.COLOURS.values()], axis=0)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_deterministic_balanced_and_text_blind(kind):
    a = synthetic.make_split("train", 40, seed=1, kinds=(kind,))
    b = synthetic.make_split("train", 40, seed=1, kinds=(kind,))
    assert [r["problem"] for r in a] == [r["problem"] for r in b]
    assert all(
        np.array_equal(np.asarray(x["images"][0]), np.asarray(y["images"][0])) for x, y in zip(a, b)
    )
    assert np.bincount([r["label_idx"] for r in a]).tolist() == [10, 10, 10, 10]
    assert len({r["problem"] for r in a}) == 1  # one question text for every label
    test = synthetic.make_split("test", 40, seed=1, kinds=(kind,))
    assert not np.array_equal(np.asarray(test[0]["images"][0]), np.asarray(a[0]["images"][0]))


def test_images_carry_the_answer():
    for r in synthetic.make_split("train", 24, kinds=KINDS):
        img, px = np.asarray(r["images"][0]).astype(int), _shape_pixels(r)
        h, w = px.shape
        quads = [
            px[: h // 2, : w // 2],
            px[: h // 2, w // 2 :],
            px[h // 2 :, : w // 2],
            px[h // 2 :, w // 2 :],
        ]
        answer = r["choices"][r["label_idx"]]
        if r["kind"] == "colour":
            assert np.all(img[px][0] == synthetic.COLOURS[answer])
        if r["kind"] == "count":
            assert sum(q.any() for q in quads) == int(answer)
        if r["kind"] == "position":
            assert [q.any() for q in quads] == [i == r["label_idx"] for i in range(4)]


def test_mixed_kinds_and_errors():
    rows = synthetic.make_split("train", 80, kinds=KINDS)
    for kind in KINDS:
        labels = [r["label_idx"] for r in rows if r["kind"] == kind]
        assert np.bincount(labels).tolist() == [5, 5, 5, 5]
    assert synthetic.target_completion(rows[0]).endswith(f"Answer: {rows[0]['answer']}")
    with pytest.raises(ValueError, match="unknown question kind"):
        synthetic.make_split("train", 2, kinds=("size",))
    with pytest.raises(ValueError, match="split must be one of"):
        synthetic.make_split("val", 2)


def test_the_arithmetic_task_is_deterministic_and_its_answers_are_the_sums():
    from jaxvrl.data import arithmetic
    from jaxvrl.rl.rewards import accuracy_reward

    a = arithmetic.make_split("train", 50, seed=2)
    assert a == arithmetic.make_split("train", 50, seed=2)
    assert a != arithmetic.make_split("test", 50, seed=2)
    for r in a:
        x, y = r["operands"]
        assert r["problem"] == f"What is {x} + {y}?" and r["answer"] == str(x + y)
        assert "images" not in r and 0 <= x <= 9 and 0 <= y <= 9
    assert len({tuple(r["operands"]) for r in a}) > 20  # not one sum repeated
    right = [arithmetic.target_completion(r) for r in a]
    wrong = [arithmetic.target_completion(r, int(r["answer"]) + 1) for r in a]
    answers = [r["answer"] for r in a]
    assert accuracy_reward(right, answer=answers) == [1.0] * 50
    assert accuracy_reward(wrong, answer=answers) == [0.0] * 50
