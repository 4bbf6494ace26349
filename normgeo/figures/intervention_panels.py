"""The centering intervention's tables and figures (records: :mod:`normgeo.measure.intervention`).

- :func:`print_intervention`: one row per scope, the loss change, KL and top-1 agreement with intervals;
- :func:`plot_intervention_layers`: one model at one step: the loss change per block with its 95% interval
  (the all-norms scope as a band), and the loss change per bin of the tokens' energy along 1;
- :func:`plot_intervention_steps`: the all-norms scope over training, one line per arm (``normgeo.compare``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from normgeo.figures.style import (
    arm_color,
    arm_label,
    finish_axes,
    layer_key,
    norm_label,
    save_figure,
    step_tag,
    step_title,
)
from normgeo.figures.tables import print_table
from normgeo.paths import slug

ACTION_TEXT = {
    "remove": "mean subtraction removed",
    "add": "mean subtraction added",
    "mixed": "removed (LayerNorm) and added (RMSNorm)",
}


def headline(row: dict) -> tuple[str, float | None, float | None, float | None]:
    """(what, value, low, high) that a row is read by: the loss change of a language model, 1 - cosine of an
    encoder's output vectors (larger = more change, like a loss change)."""
    if row["output"] == "embedding":
        value, low, high = (
            None if row[k] is None else 1.0 - row[k] for k in ("cosine", "cosine_ci_high", "cosine_ci_low")
        )
        return "1 - cosine of the output vectors", value, low, high
    return (
        "Δ loss (nats, intervened − intact)",
        row["delta_loss"],
        row["delta_loss_ci_low"],
        row["delta_loss_ci_high"],
    )


def interval_text(value: float | None, low: float | None, high: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if low is None or high is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def print_intervention(rows: Sequence[dict], title: str, file=None) -> None:
    """One line per scope: what was done where, and what it changed (95% block-bootstrap intervals)."""
    embedding = rows[0]["output"] == "embedding"
    header = ["scope", "norms", "action", "tokens"]
    header += ["cosine [95% CI]"] if embedding else ["Δ loss [95% CI]", "KL [95% CI]", "top-1 agree [95% CI]"]
    table = []
    for row in rows:
        line = [row["scope_name"], str(len(row["sites"])), row["action"], f"{row['tokens']:,}"]
        if embedding:
            line.append(interval_text(row["cosine"], row["cosine_ci_low"], row["cosine_ci_high"], 5))
        else:
            line += [
                interval_text(row["delta_loss"], row["delta_loss_ci_low"], row["delta_loss_ci_high"]),
                interval_text(row["kl"], row["kl_ci_low"], row["kl_ci_high"], 5),
                interval_text(
                    row["top1_agreement"], row["top1_agreement_ci_low"], row["top1_agreement_ci_high"], 3
                ),
            ]
        table.append(line)
    if embedding:
        title += (
            " — an encoder without a language-model head: the cosine of its intact and intervened output "
            "vectors"
        )
    print_table(header, table, title=title, left=("scope", "action"), file=file)


def plot_intervention_layers(rows: Sequence[dict], out_dir: Path, step: int | None = None,
                             formats: Sequence[str] = ("png",)) -> Path | None:
    """The loss change per block (one block's norms intervened at a time) with 95% intervals, the
    all-norms scope as a shaded band; right: the loss change by the tokens' energy fraction along 1."""
    rows = [r for r in rows if r["step"] == step]
    layers = sorted((r for r in rows if r["scope"] == "layer"), key=lambda r: layer_key(str(r["layer"])))
    every = next((r for r in rows if r["scope"] == "all"), None)
    if not layers and every is None:
        return None
    what = headline((layers or [every])[0])[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    positions = np.arange(len(layers))
    values = [headline(r) for r in layers]
    left.errorbar(positions, [v[1] for v in values],
                  yerr=[[v[1] - v[2] for v in values], [v[3] - v[1] for v in values]],
                  fmt="o", capsize=3, color="tab:purple", label="one block's norms")
    if every is not None:
        _, value, low, high = headline(every)
        left.axhspan(
            low, high, color="tab:gray", alpha=0.25, label=f"all norms: {value:.4f} [{low:.4f}, {high:.4f}]"
        )
        left.axhline(value, color="tab:gray", lw=1)
    left.set_xticks(positions, [str(r["layer"]) for r in layers])
    finish_axes(left, "block whose norms are intervened on", what, line=0, legend=8)
    source = every or layers[0]
    bins = [b for b in source["energy_bins"] if b["tokens"]]
    key = "cosine" if source["output"] == "embedding" else "delta_loss"
    right.bar(
        range(len(bins)), [(1 - b[key]) if key == "cosine" else b[key] for b in bins], color="tab:purple"
    )
    right.set_xticks(range(len(bins)), [f"{b['fraction_low']:g}–{b['fraction_high']:g}\n{b['tokens']:,} tok"
                                        for b in bins], fontsize=7)
    finish_axes(right, f"token's energy fraction along 1 at the intervened inputs ({source['scope_name']})",
                f"mean {what.split(' (')[0]}", line=0)
    model, norm = source["model"], source["norm"]
    action = ACTION_TEXT.get(source["action"], source["action"])
    fig.suptitle(f"{model} · {norm_label(norm)} · {action} · {step_title(step)}")
    fig.tight_layout()
    return save_figure(fig, out_dir, f"intervention_{slug(model)}_{norm}_{step_tag(step)}", formats)[0]


def plot_intervention_steps(runs: Sequence[tuple[str, list[dict]]], out_dir: Path,
                            formats: Sequence[str] = ("png",), stem: str = "intervention") -> list[Path]:
    """The all-norms scope's loss change over training, one line per arm (the mean of its seeds; each seed
    thin), each arm's action in its label: removing LayerNorm's centering, adding RMSNorm's. ``runs``:
    (arm, the run's intervention rows) per run."""
    by_arm: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    seeds: dict[str, list[list[tuple[int, float]]]] = defaultdict(list)
    actions: dict[str, str] = {}
    for arm, rows in runs:
        series = sorted(
            (r["step"], headline(r)[1]) for r in rows if r["scope"] == "all" and r["step"] is not None
        )
        if not series:
            continue
        actions[arm] = next(r["action"] for r in rows if r["scope"] == "all")
        seeds[arm].append(series)
        for step, value in series:
            by_arm[arm][step].append(value)
    if not by_arm:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    for index, arm in enumerate(sorted(by_arm)):
        color = arm_color(arm, index)
        for series in seeds[arm]:
            ax.plot([s for s, _ in series], [v for _, v in series], color=color, lw=0.6, alpha=0.4)
        steps = sorted(by_arm[arm])
        ax.plot(steps, [float(np.mean(by_arm[arm][s])) for s in steps], color=color, lw=2, marker="o", ms=3,
                label=f"{arm_label(arm)}: {ACTION_TEXT.get(actions[arm], actions[arm])}")
    finish_axes(ax, "training step", "Δ loss of the intervention, all norms (nats)",
                "What the centering changes in the model's predictions", line=0, legend=8)
    return save_figure(fig, out_dir, stem, formats)
