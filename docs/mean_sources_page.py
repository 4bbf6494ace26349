"""docs/mean_sources.md: where the component along 1 lives, from analyze.py output folders (or training runs).

  python docs/mean_sources_page.py <folder> ... > docs/mean_sources.md

Each folder holds ``mean_sources.jsonl`` and, where the centering intervention ran, ``intervention.jsonl`` and
``intervention_positions.jsonl`` (a training run: its last probed step). ``docs/make_mean_sources.sh`` runs
it on the packaged pretrained models.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from normgeo.figures.intervention_panels import interval_text
from normgeo.measure.mean_sources import DOC_START, MASSIVE_RATIO
from normgeo.measure.records import read_rows
from normgeo.paths import repo_relative
from normgeo.run_folder import INTERVENTION_FILE, INTERVENTION_POSITIONS_FILE, MEAN_SOURCES_FILE, RunFolder

FIRST = "0"  # the bucket of each probe window's first position
DOCS_FIGURES = Path(__file__).resolve().parents[1] / "docs/figures"  # where make_mean_sources.sh copies them


def last_step(rows: list[dict]) -> list[dict]:
    """The rows of the last probed step (an analysis has one, with step null)."""
    steps = [r["step"] for r in rows if r["step"] is not None]
    return [r for r in rows if r["step"] == max(steps)] if steps else rows


def percent(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def ci(row: dict, name: str, digits: int) -> str:
    """A row's estimate of ``name`` with its 95% interval."""
    return interval_text(row[name], row[f"{name}_ci_low"], row[f"{name}_ci_high"], digits)


def share_interval(value: float | None, low: float | None, high: float | None) -> str:
    """A share with its 95% interval, in percent (the estimate alone where there is none)."""
    if low is None or high is None:
        return percent(value)
    return f"{percent(value)} [{percent(low)}, {percent(high)}]"


