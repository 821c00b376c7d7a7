"""Pictures of where a model's attention goes (README "What a run writes"): the input image
with the completion's attention over each merged patch as a heatmap, completions with each
token coloured by a per-token value, and per-layer MDI / AEI over steps.

Pure functions from numpy arrays to RGB images uint8[H, W, 3] (and HTML text), drawn with
matplotlib, an optional extra (`pip install jaxvrl[plots]`): `available()` says whether it
is installed; callers skip the pictures without it.
"""

from __future__ import annotations

import html
import os

import numpy as np

CMAP = "inferno"  # attention heatmaps and per-layer curves
TOKEN_CMAP = "viridis"  # token values


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(rows: int, cols: int, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * cols, size[1] * rows), dpi=80)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _rgb(fig) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def strip(frames: list[np.ndarray]) -> np.ndarray:
    """Frames float[h, w, 3] in [0, 1] side by side (a video's strip), padded to one height."""
    height = max(f.shape[0] for f in frames)
    padded = [np.pad(f, ((0, height - f.shape[0]), (0, 2), (0, 0))) for f in frames]
    return np.concatenate(padded, axis=1)[:, :-2]


def upsample(grids: list[np.ndarray], frames: list[np.ndarray]) -> np.ndarray:
    """Per-frame grids float[gh, gw] blown up to their frames' pixels (nearest), as a strip
    whose values share one scale: float[H, W] in [0, 1]."""
    top = max(float(np.max(g)) for g in grids) or 1.0
    ups = []
    for g, f in zip(grids, frames):
        reps = (f.shape[0] // g.shape[0], f.shape[1] // g.shape[1])
        ups.append(np.kron(g / top, np.ones(reps))[..., None].repeat(3, -1))
    return strip(ups)[..., 0]


def attention_overlay(frames, maps: dict, title: str = "") -> np.ndarray:
    """frames: list of float[h, w, 3] in [0, 1] (one image, or a video's frames); maps:
    {row label: {column label: list of float[gh, gw] per frame}} (e.g. clean / perturbed x
    the layer bands). One panel per map: the frame strip under the heatmap (CMAP, alpha 0.55,
    scaled to the map's maximum) -> uint8[H, W, 3]."""
    rows, cols = list(maps), list(next(iter(maps.values())))
    base = strip(frames)
    aspect = base.shape[1] / max(base.shape[0], 1)
    fig, axes = _figure(len(rows), len(cols), (2.4 * min(aspect, 4.0), 2.6))
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            ax.imshow(base)
            ax.imshow(upsample(maps[r][c], frames), cmap=CMAP, alpha=0.55, vmin=0.0, vmax=1.0)
            ax.set_title(f"{r}: {c}", fontsize=8)
            ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    # fixed margins: tight_layout measured as much as the drawing itself
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.82, wspace=0.05, hspace=0.3)
    return _rgb(fig)


def _normalise(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, np.float64)
    finite = v[np.isfinite(v)]
    if not finite.size:
        return np.zeros_like(v)
    lo, hi = float(finite.min()), float(finite.max())
    return np.clip((np.nan_to_num(v, nan=lo) - lo) / (hi - lo if hi > lo else 1.0), 0.0, 1.0)


def token_panel(tokens: list[str], values: dict, width: int = 90) -> np.ndarray:
    """tokens: the completion's token texts; values: {name: float[n]} (VGR weight, perception
    score, entropy, ...). One block per name: the tokens laid out in lines of about `width`
    characters, each on a box coloured by its value (TOKEN_CMAP, min..max of the row) ->
    uint8[H, W, 3]."""
    import matplotlib

    cmap = matplotlib.colormaps[TOKEN_CMAP]
    lines, line, used = [], [], 0
    for i, t in enumerate(tokens):
        shown = t.replace("\n", "⏎") or "␣"
        if used + len(shown) > width and line:
            lines.append(line)
            line, used = [], 0
        line.append((i, shown))
        used += len(shown) + 1
    lines.append(line)
    names = list(values) or ["token"]
    height = 0.35 + 0.22 * len(lines)
    fig, axes = _figure(len(names), 1, (width * 0.085, height))
    for ax, name in zip(axes[:, 0], names):
        v = np.asarray(values.get(name, np.zeros(len(tokens))), np.float64)
        colour = _normalise(v)
        ax.set_xlim(0, width)
        ax.set_ylim(len(lines), -0.6)
        ax.axis("off")
        lo, hi = np.nanmin(v) if v.size else 0.0, np.nanmax(v) if v.size else 0.0
        ax.set_title(f"{name} (min {lo:.3g}, max {hi:.3g})", fontsize=8, loc="left")
        for y, row in enumerate(lines):
            x = 0.0
            for i, shown in row:
                rgba = cmap(colour[i]) if i < len(colour) else (1, 1, 1, 1)
                ink = "black" if sum(rgba[:3]) > 1.5 else "white"
                box = dict(boxstyle="square,pad=0.1", facecolor=rgba, edgecolor="none")
                ax.text(x, y, shown, fontsize=7, family="monospace", color=ink, bbox=box)
                x += len(shown) + 1
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.9, hspace=0.5)
    return _rgb(fig)


def token_html(tokens: list[str], values, name: str) -> str:
    """The tokens as HTML spans whose background colours their values (TOKEN_CMAP, min..max),
    each value in its title; for the markdown logs."""
    import matplotlib
    from matplotlib.colors import to_hex

    cmap = matplotlib.colormaps[TOKEN_CMAP]
    v = np.asarray(values, np.float64)
    colour = _normalise(v)
    spans = []
    for t, x, c in zip(tokens, v, colour):
        rgba = cmap(c)
        ink = "black" if sum(rgba[:3]) > 1.5 else "white"
        text = html.escape(t).replace("\n", "⏎")
        spans.append(
            f'<span title="{name} {x:.3g}" style="background:{to_hex(rgba)};color:{ink}">'
            f"{text}</span>"
        )
    return f"<p><b>{html.escape(name)}</b><br><code>{''.join(spans)}</code></p>"


def layers_over_steps(steps, values: dict) -> np.ndarray:
    """steps: int[S]; values: {name: float[L, S]} (per-layer MDI, AEI, ...). One heatmap per
    name, layers (rows, 0 at the top) x steps (columns) -> uint8[H, W, 3]."""
    names = list(values)
    fig, axes = _figure(len(names), 1, (max(4.0, 0.25 * len(steps) + 2.5), 2.2))
    for ax, name in zip(axes[:, 0], names):
        m = np.asarray(values[name], np.float64)
        im = ax.imshow(m, aspect="auto", cmap=CMAP, interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("layer", fontsize=7)
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=6)
        ax.tick_params(axis="y", labelsize=6)
        fig.colorbar(im, ax=ax)
    axes[-1][0].set_xlabel("step", fontsize=7)
    fig.tight_layout()
    return _rgb(fig)


def save_png(image: np.ndarray, path: str) -> None:
    """uint8[H, W, 3] -> a PNG file (its directory made)."""
    from PIL import Image

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    Image.fromarray(np.asarray(image, np.uint8)).save(path)
