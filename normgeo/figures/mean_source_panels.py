"""Where the mean lives, as a figure (records: :mod:`normgeo.measure.mean_sources`).

:func:`plot_mean_sources_layers`: one model at one step, every norm input in forward order: left, the share of
E[mu^2] carried by position 0 and by the other positions; right, the signed share of the top dimension, of the
top 8 and of the massive dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from normgeo.figures.style import finish_axes, norm_label, save_figure, step_tag, step_title
from normgeo.paths import slug


def share(value: float | None) -> float:
    return np.nan if value is None else value


def plot_mean_sources_layers(rows: Sequence[dict], out_dir: Path, step: int | None = None,
                             formats: Sequence[str] = ("png",)) -> Path | None:
    """The figure of ``rows`` (``mean_sources.jsonl``) at ``step``; None when it holds no row there."""
    rows = [r for r in rows if r["step"] == step]
    dims = [r for r in rows if r["kind"] == "dimensions"]
    if not dims:
        return None
    first = {(r["layer"], r["site"]): r for r in rows if r["kind"] == "position" and r["first_position"] == 0}
    labels = [f"{r['layer']}·{r['site'].removesuffix('.in')}" for r in dims]
    x = np.arange(len(dims))
    at_first = np.array([share(first[(r["layer"], r["site"])]["mean_sq_share"]) for r in dims])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.bar(x, at_first, color="tab:red", label="position 0")
    left.bar(x, 1 - at_first, bottom=at_first, color="tab:gray", alpha=0.5, label="positions 1+")
    left.set_ylabel("share of E[μ²] (μ: the token's mean)")
    left.set_ylim(0, 1)
    left.set_title("which positions carry the mean", fontsize=10)
    for name, color, marker in (("top1_share", "tab:blue", "o"), ("top8_share", "tab:green", "s"),
                                ("massive_share", "tab:red", "^")):
        text = {"top1_share": "top dimension", "top8_share": "top 8 dimensions",
                "massive_share": "massive dimensions (max |x| > 100× median |x|)"}[name]
        right.plot(x, [share(r[name]) for r in dims], marker=marker, color=color, lw=1, label=text)
    right.axhline(0, color="black", lw=0.8, ls="--")
    right.set_ylabel("signed share of E[μ²] (Σᵢ φᵢ / E[μ²])")
    right.set_title("which dimensions carry the mean", fontsize=10)
    for axis in (left, right):
        axis.set_xticks(x, labels, rotation=90, fontsize=7 if len(x) > 20 else 8)
        finish_axes(axis, "norm input (block · norm)", legend=8)
    model, norm = dims[0]["model"], dims[0]["norm"]
    fig.suptitle(f"{model} · {norm_label(norm)} · where the mean lives · {step_title(step)}")
    fig.tight_layout()
    return save_figure(fig, out_dir, f"mean_sources_{slug(model)}_{norm}_{step_tag(step)}", formats)[0]
