"""The angle figures of one run: angle with each reference per layer and per step, the null band."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from normgeo.figures.intervention_panels import plot_intervention_layers
from normgeo.figures.mean_source_panels import plot_mean_sources_layers
from normgeo.figures.style import (
    REF_LABELS,
    SITE_STYLE,
    finish_axes,
    norm_label,
    save_figure,
    sorted_steps,
    step_tag,
    step_title,
)
from normgeo.measure.records import read_rows
from normgeo.paths import slug
from normgeo.run_folder import (
    INTERVENTION_FILE,
    MEAN_SOURCES_FILE,
    NULL_FILE,
    RunFolder,
)


def _layer_position(layer, n_layers: int) -> float:
    if layer == "final":
        return n_layers
    if layer == "embed":
        return -1
    return float(layer)


def _block_count(rows: list[dict]) -> int:
    """How many blocks the rows' integer layers number (the final norm is drawn at that position)."""
    return 1 + max((r["layer"] for r in rows if isinstance(r["layer"], int)), default=-1)


def _layer_errorbars(ax, rows: list[dict], n_layers: int, offset: float, **style) -> None:
    """Mean ± std of ``rows`` (one site's) at their layers' positions shifted by ``offset``; none: nothing."""
    series = sorted(rows, key=lambda r: _layer_position(r["layer"], n_layers))
    if series:
        ax.errorbar([_layer_position(r["layer"], n_layers) + offset for r in series],
                    [r["mean_deg"] for r in series], yerr=[r["std_deg"] for r in series], **style)


def _legend_below(fig, ax, columns: int) -> None:
    """``ax``'s legend under the panels: inside one, "best" still covered the points of a model with many
    layers (SmolLM2)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper center", ncol=min(len(labels), columns),
               bbox_to_anchor=(0.5, 0.0))


def _dress_layer_axes(ax, title: str, xlabel: str) -> None:
    """A per-layer panel: its title and x label, integer layers, the 90-degree line and a light grid."""
    finish_axes(ax, xlabel, title=title, line=90)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_layers(rows: list[dict], out_dir: Path, step=None, roles: Sequence[str] | None = None) -> Path:
    """:func:`layers_figure` written to ``out_dir``."""
    model, norm = rows[0]["model"], rows[0]["norm"]
    figure = layers_figure(rows, step, roles)
    return save_figure(figure, out_dir, f"layers_{slug(model)}_{norm}_{step_tag(step)}")[0]


def layers_figure(rows: list[dict], step=None, roles: Sequence[str] | None = None) -> Figure:
    """Mean +- std per layer, before/after every norm, one panel per reference (one model, one step): the
    paper's per-layer figure."""
    rows = [r for r in rows if r["step"] == step]
    model, norm = rows[0]["model"], rows[0]["norm"]
    refs = list(dict.fromkeys(r["ref"] for r in rows))
    n_layers = _block_count(rows)
    roles = roles or list(dict.fromkeys(r["site"].split(".")[0] for r in rows))
    fig, axes = plt.subplots(1, len(refs), figsize=(5.2 * len(refs), 4), sharey=True, squeeze=False)
    for ax, ref in zip(axes[0], refs, strict=True):
        for role_index, role in enumerate(roles):
            for suffix, (marker, label) in SITE_STYLE.items():
                offset = (role_index * len(SITE_STYLE) + list(SITE_STYLE).index(suffix)) * 0.06
                _layer_errorbars(ax, [r for r in rows if r["ref"] == ref and r["site"] == f"{role}.{suffix}"],
                                 n_layers, offset, fmt=marker, ms=4, capsize=2, lw=1, label=f"{role} {label}")
        _dress_layer_axes(ax, f"angle with {REF_LABELS.get(ref, ref)}", f"layer (final norm at {n_layers})")
    axes[0][0].set_ylabel("angle (degrees), mean ± std over tokens")
    _legend_below(fig, axes[0][0], columns=4)
    fig.suptitle(f"{model} · {norm_label(norm)} · {step_title(step)}")
    return fig


