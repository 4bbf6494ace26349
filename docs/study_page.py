"""Writes docs/study.md (to stdout) from a finished ``docs/make_study.sh`` folder, and copies its figures.

    python docs/study_page.py outputs/study > docs/study.md

Every number on the page is read from the study's own files: the verdict (``compare/verdict.md``), the
per-run summary (``compare/summary.csv``), the logged peak RSS at each probe (``compare/metrics.parquet``),
each run's ``summary.json`` (disk use), and the script's ``commands.txt``, ``wall_s.txt``, ``disk_bytes.txt``;
after ``bash docs/export_study.sh``, each run's ``eval.json`` (downstream scores) and ``export_eval_wall_s.txt``.
The verdict's words (equivalent / different / inconclusive, the families, the primary question) are
``normgeo.compare``'s, taken as they are.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd

from normgeo.figures.sweep import markdown
from normgeo.measure.stats import mean_t_interval
from normgeo.runs.downstream import EVAL_FILE

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"verdict": "study-verdict.png", "loss": "study-loss.png", "factorial_ones": "study-factorial_ones.png",
           "energy": "study-energy.png", "overlay_ln1.in_ones": "study-overlay_ln1.in_ones.png",
           "val_curve_diff": "study-val_curve_diff.png", "intervention": "study-intervention.png"}


def memory_table(metrics: pd.DataFrame) -> tuple[str, float]:
    """Per run: the process's RSS now and its peak at the first probe after training began (step > 0, when the
    optimizer state exists) and at the last probe, and the peak's growth between them (MiB)."""
    lines = ["| run | probes | RSS at first trained probe (MiB) | at last probe | peak RSS at first trained probe | "
             "at last probe | peak growth |", "|---|---|---|---|---|---|---|"]
    worst = 0.0
    trained = metrics[metrics["step"] > 0]
    for run, rows in trained.groupby("run", sort=True):
        rss = rows[rows["metric"] == "mem/rss_mib"].sort_values("step")["value"]
        peak = rows[rows["metric"] == "mem/peak_rss_mib"].sort_values("step")["value"]
        if peak.empty:
            continue
        growth = float(peak.iloc[-1] - peak.iloc[0])
        worst = max(worst, growth)
        lines.append(f"| {run} | {len(peak)} | {rss.iloc[0]:,.0f} | {rss.iloc[-1]:,.0f} | {peak.iloc[0]:,.0f} | "
                     f"{peak.iloc[-1]:,.0f} | {growth:+,.0f} |")
    return "\n".join(lines), worst


def downstream_section(out: Path, summary: pd.DataFrame) -> str:
    """Per arm and task: the mean accuracy over seeds with its 95% t-interval (empty before export_study.sh)."""
    rows = []
    for run in summary.itertuples():
        path = out / run.run / EVAL_FILE
        if path.is_file():
            record = json.loads(path.read_text())
            rows += [{"arm": run.arm, "seed": run.seed, "task": task, "step": record.get("step"),
                      "examples": scores.get("examples"), "acc": scores.get("acc")}
                     for task, scores in record.get("tasks", {}).items()]
    if not rows:
        return ""
    frame = pd.DataFrame(rows)
    table = []
    for (task, arm), group in frame.groupby(["task", "arm"], sort=True):
        mean, low, high = mean_t_interval(group["acc"].astype(float).tolist())
        interval = "-" if low is None else f"{low:.3f} to {high:.3f}"
        table.append({"task": task, "arm": arm, "seeds": len(group), "examples": int(group["examples"].max()),
                      "acc (mean)": f"{mean:.3f}", "95% interval over seeds": interval,
                      "per seed": ", ".join(f"{v:.3f}" for v in group.sort_values("seed")["acc"])})
    wall = out / "export_eval_wall_s.txt"
    took = f" in {int(wall.read_text()) / 60:.1f} minutes" if wall.is_file() else ""
    return f"""## Downstream: the local next-sentence task

`bash docs/export_study.sh` exported every run's last checkpoint to a Hugging Face directory and scored it
with lm-evaluation-harness on `wiki_next_sentence` (choose a Wikipedia paragraph's true next sentence among 4;
chance 0.25; [export.md](export.md#downstream-evaluation)){took}. The verdict above contrasts the arms on it
seed by seed (`downstream/wiki_next_sentence/acc`).

{markdown(pd.DataFrame(table))}
"""


def most_concurrent(runs: list[Path]) -> int:
    """The most runs that were training at once: each run from its run_config.yaml (written at its start) to
    its summary.json (written at its end)."""
    events = []
    for run in runs:
        start, end = run / "run_config.yaml", run / "summary.json"
        if start.is_file() and end.is_file():
            events += [(start.stat().st_mtime, 1), (end.stat().st_mtime, -1)]
    running = most = 0
    for _, change in sorted(events):
        running += change
        most = max(most, running)
    return max(most, 1)


