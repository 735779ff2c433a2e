"""The report's figures, drawn with matplotlib (no pyplot, no global backend) into inline SVG."""
from __future__ import annotations

import io

import numpy as np

try:
    import matplotlib
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure
except ImportError:   # the report's optional dependency; cli.py says what to install
    matplotlib = None

MAX_CURVE_POINTS = 4000
SEVERITY_COLOURS = {"critical": "#d62728", "warning": "#ff7f0e"}
FRAC_FLOOR = 1e-6
OUTLIER_BITS = 3.0


def _svg(fig) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "stabilitywatch"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _points(curve: dict) -> tuple[np.ndarray, np.ndarray]:
    steps = np.array(sorted(curve), dtype=np.int64)
    return steps, np.array([curve[s] for s in steps], dtype=np.float64)


def _draw_curve(ax, steps, vals, colour, log: bool) -> None:
    ok = np.isfinite(vals) & ((vals > 0) if log else True)
    s, v = steps[ok], vals[ok]
    if len(s) > MAX_CURVE_POINTS:   # one point per bin: the mean, with the bin's min..max band
        edges = np.linspace(s[0], s[-1] + 1, MAX_CURVE_POINTS // 2 + 1)
        idx = np.clip(np.searchsorted(edges, s, side="right") - 1, 0, len(edges) - 2)
        count = np.bincount(idx, minlength=len(edges) - 1)
        has = count > 0
        mean = np.bincount(idx, weights=v, minlength=len(edges) - 1)[has] / count[has]
        lo = np.full(len(edges) - 1, np.inf)
        hi = np.full(len(edges) - 1, -np.inf)
        np.minimum.at(lo, idx, v)
        np.maximum.at(hi, idx, v)
        mid = ((edges[:-1] + edges[1:]) / 2)[has]
        ax.fill_between(mid, lo[has], hi[has], color=colour, alpha=0.25, linewidth=0)
        ax.plot(mid, mean, color=colour, linewidth=1)
    else:
        ax.plot(s, v, color=colour, linewidth=1.2, marker="o" if len(s) < 60 else None,
                markersize=3)
    if log:
        ax.set_yscale("log")
    bad = steps[~np.isfinite(vals)]
    zero = steps[vals == 0] if log else steps[:0]   # no place on a log axis
    said = []
    for where, y, marker, colour, what in ((bad, 0.97, "v", "#d62728", "\u25bc non-finite"),
                                           (zero, 0.03, "^", "#7f7f7f", "\u25b2 zero")):
        if len(where):
            ax.plot(where, np.full(len(where), y), transform=ax.get_xaxis_transform(),
                    linestyle="none", marker=marker, color=colour, markersize=7)
            said.append(f"{what} at {len(where)} step{'s' if len(where) > 1 else ''}")
    if said:
        ax.set_title(";  ".join(said), loc="right", fontsize=8, color="#d62728" if len(bad)
                     else "#7f7f7f")


def curves_svg(loss: dict, grad_norm: dict, alerts: list) -> str:
    """Loss and global gradient norm against the step; alert steps as vertical lines."""
    panels = [(n, c, col) for n, c, col in (("loss", loss, "#1f77b4"),
                                             ("gradient norm (global L2)", grad_norm, "#2ca02c"))
              if c]
    fig = Figure(figsize=(13.5, 2.4 * len(panels) + 0.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    marks = {}
    for a in alerts:
        sev, step = a.get("severity"), a.get("step")
        if sev in SEVERITY_COLOURS and isinstance(step, int):
            if marks.get(step) != "critical":
                marks[step] = sev
    for ax, (name, curve, colour) in zip(axes, panels):
        steps, vals = _points(curve)
        for step, sev in marks.items():
            ax.axvline(step, color=SEVERITY_COLOURS[sev], linewidth=0.8, alpha=0.6, zorder=0)
        _draw_curve(ax, steps, vals, colour, log=name != "loss")
        ax.set_ylabel(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[-1].set_xlabel("step (vertical lines: steps with warning / critical alerts)", fontsize=9)
    return _svg(fig)


def _robust_range(lg: np.ndarray) -> tuple[float, float]:
    """The colour range of log2 absmax: the finite cells' range, except that an end more than
    OUTLIER_BITS beyond the 0.5th/99.5th percentile stops one bit past it, so that one fault of
    2^100 leaves the healthy cells' variation visible (above the range it shows orange)."""
    fin = lg[np.isfinite(lg)]
    if not fin.size:
        return -1.0, 1.0
    lo, hi = (float(x) for x in np.percentile(fin, [0.5, 99.5]))
    vmin, vmax = float(fin.min()), float(fin.max())
    vmin = vmin if lo - vmin <= OUTLIER_BITS else lo - 1
    vmax = vmax if vmax - hi <= OUTLIER_BITS else hi + 1
    if vmax - vmin < 1:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    return vmin, vmax


def _xticks(ax, columns: list, step_bin: int) -> None:
    n = len(columns)
    ticks = sorted(set(np.linspace(0, n - 1, min(n, 7)).round().astype(int).tolist()))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(columns[t]) for t in ticks], fontsize=7)
    ax.set_xlabel("step" if step_bin == 1 else
                  f"step ({step_bin} recorded steps per column, the largest value shown)",
                  fontsize=8)


def _mark_alerts(ax, marks) -> None:
    if marks:
        xs, ys = zip(*marks)
        ax.scatter(xs, ys, s=60, facecolors="none", edgecolors="#d62728", linewidths=1.2)


def heatmap_svg(grid, columns: list, step_bin: int, formats: list, marks: list) -> str:
    """One role: log2 |x|max and, per format, the underflow and overflow fractions, module x step.
    `marks` are (column, row) cells named by a warning or critical alert (circled)."""
    n_mod, n_col = len(grid.modules), max(len(columns), 1)
    panels = 1 + 2 * len(formats)
    fs = 7 if n_mod > 24 else 8
    # a fixed layout in inches: constrained layout measures every tick label many times over
    width, row_h, top, bottom = 13.5, 0.135, 0.3, 1.05
    left = 0.3 + 0.6 * fs / 72 * max((len(m) for m in grid.modules), default=4)
    gap, right = 0.3, 0.15
    height = top + bottom + max(row_h * n_mod, 0.5)
    fig = Figure(figsize=(width, height))
    pw = (width - left - right - gap * (panels - 1)) / panels
    axes, cbars = [], []
    for k in range(panels):
        x0 = left + k * (pw + gap)
        axes.append(fig.add_axes((x0 / width, bottom / height, pw / width,
                                  (height - top - bottom) / height),
                                 sharey=axes[0] if axes else None))
        cbars.append(fig.add_axes(((x0 + 0.1 * pw) / width, 0.42 / height, 0.8 * pw / width,
                                   0.1 / height)))
    extent = (-0.5, n_col - 0.5, n_mod - 0.5, -0.5)

    absmax = grid.stats["absmax"]
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log2(absmax)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6", over="#ff7f0e")
    vmin, vmax = _robust_range(lg)
    im = axes[0].imshow(np.where(np.isfinite(lg), np.maximum(lg, vmin), lg), aspect="auto",
                        interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax, extent=extent)
    for mask, colour in ((np.isneginf(lg), "#000000"),              # absmax 0: every value zero
                         (grid.stats["nonfinite"] > 0, "#ff00ff")):
        axes[0].imshow(np.ma.masked_where(~mask, np.ones_like(absmax)), aspect="auto",
                       interpolation="nearest", cmap=ListedColormap([colour]), vmin=0, vmax=1,
                       extent=extent)
    fig.colorbar(im, cax=cbars[0], orientation="horizontal",
                 extend="max" if np.nanmax(lg, initial=-np.inf) > vmax else "neither")
    axes[0].set_title("log2 absmax", fontsize=9)

    fcmap = matplotlib.colormaps["YlOrRd"].with_extremes(bad="#e6e6e6", under="#ffffff")
    norm = LogNorm(vmin=FRAC_FLOOR, vmax=1.0)
    k = 1
    for fmt in formats:
        for kind in ("underflow", "overflow"):
            arr = grid.stats[f"{fmt}_{kind}_frac"]
            shown = np.where(arr > 0, np.maximum(arr, FRAC_FLOOR), FRAC_FLOOR / 10)
            shown = np.where(np.isnan(arr), np.nan, shown)
            im = axes[k].imshow(shown, aspect="auto", interpolation="nearest", cmap=fcmap,
                                norm=norm, extent=extent)
            fig.colorbar(im, cax=cbars[k], orientation="horizontal")
            axes[k].set_title(f"{fmt} {kind} fraction", fontsize=9)
            k += 1
    for ax in axes[1:]:
        ax.tick_params(axis="y", labelleft=False, length=0)
    for cb in cbars:
        cb.tick_params(labelsize=7)
    for ax in axes:
        _xticks(ax, columns, step_bin)
        _mark_alerts(ax, marks)
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
    axes[0].set_yticks(range(n_mod))
    axes[0].set_yticklabels(grid.modules, fontsize=fs)
    axes[0].tick_params(axis="y", length=0)
    return _svg(fig)


def available() -> bool:
    return matplotlib is not None
