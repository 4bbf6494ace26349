"""Every number the README and the docs/ pages (probe.md, compare.md, pretrained.md) quote, printed as
markdown from the outputs of ``docs/make_figures.sh``.

    python docs/readme_numbers.py outputs/readme > docs/numbers.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from normgeo.figures.model_summary import summarize, summary_markdown
from normgeo.measure.records import read_rows
from normgeo.paths import repo_relative
from normgeo.run_folder import ANGLES_FILE, NULL_FILE, RunFolder

GROUPS = (("early", 0, 9), ("middle", 10, 19), ("late", 20, 29))


def row(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


def smoke(out: Path) -> list[str]:
    lines = ["## Smoke runs (`experiment=smoke`, 100 steps, 4,096 pydoc probe tokens)", ""]
    arms = {norm: read_rows(out / f"smoke-{norm}-s0" / ANGLES_FILE) for norm in ("layer", "rms")}
    nulls = {norm: read_rows(out / f"smoke-{norm}-s0" / NULL_FILE) for norm in ("layer", "rms")}
    lines.append("| arm | step | layer | site | ref | mean ± std over tokens |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for norm, step, layer, site, ref in (
        ("layer", 0, 0, "ln1.in", "ones"),
        ("rms", 0, 0, "ln1.in", "ones"),
        ("layer", 0, 0, "ln1.out", "ones"),
        ("layer", 100, 0, "ln1.out", "ones"),
        ("layer", 100, 0, "ln1.out", "rand_a"),
        ("rms", 100, 0, "ln1.out", "ones"),
        ("rms", 100, 1, "ln1.in", "ones"),
        ("rms", 100, 1, "ln1.in", "rand_a"),
        ("rms", 100, 1, "ln1.in", "rand_b"),
        ("rms", 100, "final", "final.in", "ones"),
        ("layer", 100, "final", "final.in", "ones"),
    ):
        r = row(arms[norm], step=step, layer=layer, site=site, ref=ref)
        lines.append(f"| {norm} | {step} | {layer} | {site} | {ref} | "
                     f"{r['mean_deg']:.4f} ± {r['std_deg']:.4f}° |")
    lines += ["", "Where 1 stands among the K = 64 random directions (null.jsonl):", ""]
    lines += null_table([r for norm in ("layer", "rms") for r in nulls[norm]
                         if r["step"] == 100 or (r["layer"] == 1 and r["site"] == "ln1.in")])
    return lines


def null_table(rows: list[dict]) -> list[str]:
    lines = ["| model | norm | step | layer | site | 1: mean (95% CI) | random 5% / 50% / 95% | 1 in band "
             "| rank | 1 − median (95% CI) | std of 1 / random median |", "| --- |" + " --- |" * 10]
    for r in rows:
        step = "-" if r["step"] is None else r["step"]
        lines.append(
            f"| {r['model']} | {r['norm']} | {step} | {r['layer']} | {r['site']} | "
            f"{r['mean_deg']:.2f} ({r['mean_ci_low']:.2f}, {r['mean_ci_high']:.2f}) | "
            f"{r['null_mean_p05']:.2f} / {r['null_mean_p50']:.2f} / {r['null_mean_p95']:.2f} | "
            f"{'yes' if r['in_null_band'] else 'no'} | {r['mean_rank_pct']:.0f}% | "
            f"{r['diff_deg']:+.2f} ({r['diff_ci_low']:+.2f}, {r['diff_ci_high']:+.2f}) | "
            f"{r['std_deg']:.2f} / {r['null_std_p50']:.2f} |"
        )
    return lines


def groups(null: list[dict]) -> list[str]:
    """Per layer group and site kind: at how many norms 1 is inside the band, with the intervals' range."""
    lines = ["| layer group | site | norms with 1 in random 5–95% | 1's mean (range over norms) | "
             "95% CI of 1's mean (lowest low, highest high) | random band (lowest 5%, highest 95%) | "
             "1 − random median (range) |", "| --- |" + " --- |" * 6]
    named = [("embed", lambda r: r["layer"] == "embed"),
             *((name, lambda r, a=a, b=b: isinstance(r["layer"], int) and a <= r["layer"] <= b)
               for name, a, b in GROUPS),
             ("final", lambda r: r["layer"] == "final")]
    for name, member in named:
        for suffix in ("in", "std", "out"):
            rows = [r for r in null if member(r) and r["site"].endswith(f".{suffix}")]
            if not rows:
                continue
            inside = sum(r["in_null_band"] for r in rows)
            means = [r["mean_deg"] for r in rows]
            diffs = [r["diff_deg"] for r in rows]
            lines.append(
                f"| {name} | {suffix} | {inside}/{len(rows)} | {min(means):.2f}–{max(means):.2f}° | "
                f"{min(r['mean_ci_low'] for r in rows):.2f}–{max(r['mean_ci_high'] for r in rows):.2f}° | "
                f"{min(r['null_mean_p05'] for r in rows):.2f}–{max(r['null_mean_p95'] for r in rows):.2f}° | "
                f"{min(diffs):+.2f} to {max(diffs):+.2f}° |"
            )
    return lines


def pretrained(out: Path, model: str) -> list[str]:
    run = out / "analyze" / model
    rows, null = read_rows(RunFolder(run).angles), read_rows(RunFolder(run).record(NULL_FILE))
    info = json.loads(RunFolder(run).run_info.read_text())
    lines = [f"## {model} ({info['tokens']:,} tokens of {info['probe_source']}, {info['dtype']}, "
             f"min_doc_tokens {info['probe_min_doc_tokens']}, sampled {info['probe_sampled']})", ""]
    lines += [summary_markdown(summarize(rows, null)),
              "Per layer group (layers 0–9, 10–19, 20–29, final norm):", "", *groups(null),
              "", "Every norm:", "", *null_table(null), "",
              f"run_info: load {info['load_s']} s, probe {info['probe_s']} s, {info['tokens_per_s']} "
              f"tokens/s, peak RSS {info['peak_rss_mib']} MiB", ""]
    return lines


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/readme")
    lines = ["# Numbers quoted in the README and the docs/ pages", "",
             "Generated by `bash docs/make_figures.sh` (`python docs/readme_numbers.py <output_root>`); "
             "do not edit by hand.", ""]
    lines += smoke(out) + [""]
    for model in ("smollm2-135m-instruct-q4_1", "minilm"):
        lines += pretrained(out, model)
    print(repo_relative("\n".join(lines)))  # paths as the repository sees them


if __name__ == "__main__":
    main()
