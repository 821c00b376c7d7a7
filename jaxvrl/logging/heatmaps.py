"""Pictures of where a model's attention goes (README "What a run writes"): the input image
with the completion's attention over each merged patch as a heatmap, completions with each
token coloured by a per-token value, and per-layer MDI / AEI over steps.

Pure functions from numpy arrays to RGB images uint8[H, W, 3] (and HTML text), drawn with
matplotlib, an optional extra (`pip install jaxvrl[plots]`): `available()` says whether it
is installed; callers skip the pictures without it. A run draws the same kinds of figure at
every logged step, so with a `Figures` of the run's each figure is built once (figure, axes,
colorbars) and later calls only change its images and texts and draw it again on its Agg
canvas (no pyplot).
"""

from __future__ import annotations

import collections
import html
import os

import numpy as np

CMAP = "inferno"  # attention heatmaps and per-layer MDI / AEI
TOKEN_CMAP = "viridis"  # token values
ALPHA = 0.55  # the heatmap's opacity over the frames
DPI = 80
TOKEN_FONT = 10  # the tokens' text, pixels high
FIGURES = 16  # figures kept for reuse, the least recently used dropped first


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class _Reused:
    """A figure of rows x cols axes on its own Agg canvas, and the artists (`parts`) whose data
    and texts change from one drawing to the next."""

    def __init__(self, rows: int, cols: int, size: tuple[float, float]):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=size, dpi=DPI)
        self.canvas = FigureCanvasAgg(self.fig)
        self.axes = self.fig.subplots(rows, cols, squeeze=False)
        self.parts: dict = {}

    def resize(self, size: tuple[float, float]) -> None:
        if tuple(self.fig.get_size_inches()) != tuple(size):
            self.fig.set_size_inches(size)

    def rgb(self) -> np.ndarray:
        """The figure drawn: uint8[H, W, 3] (a copy: the canvas is drawn over next time)."""
        self.canvas.draw()
        return np.asarray(self.canvas.buffer_rgba())[..., :3].copy()


class Figures:
    """The figures a run reuses, by kind and shape (the least recently used dropped beyond
    FIGURES), and the fonts: one per run (`RunLogs`); drawing without one builds afresh."""

    def __init__(self):
        self._made: collections.OrderedDict = collections.OrderedDict()
        self._fonts: dict = {}

    def get(self, key: tuple, build) -> _Reused:
        """The figure for `key`, from `build()` the first time: making axes and laying them
        out costs more than drawing them."""
        if key in self._made:
            self._made.move_to_end(key)
            return self._made[key]
        made = self._made[key] = build()
        while len(self._made) > FIGURES:
            self._made.popitem(last=False)
        return made

    def font(self, pixels: int):
        if pixels not in self._fonts:
            self._fonts[pixels] = _mono_font(pixels)
        return self._fonts[pixels]


def _reused(figures: Figures | None, key: tuple, build) -> _Reused:
    return build() if figures is None else figures.get(key, build)


def _show(image, array: np.ndarray) -> None:
    """An imshow artist shows `array` (any size) over its whole axes."""
    image.set_data(array)
    h, w = array.shape[:2]
    image.set_extent((-0.5, w - 0.5, h - 0.5, -0.5))
    image.axes.set_xlim(-0.5, w - 0.5)
    image.axes.set_ylim(h - 0.5, -0.5)


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