def main(out: Path, figures_dir: Path = ROOT / "docs" / "figures") -> str:
    """The page's markdown; the study's figures are copied into ``figures_dir``."""
    compare = out / "compare"
    verdict = (compare / "verdict.md").read_text().replace("# Verdict\n", "", 1).strip()
    if verdict.startswith("## "):
        verdict = "\n" + verdict
    verdict = verdict.replace("\n### ", "\n#### ").replace("\n## ", "\n### ")  # under "## Verdict"
    summary = pd.read_csv(compare / "summary.csv")
    metrics = pd.read_parquet(compare / "metrics.parquet")
    memory, worst_growth = memory_table(metrics)
    wall_s = int((out / "wall_s.txt").read_text())
    disk = int((out / "disk_bytes.txt").read_text())
    commands = (out / "commands.txt").read_text().strip()
    runs = sorted(p.parent for p in out.glob("*/summary.json"))
    run_disk = [json.loads((run / "summary.json").read_text()).get("disk_bytes") or {} for run in runs]
    checkpoint_mb = sum(d.get("checkpoints", 0) for d in run_disk) / 1e6
    records_mb = sum(d.get("records", 0) for d in run_disk) / 1e6
    for name, target in FIGURES.items():
        source = compare / f"{name}.png"
        if source.is_file():
            shutil.copyfile(source, figures_dir / target)
    lanes = most_concurrent(runs)
    lanes_text = ("one after another on one 2-core machine" if lanes == 1 else
                  f"{lanes} at a time on one 2-core machine (`STUDY_JOBS={lanes}`: whole seeds on lanes side by side, "
                  "each with its share of the cores; counted from the runs' start and end times)")
    load = out / "load.txt"
    load_text = (f"; the machine's load average (1 min) before and after: {load.read_text().strip()}"
                 if load.is_file() else "; the machine's load during the study was not recorded")
    steps = int(summary["final_step"].max())
    probe_steps = sorted(int(x) for x in metrics[metrics["metric"] == "mem/peak_rss_mib"]["step"].unique())
    trained_probes = [x for x in probe_steps if x > 0]
    every = trained_probes[1] - trained_probes[0] if len(trained_probes) > 1 else steps
    tokens = int(summary["tokens"].max())
    columns = ["arm", "seed", "final_step", "tokens", "train_loss", "val_loss", "wall_s", "tokens_per_s"]
    table = markdown(summary[columns])
    return f"""# The CPU study: LayerNorm, RMSNorm, the factorial cells and DyT, over seeds

Generated by `bash docs/make_study.sh` (then `python docs/study_page.py`) on the current code: {len(runs)} runs
of the `study_cpu` preset (4 blocks, d = 64, 32-token windows, 8 sequences a step; `conf/train/size/study_cpu.yaml`)
on real OpenWebText text (`../shared/corpora/webtext`), {steps} optimizer steps and {tokens:,} tokens each, probed
at step 0 and every {every} steps ({len(probe_steps)} probes) on 2,048 Wikipedia tokens (`../shared/corpora/wikipedia`). The arms of one seed
share every non-norm initial weight and every batch, so they are compared seed by seed.

**Scope.** These are small models trained briefly on a 2-core CPU: the numbers answer the question for
*this* setting, as a demonstration of the method; at the paper's sizes the same commands run on GPUs
(`experiment=paper_70m` … `paper_1b`). The verdict's tokens/s is each run's median per-step training
throughput (`perf/tokens_per_s`: the steps that hold a probe or a validation do not move a median); the
runs went {lanes_text}, each seed's arms back to back{load_text}. On CPU that compares torch's CPU kernels,
not the GPU kernels the paper's claim is about ([benchmarks.md](benchmarks.md)). The table's `tokens_per_s`
is the wall-clock rate, probes included.

**Wall time** {wall_s / 60:.1f} minutes in all (data preparation, {len(runs)} runs, the comparison).
**Disk** {disk / 1e9:.2f} GB for the study folder: checkpoints {checkpoint_mb:,.0f} MB, records
{records_mb:,.1f} MB over all runs (each run's `summary.json`, `disk_bytes`), the rest prepared data and logs.

## Verdict

{verdict}

![The verdict: per-seed differences, 95% and 90% t-intervals, and the equivalence margins](figures/study-verdict.png)

![The paired difference of the validation curves, per contrast, with its pointwise 95% interval](figures/study-val_curve_diff.png)

![The centering intervention over training: Δ loss of taking the mean subtraction out of LayerNorm, of putting it into RMSNorm](figures/study-intervention.png)

**Which numbers are bitwise.** On one machine with the same software, a re-run of a study pair gives
identical records and losses, bit for bit (`tests/test_study.py` re-runs the `layer`/`rms` pair of seed 0
with the study preset, shortened, and compares every records file and logged loss). Across machines none of
the trained-run numbers are bitwise: CPUs differ in the order of floating-point sums (vector width, kernels,
threads), so losses agree to a few decimals while the probe's records move more; a statistic that cuts a
continuous quantity at a threshold (1 inside or outside the band) can flip between machines or adjacent
probes. That is why the verdict tests continuous quantities pooled per run, over seeds, and over a window
of probes, and keeps the in-band share as a description only.

## Loss and angles

![Train and validation loss per arm](figures/study-loss.png)

![Every arm's angle with 1 before and after the norms](figures/study-factorial_ones.png)

![Energy along 1 at the norm inputs](figures/study-energy.png)

![ln1.in: angle with 1 per layer over training](figures/study-overlay_ln1.in_ones.png)

{downstream_section(out, summary)}
## Every run

{table}

## Memory across probes

Each probe logs the process's RSS (`mem/rss_mib`) and its peak RSS (`mem/peak_rss_mib`). A long run must
stay flat once training has begun (the step-0 probe comes before the optimizer state exists): the largest
growth of the peak from the first trained probe (step {trained_probes[0] if trained_probes else 0}) to the last (step {steps}) of any run is
{worst_growth:+,.0f} MiB. Runs of one sweep share a process (Hydra's basic launcher), so a later run starts
from the earlier runs' peak.

{memory}

## The exact commands

```bash
{commands}
```
"""


if __name__ == "__main__":
    sys.stdout.write(main(Path(sys.argv[1])))