def plot_steps(rows: list[dict], out_dir: Path, layer: int | str, site: str = "ln1.in") -> Path:
    """Angle at one layer and site against training step, one curve per reference (Figure 4)."""
    rows = [r for r in rows if r["layer"] == layer and r["site"] == site and r["step"] is not None]
    model, norm = rows[0]["model"], rows[0]["norm"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ref in dict.fromkeys(r["ref"] for r in rows):
        series = sorted((r for r in rows if r["ref"] == ref), key=lambda r: r["step"])
        ax.errorbar(
            [r["step"] for r in series], [r["mean_deg"] for r in series], yerr=[r["std_deg"] for r in series],
            fmt="o-", ms=3, capsize=2, lw=1, label=REF_LABELS.get(ref, ref),
        )
    finish_axes(ax, "training step", "angle (degrees), mean ± std over tokens",
                f"{model} · {norm_label(norm)} · layer {layer} · {site}", line=90, legend=8)
    return save_figure(fig, out_dir, f"steps_{slug(model)}_{norm}_layer{layer}_{site}")[0]


def plot_compare(runs: dict[str, list[dict]], out_dir: Path, site: str = "ln1.in", ref: str = "ones") -> Path:
    """Arms side by side: per-layer angle at each arm's last step, one panel per run."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4), sharey=True, squeeze=False)
    names = []
    for ax, (name, rows) in zip(axes[0], runs.items(), strict=True):
        steps = [r["step"] for r in rows if r["step"] is not None]
        step = max(steps) if steps else None
        chosen = [r for r in rows if r["step"] == step and r["ref"] == ref]
        n_layers = _block_count(chosen)
        for suffix, (marker, label) in SITE_STYLE.items():
            # Side by side, after-markers hollow: in the RMSNorm arm after equals before and would hide it.
            of_site = [r for r in chosen if r["site"] == f"{site.split('.')[0]}.{suffix}"]
            _layer_errorbars(ax, of_site, n_layers, list(SITE_STYLE).index(suffix) * 0.12, fmt=marker, ms=4,
                             capsize=2, label=label, mfc="none" if suffix != "in" else None)
        norm = chosen[0]["norm"] if chosen else "?"
        model = chosen[0]["model"] if chosen else name
        _dress_layer_axes(ax, f"{model} · {norm_label(norm)} · {step_title(step)}", "layer")
        names.append(norm)
    axes[0][0].set_ylabel(f"angle with {REF_LABELS.get(ref, ref)} (degrees)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{site.split('.')[0]} before/after the norm: {' vs '.join(norm_label(n) for n in names)}")
    return save_figure(fig, out_dir, f"compare_{'_'.join(names)}_{site.split('.')[0]}_{ref}")[0]


def _null_series(rows: list[dict], suffix: str, n_layers: int) -> list[list[dict]]:
    """Rows of one site kind, grouped by role (ln1, ln2, final, ...), each sorted by layer."""
    roles = list(dict.fromkeys(r["site"].split(".")[0] for r in rows if r["site"].endswith(f".{suffix}")))
    return [
        sorted(
            (r for r in rows if r["site"] == f"{role}.{suffix}"),
            key=lambda r: _layer_position(r["layer"], n_layers),
        )
        for role in roles
    ]


def plot_null_layers(null_rows: list[dict], out_dir: Path, step=None) -> Path:
    """Per layer: 1's mean angle (95% CI) over the random directions' 5-95% band, before/after each norm."""
    rows = [r for r in null_rows if r["step"] == step]
    model, norm, k = rows[0]["model"], rows[0]["norm"], rows[0]["null_k"]
    n_layers = _block_count(rows)
    suffixes = [s for s in SITE_STYLE if any(r["site"].endswith(f".{s}") for r in rows)]
    fig, axes = plt.subplots(1, len(suffixes), figsize=(5.6 * len(suffixes), 4), sharey=False, squeeze=False)
    for ax, suffix in zip(axes[0], suffixes, strict=True):
        for index, series in enumerate(_null_series(rows, suffix, n_layers)):
            role = series[0]["site"].split(".")[0]
            x = [_layer_position(r["layer"], n_layers) + 0.12 * index for r in series]
            band = ax.vlines(x, [r["null_mean_p05"] for r in series], [r["null_mean_p95"] for r in series],
                             color=f"C{index}", alpha=0.3, lw=7)
            ax.plot(x, [r["null_mean_p50"] for r in series], "_", color=f"C{index}", ms=9)
            y = [r["mean_deg"] for r in series]
            has_ci = all(r["mean_ci_low"] is not None for r in series)
            err = [[m - r["mean_ci_low"] for m, r in zip(y, series, strict=True)],
                   [r["mean_ci_high"] - m for m, r in zip(y, series, strict=True)]] if has_ci else None
            ax.errorbar(x, y, yerr=err, fmt="o", color=f"C{index}", ms=3.5, capsize=2, lw=1,
                        label=f"{role}: 1 (95% CI)" if has_ci else f"{role}: 1")
            band.set_label(f"{role}: {k} random directions, 5–95% (tick: median)")
        _dress_layer_axes(ax, SITE_STYLE[suffix][1], f"layer (final norm at {n_layers})")
    _legend_below(fig, axes[0][0], columns=3)
    axes[0][0].set_ylabel("mean angle over tokens (degrees)")
    fig.suptitle(f"{model} · {norm_label(norm)} · {step_title(step)}: is 1 a typical direction?")
    return save_figure(fig, out_dir, f"null_layers_{slug(model)}_{norm}_{step_tag(step)}")[0]


def plot_null_steps(null_rows: list[dict], out_dir: Path, layer: int | str, site: str = "ln1.in") -> Path:
    """1's mean angle (95% CI) and the random directions' 5-95% band at one layer against the step."""
    rows = sorted(
        (r for r in null_rows if r["layer"] == layer and r["site"] == site and r["step"] is not None),
        key=lambda r: r["step"],
    )
    model, norm, k = rows[0]["model"], rows[0]["norm"], rows[0]["null_k"]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(steps, [r["null_mean_p05"] for r in rows], [r["null_mean_p95"] for r in rows], alpha=0.25,
                    color="C0", label=f"{k} random directions, 5–95%")
    ax.plot(steps, [r["null_mean_p50"] for r in rows], "--", color="C0", lw=1, label="random, median")
    y = [r["mean_deg"] for r in rows]
    has_ci = all(r["mean_ci_low"] is not None for r in rows)
    err = [[m - r["mean_ci_low"] for m, r in zip(y, rows, strict=True)],
           [r["mean_ci_high"] - m for m, r in zip(y, rows, strict=True)]] if has_ci else None
    ax.errorbar(steps, y, yerr=err, fmt="o-", color="C3", ms=3, capsize=2, lw=1,
                label="uniform vector 1 (95% CI)" if has_ci else "uniform vector 1")
    finish_axes(ax, "training step", "mean angle over tokens (degrees)",
                f"{model} · {norm_label(norm)} · layer {layer} · {site}", line=90, legend=8)
    return save_figure(fig, out_dir, f"null_steps_{slug(model)}_{norm}_layer{layer}_{site}")[0]


def write_run_figures(
    run_dir: str | Path, layer: int | str | None = None, out_dir: Path | None = None
) -> list[Path]:
    """All figures for one run directory, written to ``out_dir`` (default ``<run_dir>/figures``)."""
    folder = RunFolder(run_dir)
    if not read_rows(folder.angles):
        return []
    out_dir = out_dir or folder.figures
    figures = []
    # (records file, figure at a step, figure over the steps, whether the first trained step is drawn too)
    for path, plot_at_step, plot_over_steps, first_too in (
            (folder.angles, plot_layers, plot_steps, True),
            (folder.record(NULL_FILE), plot_null_layers, plot_null_steps, False)):
        by_model = defaultdict(list)
        for row in read_rows(path):
            by_model[(row["model"], row["norm"])].append(row)
        for model_rows in by_model.values():
            steps = sorted_steps(model_rows)
            figures.append(plot_at_step(model_rows, out_dir, step=steps[-1]))
            trained = [s for s in steps if s is not None]
            if len(trained) > 1:
                if first_too:
                    figures.append(plot_at_step(model_rows, out_dir, step=trained[0]))
                layers = sorted({r["layer"] for r in model_rows if isinstance(r["layer"], int)})
                chosen = layer if layer is not None else layers[len(layers) // 2]
                figures.append(plot_over_steps(model_rows, out_dir, chosen))
    for name, plot in ((INTERVENTION_FILE, plot_intervention_layers),
                       (MEAN_SOURCES_FILE, plot_mean_sources_layers)):
        records = read_rows(folder.record(name))
        for step in sorted_steps(records)[-1:]:  # the last step's figure, where it has one
            figure = plot(records, out_dir, step=step)
            if figure is not None:
                figures.append(figure)
    return figures

