"""The built-in visual task: deterministic images of one shape on a plain background, with
multiple-choice questions whose answer needs the image.

Question kinds: the shape's colour, the shape's kind, how many shapes (1-4, small, same colour
and kind) and which quadrant the shape is in. The question text (options in a
fixed order) is identical for every image of a kind and the answers are balanced, so text
alone is at chance (1/4). Rows use the standard row format: `problem`, `choices`, `label_idx`, `images` (PIL).
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("circle", "square", "triangle", "cross")
BACKGROUNDS = ((245, 245, 245), (200, 200, 200), (120, 120, 120))
LETTERS = "ABCD"
SPLIT_SEEDS = {"train": 0, "test": 1_000_003}
QUESTIONS = {
    "colour": "What colour is the shape in the image?",
    "shape": "What shape is in the image?",
    "count": "How many shapes are in the image?",
    "position": "In which part of the image is the shape?",
}
COUNTS = ("1", "2", "3", "4")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SYSTEM_PROMPT = (
    "You are a helpful assistant. Think briefly in <think></think>, then reply with "
    "'Answer: X' where X is the option letter."
)


def draw(shape: str, colour: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One shape of random size and position (always well inside the frame)."""
    bg = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    r = int(rng.integers(size // 5, size // 3))
    cx, cy = (int(rng.integers(r + 2, size - r - 2)) for _ in range(2))
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = max(2, r // 3)
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    return img


def _shape_mask(cell: Image.Image, colour: str) -> Image.Image:
    """Mask of the shape's pixels, so a pasted cell does not bring its own background."""
    return Image.fromarray(np.all(np.asarray(cell) == COLOURS[colour], -1).astype(np.uint8) * 255)


def draw_many(shape: str, colour: str, n: int, size: int, rng: np.random.Generator) -> Image.Image:
    """n small shapes on a 2 x 2 grid of cells (one per cell, cells chosen at random)."""
    img = Image.new("RGB", (size, size), BACKGROUNDS[rng.integers(len(BACKGROUNDS))])
    cell = size // 2
    for c in rng.permutation(4)[:n]:
        sub = draw(shape, colour, cell, rng)
        img.paste(sub, ((c % 2) * cell, (c // 2) * cell), _shape_mask(sub, colour))
    return img


def draw_at(shape: str, colour: str, quadrant: int, size: int, rng) -> Image.Image:
    """One shape inside quadrant 0..3 (top left, top right, bottom left, bottom right)."""
    img = Image.new("RGB", (size, size), BACKGROUNDS[rng.integers(len(BACKGROUNDS))])
    cell = size // 2
    sub = draw(shape, colour, cell, rng)
    img.paste(sub, ((quadrant % 2) * cell, (quadrant // 2) * cell), _shape_mask(sub, colour))
    return img


def _row_image(kind: str, label: int, size: int, rng) -> tuple[list[str], Image.Image]:
    """Choices and image for the count/position kinds (colour and shape drawn at random)."""
    colour, shape = list(COLOURS)[rng.integers(4)], SHAPES[rng.integers(4)]
    if kind == "count":
        return list(COUNTS), draw_many(shape, colour, label + 1, size, rng)
    return list(POSITIONS), draw_at(shape, colour, label, size, rng)


def format_problem(question: str, choices: list[str]) -> str:
    opts = " ".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    return f"{question} {opts}"


DEFAULT_KINDS = ("colour",)  # what the embedded checkpoint is trained on


def make_split(
    split: str = "train",
    n: int = 256,
    seed: int = 0,
    image_size: int = 56,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
) -> list[dict]:
    """n rows, deterministic in (split, seed). Labels are balanced over A-D."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    rng = np.random.default_rng(SPLIT_SEEDS[split] + seed)
    rows = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind not in QUESTIONS:
            raise ValueError(f"unknown question kind {kind!r}; known: {sorted(QUESTIONS)}")
        label = (i // len(kinds)) % 4
        if kind in ("count", "position"):
            choices, image = _row_image(kind, label, image_size, rng)
            rows.append(_row(split, seed, i, kind, choices, label, image))
            continue
        # Options are listed in a fixed order per kind, and the asked attribute cycles through
        # its 4 values, so labels are balanced and the question text never reveals the answer.
        choices = list(COLOURS) if kind == "colour" else list(SHAPES)
        label = (i // len(kinds)) % 4
        colour = choices[label] if kind == "colour" else list(COLOURS)[rng.integers(4)]
        shape = choices[label] if kind == "shape" else SHAPES[rng.integers(4)]
        rows.append(
            _row(split, seed, i, kind, choices, label, draw(shape, colour, image_size, rng))
        )
    return rows


def _row(split: str, seed: int, i: int, kind: str, choices: list, label: int, image) -> dict:
    return {
        "id": f"{split}-{seed}-{i}",
        "problem": format_problem(QUESTIONS[kind], choices),
        "choices": choices,
        "label_idx": label,
        "answer": LETTERS[label],
        "kind": kind,
        "images": [image],
    }


def target_completion(row: dict, label_idx: int | None = None) -> str:
    """The answer format the embedded checkpoint is taught: a short think, then the letter."""
    idx = row["label_idx"] if label_idx is None else label_idx
    return f"<think>{row['choices'][idx]}</think> Answer: {LETTERS[idx]}"