def median_range(values: list[float], interval: list[float | None] | None = None) -> str:
    """The median of ``values`` (with ``interval``, [median, low, high] over documents: its 95% interval)
    and their range."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    median = share_interval(*interval) if interval else percent(statistics.median(values))
    return f"{median} (range {percent(min(values))} to {percent(max(values))})"


class Folder:
    """One model's records: its mean sources by site, and the intervention (all norms at once) by position."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        rows = last_step(read_rows(folder / MEAN_SOURCES_FILE))
        self.dimensions = [r for r in rows if r["kind"] == "dimensions"]
        # The window-position buckets partition the tokens; the document starts overlap them (read apart).
        self.positions = [r for r in rows if r["kind"] == "position" and r["bucket"] != DOC_START]
        self.doc_starts = {(r["layer"], r["site"]): r for r in rows
                           if r["kind"] == "position" and r["bucket"] == DOC_START and r["count"]}
        info_file = RunFolder(folder).run_info
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        self.model, self.norm, self.step = rows[0]["model"], rows[0]["norm"], rows[0]["step"]
        self.documents = self.dimensions[0].get("documents") if self.dimensions else None
        spans = f"{self.documents:,} documents" if self.documents else "documents unknown"
        cap = info.get("probe_max_doc_tokens")
        self.described = (
            f"{info['tokens']:,} tokens of {info['probe_source']} ({spans}"
            f"{f', each cut to its first {cap:,} tokens' if cap else ''}), windows of {info['seq_len']}, "
            f"{info['dtype']}" if info else f"step {self.step}; {spans}"
        )
        self.intervention = self.scope_all(folder / INTERVENTION_FILE)
        by_position = self.scope_all(folder / INTERVENTION_POSITIONS_FILE)
        self.by_position = [r for r in by_position if r["bucket"] != DOC_START]
        self.doc_start_changes = [r for r in by_position if r["bucket"] == DOC_START and r["tokens"]]

    @staticmethod
    def scope_all(path: Path) -> list[dict]:
        return [r for r in last_step(read_rows(path)) if r["scope"] == "all"] if path.is_file() else []

    def site_positions(self, layer: object, site: str) -> list[dict]:
        return [r for r in self.positions if r["layer"] == layer and r["site"] == site]

    def first_share(self, row: dict) -> float | None:
        """Position 0's part of the site's E[mu^2]."""
        first = [r for r in self.site_positions(row["layer"], row["site"]) if r["bucket"] == FIRST]
        return first[0]["mean_sq_share"] if first else None

    def first_tokens(self) -> float:
        """Position 0's part of the probed tokens."""
        buckets = self.site_positions(self.dimensions[0]["layer"], self.dimensions[0]["site"])
        total = sum(r["count"] for r in buckets)
        return sum(r["count"] for r in buckets if r["bucket"] == FIRST) / total if total else float("nan")

    def with_interval(self, row: dict, share: str) -> str:
        """A site's share with its interval over documents (records without one: the share alone)."""
        value = self.first_share(row) if share == "position0_share" else row[share]
        return share_interval(value, row.get(f"{share}_low"), row.get(f"{share}_high"))

    def fraction_first_and_rest(self, row: dict) -> tuple[float | None, float | None]:
        """The mean energy fraction along 1 of position 0's tokens and of all the others'."""
        buckets = self.site_positions(row["layer"], row["site"])
        first = [r["mean"] for r in buckets if r["bucket"] == FIRST and r["count"]]
        rest = [(r["count"], r["mean"]) for r in buckets if r["bucket"] != FIRST and r["count"]]
        count = sum(c for c, _ in rest)
        return (first[0] if first else None, sum(c * m for c, m in rest) / count if count else None)

    def inputs_median(self, share: str) -> list[float | None] | None:
        """[median, low, high] of ``share`` over the inputs, its interval over documents (None: unknown)."""
        return self.dimensions[0].get(f"inputs_median_{share}") if self.dimensions else None

    def finding(self) -> str:
        """The model's answer in one paragraph, from its numbers."""
        shares = [self.first_share(r) for r in self.dimensions]
        top8 = [r["top8_share"] for r in self.dimensions]
        massive = [r for r in self.dimensions if r["massive_count"]]
        sites = len(self.dimensions)
        over = (f" (95% intervals of the medians: a bootstrap over the probe's {self.documents:,} documents)"
                if self.documents and self.inputs_median("position0_share") else "")
        text = (
            f"**{self.model}** ({self.norm}): position 0 is {percent(self.first_tokens())} of the probed "
            f"tokens and holds a median {median_range(shares, self.inputs_median('position0_share'))} of "
            f"E[μ²] over its {sites} norm inputs{over}; the 8 dimensions with the largest |φᵢ| hold "
            f"{median_range(top8, self.inputs_median('top8_share'))}. "
        )
        exact = all(r.get("median_exact") for r in self.dimensions)
        rule = f"max |xᵢ| over {MASSIVE_RATIO:g}× the {'exact ' if exact else ''}median |x|"
        if massive:
            carried = median_range([r["massive_share"] for r in massive], self.inputs_median("massive_share"))
            text += (
                f"Massive dimensions ({rule}) appear at {len(massive)} of the {sites} inputs and carry "
                f"{carried} of E[μ²] there. "
            )
        else:
            text += f"No input has a massive dimension ({rule}). "
        if self.doc_starts:
            first_site = self.dimensions[0]
            starts = self.doc_starts.get((first_site["layer"], first_site["site"]))
            part = starts["count"] / first_site["count"] if starts and first_site["count"] else None
            shares = [r["mean_sq_share"] for r in self.doc_starts.values()]
            text += (f"The first tokens of the probe's documents ({starts['count'] if starts else 0:,}) are "
                     f"{percent(part, 2)} of its tokens and hold a median {median_range(shares)} of E[μ²]. ")
        first = [r for r in self.by_position if r["bucket"] == FIRST]
        if self.intervention and first:
            whole = self.intervention[0]
            if whole["output"] == "next_token":
                text += (
                    f"The centering intervention on all norms ({whole['action']}) changes the loss by "
                    f"{ci(whole, 'delta_loss', 4)} nats; the predictions at position 0 make "
                    f"{percent(first[0]['delta_loss_share'])} of that change and "
                    f"{percent(first[0]['kl_share'])} of the KL"
                )
                for r in self.doc_start_changes:  # one row (scope "all"), where the documents are known
                    text += (f", those at the documents' first tokens {percent(r['delta_loss_share'])} and "
                             f"{percent(r['kl_share'])}")
                text += "."
            else:
                text += (
                    f"The centering intervention on all norms ({whole['action']}) leaves a mean cosine of "
                    f"{whole['cosine']:.5f} between intact and intervened outputs; at position 0 it is "
                    f"{first[0]['cosine']:.5f}."
                )
        return text

    def tables(self) -> list[str]:
        lines = [
            f"## {self.model} ({self.norm}; {self.described})",
            "",
            f"Source: `{self.folder}`. E[μ²] share at position 0, the mean energy "
            "fraction along 1 of position 0's tokens and of the others', the shares of E[μ²] of the top 1 "
            "and top 8 dimensions by |φᵢ|, the dimensions needed for 90% of it, and the massive dimensions "
            "(max |xᵢ| over 100× the exact median |x|) with their share; the shares at position 0, of the "
            "top 8 and of the massive dimensions with their 95% intervals over the probe's documents "
            "(bootstrap).",
            "",
            "| layer | site | d | E[μ²] at pos 0 | fraction at pos 0 | fraction elsewhere | top 1 | top 8 | "
            "dims for 90% | massive (top dims) | massive share |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        # The run's figure (normgeo/figures/mean_source_panels.py), where docs/make_mean_sources.sh copied it.
        figures = sorted(p.name for p in RunFolder(self.folder).figures.glob("mean_sources_*.png")
                         if (DOCS_FIGURES / p.name).is_file())
        lines[2:2] = [*(f"![where the mean lives in {self.model}](figures/{name})" for name in figures),
                      *([""] if figures else [])]
        for r in self.dimensions:
            first, rest = self.fraction_first_and_rest(r)
            dims = ", ".join(str(d) for d in r["massive_dims"][:4])
            dims += ", ..." if r["massive_count"] > 4 else ""
            lines.append(
                f"| {r['layer']} | {r['site']} | {r['dim']} | {self.with_interval(r, 'position0_share')} | "
                f"{'-' if first is None else f'{first:.2e}'} | {'-' if rest is None else f'{rest:.2e}'} | "
                f"{percent(r['top1_share'])} | {self.with_interval(r, 'top8_share')} | "
                f"{r['dims_for_90'] or '-'} | {r['massive_count']}{f' ({dims})' if dims else ''} | "
                f"{self.with_interval(r, 'massive_share') if dims else percent(r['massive_share'])} |"
            )
        if self.by_position:
            next_token = self.by_position[0]["output"] == "next_token"
            lines += ["", "The centering intervention on all norms, by the position of the predicting token "
                      "(95% block-bootstrap intervals over probe windows):", ""]
            if next_token:
                lines += ["| positions | tokens | Δloss (nats) | share of Δloss | KL | share of KL | "
                          "top-1 agreement |", "| --- | --- | --- | --- | --- | --- | --- |"]
            else:
                lines += ["| positions | tokens | cosine |", "| --- | --- | --- |"]
            for r in [*self.by_position, *self.doc_start_changes]:
                if not r["tokens"]:
                    continue
                where = "document starts (any position)" if r["bucket"] == DOC_START else r["bucket"]
                if next_token:
                    lines.append(f"| {where} | {r['tokens']:,} | {ci(r, 'delta_loss', 4)} | "
                                 f"{percent(r['delta_loss_share'])} | {r['kl']:.2e} | "
                                 f"{percent(r['kl_share'])} | {percent(r['top1_agreement'], 2)} |")
                else:
                    lines.append(f"| {where} | {r['tokens']:,} | {ci(r, 'cosine', 5)} |")
        return [*lines, ""]


def page(folders: list[Path]) -> str:
    models = [Folder(f) for f in folders]
    lines = [
        "# Where the mean lives",
        "",
        "Generated by `bash docs/make_mean_sources.sh` (`docs/mean_sources_page.py` over its `analyze.py` "
        "folders and training runs at their last probe; by default the study's seed-0 LayerNorm and "
        "RMSNorm arms, which it trains: experiment=study_cpu, 4 layers, d = 64, 1,000 steps on OpenWebText"
        "); do not edit. Which positions and which feature dimensions carry each norm input's "
        "component along **1** (`mean_sources.jsonl`, docs/probe.md), and whose predictions the centering "
        "intervention changes (`intervention_positions.jsonl`). With μ(x) = (1/d) Σᵢ xᵢ, φᵢ = E[μ xᵢ / d] "
        "and Σᵢ φᵢ = E[μ²] exactly. A φᵢ can be negative (a dimension that leans against the mean), so the "
        "shares of a few dimensions can exceed 100% or fall below 0. E[μ²] is absolute: a token with a "
        "large norm weighs in it by its size, while its energy fraction along 1 (μ² / mean(x²)) is relative "
        "to its own energy.",
        "",
        "## The finding",
        "",
        *[f"- {m.finding()}" for m in models],
        "",
        *[line for m in models for line in m.tables()],
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(repo_relative(page([Path(arg) for arg in sys.argv[1:]])))