def blend(base: np.ndarray, heat: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """A strip float[H, W, 3] in [0, 1] under heat float[H, W] in [0, 1] coloured by CMAP at
    opacity `alpha` (what an alpha image over the strip shows) -> float[H, W, 3]."""
    import matplotlib

    colour = matplotlib.colormaps[CMAP](heat)[..., :3]
    return np.clip((1.0 - alpha) * np.asarray(base, np.float64) + alpha * colour, 0.0, 1.0)


def attention_overlay(
    frames, maps: dict, title: str = "", figures: Figures | None = None
) -> np.ndarray:
    """frames: list of float[h, w, 3] in [0, 1] (one image, or a video's frames); maps:
    {row label: {column label: list of float[gh, gw] per frame}} (e.g. clean / perturbed x
    the layer bands). One panel per map: the frame strip under the heatmap (`blend`: CMAP at
    ALPHA, scaled to the map's maximum) -> uint8[H, W, 3]."""
    rows, cols = list(maps), list(next(iter(maps.values())))
    base = strip(frames)
    aspect = base.shape[1] / max(base.shape[0], 1)
    size = (2.4 * min(aspect, 4.0) * len(cols), 2.6 * len(rows))

    def build():
        made = _Reused(len(rows), len(cols), size)
        made.parts["images"] = []
        for ax in made.axes.flat:
            # a fixed place (y): placing a title above the ticks measures the whole axes
            ax.set_title(" ", fontsize=8, y=1.0)
            made.parts["images"].append(ax.imshow(base))
            ax.axis("off")
        made.parts["title"] = made.fig.suptitle(" ", fontsize=9)
        # fixed margins: tight_layout measured as much as the drawing itself
        made.fig.subplots_adjust(
            left=0.01, right=0.99, bottom=0.02, top=0.82, wspace=0.05, hspace=0.3
        )
        return made

    made = _reused(figures, ("overlay", len(rows), len(cols)), build)
    made.resize(size)
    images = iter(made.parts["images"])
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            _show(next(images), blend(base, upsample(maps[r][c], frames)))
            made.axes[i][j].title.set_text(f"{r}: {c}")
    made.parts["title"].set_text(title)
    return made.rgb()


def _normalise(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, np.float64)
    finite = v[np.isfinite(v)]
    if not finite.size:
        return np.zeros_like(v)
    lo, hi = float(finite.min()), float(finite.max())
    return np.clip((np.nan_to_num(v, nan=lo) - lo) / (hi - lo if hi > lo else 1.0), 0.0, 1.0)


def _lines(tokens: list[str], width: int) -> list[list[tuple[int, str]]]:
    """The tokens laid out in lines of about `width` characters, one character apart:
    [(token index, shown text)] per line."""
    lines, line, used = [], [], 0
    for i, t in enumerate(tokens):
        shown = t.replace("\n", "⏎") or "␣"
        if used + len(shown) > width and line:
            lines.append(line)
            line, used = [], 0
        line.append((i, shown))
        used += len(shown) + 1
    lines.append(line)
    return lines


def _mono_font(pixels: int):
    """matplotlib's monospace font (its font manager's pick) for Pillow, `pixels` high."""
    from matplotlib import font_manager
    from PIL import ImageFont

    path = font_manager.findfont(font_manager.FontProperties(family="monospace"))
    try:
        return ImageFont.truetype(path, pixels)
    except OSError:  # a Pillow built without FreeType
        return ImageFont.load_default()


def token_tiles(lines, colours, width: int = 90, figures: Figures | None = None) -> np.ndarray:
    """lines: `_lines`' layout; colours: float[n, 4] RGBA per token (a colormap's). Each token
    in its character cells on a box of its colour, in black or white ink (whichever reads on
    it), lines `width` + 1 characters wide (more for a longer token) -> uint8[h, w, 3].
    Drawn with Pillow: a matplotlib text artist per token cost more than the rest of the
    figure."""
    from PIL import Image, ImageDraw

    font = figures.font(TOKEN_FONT) if figures is not None else _mono_font(TOKEN_FONT)
    cell = max(1, int(np.ceil(font.getlength("M"))))
    high = TOKEN_FONT + 5
    chars = max([width + 1] + [sum(len(s) + 1 for _, s in line) for line in lines])
    tile = Image.new("RGB", (chars * cell + 2, len(lines) * high + 1), "white")
    draw = ImageDraw.Draw(tile)
    rgb = np.round(np.asarray(colours, np.float64).reshape(-1, 4)[:, :3] * 255).astype(int)
    for y, line in enumerate(lines):
        x = 1
        for i, shown in line:
            fill = tuple(int(c) for c in rgb[i]) if i < len(rgb) else (255, 255, 255)
            ink = "black" if sum(fill) > 1.5 * 255 else "white"
            right = x + len(shown) * cell
            draw.rectangle([x - 1, y * high, right, (y + 1) * high - 2], fill=fill)
            draw.text((x, y * high + 1), shown, font=font, fill=ink)
            x = right + cell
    return np.asarray(tile)


def token_panel(
    tokens: list[str], values: dict, width: int = 90, figures: Figures | None = None
) -> np.ndarray:
    """tokens: the completion's token texts; values: {name: float[n]} (VGR weight, perception
    score, entropy, ...). One block per name: the tokens laid out in lines of about `width`
    characters, each on a box coloured by its value (TOKEN_CMAP, min..max of the row) ->
    uint8[H, W, 3]."""
    import matplotlib

    cmap = matplotlib.colormaps[TOKEN_CMAP]
    lines = _lines(tokens, width)
    names = list(values) or ["token"]
    rows = [np.asarray(values.get(name, np.zeros(len(tokens))), np.float64) for name in names]
    tiles = [token_tiles(lines, cmap(_normalise(v)), width, figures) for v in rows]
    h, w = tiles[0].shape[:2]
    title, margin = 16, 6  # pixels: above each block, around the figure
    tall, wide = len(names) * (h + title) + margin, w + 2 * margin

    def build():
        made = _Reused(len(names), 1, (wide / DPI, tall / DPI))
        made.parts["images"], made.parts["titles"] = [], []
        for ax in made.axes[:, 0]:
            made.parts["titles"].append(ax.set_title(" ", fontsize=8, loc="left", y=1.0, pad=3))
            made.parts["images"].append(ax.imshow(tiles[0], aspect="auto", interpolation="nearest"))
            ax.axis("off")
        return made

    made = _reused(figures, ("tokens", len(names)), build)
    made.resize((wide / DPI, tall / DPI))
    # each block's axes as large as its tile (shown pixel for pixel), its title in the gap
    made.fig.subplots_adjust(
        left=margin / wide, right=1 - margin / wide, top=1 - title / tall,
        bottom=margin / tall, hspace=title / h,
    )  # fmt: skip
    for text, image, name, v, tile in zip(
        made.parts["titles"], made.parts["images"], names, rows, tiles
    ):
        lo, hi = (np.nanmin(v), np.nanmax(v)) if v.size else (0.0, 0.0)
        text.set_text(f"{name} (min {lo:.3g}, max {hi:.3g})")
        _show(image, tile)
    return made.rgb()


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


def layers_over_steps(steps, values: dict, figures: Figures | None = None) -> np.ndarray:
    """steps: int[S]; values: {name: float[L, S]} (per-layer MDI, AEI, ...). One heatmap per
    name, layers (rows, 0 at the top) x steps (columns), with its colorbar -> uint8[H, W, 3];
    5 inches wide up to 10 steps, 8 up to 30, 12 beyond (a figure each, laid out once)."""
    names = list(values)
    mats = [np.asarray(values[n], np.float64).reshape(-1, len(steps)) for n in names]
    wide = 5.0 if len(steps) <= 10 else 8.0 if len(steps) <= 30 else 12.0

    def build():
        from matplotlib.ticker import MaxNLocator

        made = _Reused(len(names), 1, (wide, 2.2 * len(names)))
        made.parts["images"] = []
        for ax, name, m in zip(made.axes[:, 0], names, mats):
            im = ax.imshow(m, aspect="auto", cmap=CMAP, interpolation="nearest")
            made.parts["images"].append(im)
            # fixed places (title y, label coordinates): placing them measures the ticks
            ax.set_title(name, fontsize=8, y=1.0)
            ax.set_ylabel("layer", fontsize=7)
            ax.yaxis.set_label_coords(-0.45 / wide, 0.5)
            ax.tick_params(labelsize=6)
            ax.yaxis.set_major_locator(MaxNLocator(8, integer=True))  # layers are whole
            bar = made.fig.colorbar(im, ax=ax)
            bar.ax.tick_params(labelsize=6)
            bar.locator = MaxNLocator(5)  # fewer labels: drawing text is most of this figure
        last = made.axes[-1][0]
        last.set_xlabel("step", fontsize=7)
        last.xaxis.set_label_coords(0.5, -0.2)
        # laid out once: room on the right for the colorbars' labels as their range changes
        made.fig.tight_layout(rect=(0.0, 0.0, 1.0 - 0.3 / wide, 1.0))
        return made

    key = ("layers", tuple(names), tuple(m.shape[0] for m in mats), wide)
    made = _reused(figures, key, build)
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
    for ax, im, m in zip(made.axes[:, 0], made.parts["images"], mats):
        finite = m[np.isfinite(m)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        _show(im, m)
        im.set_clim(lo, hi)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    return made.rgb()


def save_png(image: np.ndarray, path: str) -> None:
    """uint8[H, W, 3] -> a PNG file (its directory made)."""
    from PIL import Image

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # the fastest zlib level: written at every logged step, where time counts more than size
    Image.fromarray(np.asarray(image, np.uint8)).save(path, compress_level=1)
