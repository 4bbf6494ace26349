"""One figure style: how arms, references and sites are named and coloured, and how a figure is saved.

Arm names and colours come from the norm registry (:mod:`models.norms`), so a new arm is drawn the same
way in every figure without touching this package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.backend_bases import FigureCanvasBase

from corpus.atomic import atomic_open
from models.norms import arm_color as registered_color
from models.norms import arm_label as registered_label

# rand_b's norm (3 sqrt d) cannot change an angle; it is the paper's b, i.e. a second random direction.
REF_LABELS = {
    "ones": "uniform vector 1",
    "rand_a": "random direction a",
    "rand_b": "second random direction b",
}
SITE_STYLE = {"in": ("o", "before norm"), "out": ("s", "after norm"), "std": ("^", "after standardization")}
POST_SUFFIX = "+post"  # appended to the arm of a placement=post run: "layer+post"
DPI = 120


def norm_label(norm: str) -> str:
    """A norm arm's name in figures ("LayerNorm"); an unknown name (a pretrained model's kind) as it is."""
    return registered_label(norm)


def split_arm(arm: str) -> tuple[str, str, bool]:
    """(size, norm, post) of a comparison arm such as ``70m-layer+post``; size "" when runs share one."""
    size, _, norm = arm.removesuffix(POST_SUFFIX).rpartition("-")
    return size, norm, arm.endswith(POST_SUFFIX)


def arm_label(arm: str) -> str:
    size, norm, post = split_arm(arm)
    return f"{size} {norm_label(norm)}{' (Post-LN)' if post else ''}".strip()


def arm_color(arm: str, index: int) -> str:
    """The registry's colour of the arm's norm; an arm outside the registry gets a colour by position."""
    return registered_color(split_arm(arm)[1]) or f"C{index + 2}"


def layer_key(layer: str) -> float:
    """Sort key of a layer label: block indices in order, then "final" and other named layers."""
    return float(layer) if layer.lstrip("-").isdigit() else float("inf")


def step_title(step: int | None) -> str:
    """A step in a figure's title: "step 1,000", or "pretrained" (a released model, no step)."""
    return "pretrained" if step is None else f"step {step:,}"


def step_tag(step: int | None) -> str:
    """A step in a figure's file name: "step0001000", or "pretrained"."""
    return "pretrained" if step is None else f"step{step:07d}"


def sorted_steps(rows: Iterable[dict]) -> list[int | None]:
    """The steps of ``rows``, the pretrained one (None) first."""
    return sorted({r["step"] for r in rows}, key=lambda s: -1 if s is None else s)


def finish_axes(ax, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None, *,
                line: float | None = None, legend: int | None = None) -> None:
    """An axes finished the one way: a dashed reference line at ``line`` (grey at 90 degrees, else black),
    its labels and title, a light grid, and a legend of font size ``legend`` (None: no legend)."""
    if line is not None:
        ax.axhline(line, color="gray" if line == 90 else "black", lw=0.8, ls="--")
    for setter, text in ((ax.set_xlabel, xlabel), (ax.set_ylabel, ylabel), (ax.set_title, title)):
        if text is not None:
            setter(text)
    ax.grid(alpha=0.3)
    if legend is not None:
        ax.legend(fontsize=legend)


def check_formats(formats: Sequence[str]) -> list[str]:
    """The figure formats asked for (``--formats``), or ValueError naming those matplotlib cannot write:
    checked before anything is written."""
    supported = FigureCanvasBase.get_supported_filetypes()
    asked = [f.strip().lower().lstrip(".") for f in formats if f.strip()]
    unknown = [f for f in asked if f not in supported]
    if unknown or not asked:
        raise ValueError(
            f"--formats={','.join(formats)}: {', '.join(unknown) or 'no format'} is not a figure "
            f"format; choose from {', '.join(sorted(supported))} (e.g. --formats=png,pdf)"
        )
    return asked


def save_figure(fig, out_dir: Path, stem: str, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Write ``fig`` as ``out_dir/stem.<fmt>`` for each format, each file atomically, and close it."""
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        with atomic_open(path, "wb") as handle:
            fig.savefig(handle, format=fmt, dpi=DPI, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths
