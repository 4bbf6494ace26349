"""Writes docs/study.md (to stdout) from a finished ``docs/make_study.sh`` folder, and copies its figures.

    python docs/study_page.py outputs/study [outputs/pilot] > docs/study.md

The page stays under 150 lines: the described rows of the verdict, the per-arm geometry, every run and the
memory table go to ``docs/study_details.md``, every verdict row to ``docs/study_verdict.csv``. Every number
is read from the study's own files (``compare/``, each run's, the scripts'); the verdict's words are
``normgeo.compare``'s, taken as they are. Paths are written relative to the repository (``../shared/...``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd

from corpus.atomic import atomic_write_text
from normgeo.figures.style import norm_label
from normgeo.figures.sweep import load, markdown
from normgeo.measure.stats import mean_t_interval, seeds_for_equivalence, smallest_decidable_margin
from normgeo.paths import repo_relative
from normgeo.pilot import unigram_baseline
from normgeo.plan import compose, plan_config, seeds_report
from normgeo.readers.downstream import read_eval
from normgeo.run_folder import SUMMARY_FILE, RunFolder
from normgeo.verdict.declared import load_verdict_config
from normgeo.verdict.families import Estimate, paired_estimates
from normgeo.verdict.measures import run_measures

ROOT = Path(__file__).resolve().parent.parent
# compare's figures the page shows, copied to docs/figures/study-<name>.png
FIGURES = ("verdict", "loss", "factorial_ones", "energy", "overlay_ln1.in_ones", "val_curve_diff",
           "intervention")
PAGE_SECTIONS = ("The primary question", "Declared secondary questions")  # the rest: study_details.md
DETAILS_MD, DETAILS_CSV = "study_details.md", "study_verdict.csv"
PRIMARY_METRIC = "val_loss/tail"
PLAN_GPUS = ("H100 SXM 80 GB", "A100 80 GB")  # of normgeo.plan's GPU table


def memory_table(metrics: pd.DataFrame) -> tuple[str, float]:
    """Per run: the process's RSS now and its peak at the first probe after training began (step > 0, when the
    optimizer state exists) and at the last probe, and the peak's growth between them (MiB)."""
    lines = ["| run | probes | RSS at first trained probe (MiB) | at last probe | peak RSS at first trained "
             "probe | at last probe | peak growth |", "|---|---|---|---|---|---|---|"]
    worst = 0.0
    trained = metrics[metrics["step"] > 0]
    for run, rows in trained.groupby("run", sort=True):
        rss = rows[rows["metric"] == "mem/rss_mib"].sort_values("step")["value"]
        peak = rows[rows["metric"] == "mem/peak_rss_mib"].sort_values("step")["value"]
        if peak.empty:
            continue
        growth = float(peak.iloc[-1] - peak.iloc[0])
        worst = max(worst, growth)
        lines.append(
            f"| {run} | {len(peak)} | {rss.iloc[0]:,.0f} | {rss.iloc[-1]:,.0f} | {peak.iloc[0]:,.0f} | "
            f"{peak.iloc[-1]:,.0f} | {growth:+,.0f} |"
        )
    return "\n".join(lines), worst


def downstream_section(out: Path, summary: pd.DataFrame) -> str:
    """Per arm and task: the mean accuracy over seeds with its 95% t-interval (empty before
    export_study.sh)."""
    rows = []
    for run in summary.itertuples():
        record = read_eval(out / run.run)
        rows += [{"arm": run.arm, "seed": run.seed, "task": task,
                  "step": scores.get("step", record.get("step")), "examples": scores.get("examples"),
                  "acc": scores.get("acc")}
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


def primary_estimate(paths: list[Path]) -> Estimate | None:
    """The primary question's estimate, recomputed from the study folder (or its runs) as compare does."""
    estimates, _ = paired_estimates(run_measures(load(paths)), load_verdict_config())
    return next((e for e in estimates if e.primary and e.n >= 2), None)


def answer_text(primary: Estimate) -> str:
    """The primary question in two sentences: its outcome at the declared margin, and the margin these seeds
    can decide at the observed paired SD (with the seeds the declared margin would need)."""
    low, high = primary.ci90
    reachable = smallest_decidable_margin(primary.n, primary.sd)
    needed = seeds_for_equivalence(primary.sd, primary.margin)
    words = {
        "equivalent": f"equivalent within ±{primary.margin:g} nats",
        "different": f"different (the difference is resolved; equivalence within ±{primary.margin:g} nats "
        "is not)",
        "inconclusive": f"not decided at ±{primary.margin:g} nats (the 90% interval is wider than the "
        "margin, and no difference is resolved)",
    }[primary.outcome()]
    return (
        f"**The answer.** {norm_label(primary.arm)} − {norm_label(primary.other)}, validation loss over the "
        f"last 20% of training, {primary.n} seeds: {primary.mean:+.4f} nats, 90% interval {low:+.4f} to "
        f"{high:+.4f}: **{words}**. At the observed paired SD ({primary.sd:.4f} nats) these {primary.n} "
        f"seeds decide equivalence within ±{reachable:.3f} nats with 80% power (TOST, no true difference); "
        f"±{primary.margin:g} nats would take {needed} seeds, about {2 * needed} runs."
    )


def gpu_plan_text(sd: float, margin: float) -> str:
    """What the same decision costs at 70m and 160m on GPUs (``normgeo.plan --seeds-for``), from this study's
    paired SD: a plan, not a measurement (the SD at those sizes is not measured here)."""
    rows = []
    for experiment in ("paper_70m", "paper_160m"):
        # GPU-hours need the configured step's FLOPs: the other checkpointing choice and the probe's memory
        # (half the tracing) would change nothing here.
        _, report = plan_config(compose([f"experiment={experiment}"]), both_checkpointing=False, probe=False)
        seeds = seeds_report(PRIMARY_METRIC, margin, sd, "this study", report)
        by_gpu = {row["gpu"]: row for row in seeds["gpus"]}
        rows += [{"size": seeds["size"], "GPU": gpu,
                  f"seeds per arm (±{margin:g})": seeds["seeds_equivalence"],
                  "GPU-hours per run": f"{by_gpu[gpu]['gpu_hours_per_run']:.2f}",
                  "GPU-hours, both arms": f"{by_gpu[gpu]['gpu_hours_equivalence']:,.0f}"}
                 for gpu in PLAN_GPUS]
    return f"""**On GPUs (a plan from this CPU study's paired SD, not a measurement).** The same decision at
±{margin:g} nats with `python -m normgeo.plan experiment=paper_70m --seeds-for \
{PRIMARY_METRIC}={margin:g} --sd
{sd:.4f}` (and `paper_160m`): FLOPs at the plan's MFU, probes and validation not included; the paired \
SD at those
sizes is not measured here and may differ.

{markdown(pd.DataFrame(rows))}
"""


def threads_section(out: Path, threads: Path) -> str:
    """The study's runs re-trained with 2 torch threads instead of 1 (``docs/make_threads_check.sh``): how far
    the floating-point order moves each run's primary metric and the pair's difference."""
    once = run_measures(load([out])).set_index("run")[PRIMARY_METRIC]
    again = run_measures(load([threads])).set_index("run")[PRIMARY_METRIC]
    rows, moved = [], {}
    for run, b in sorted(again.items()):
        a = once[run]
        moved[run] = b - a
        rows.append({"run": run, "1 thread": f"{a:.6f}", "2 threads": f"{b:.6f}", "moved": f"{b - a:+.1e}"})
    primary = load_verdict_config().primary
    pair = [f"study-{primary.arm}-s0", f"study-{primary.other}-s0"]
    difference = moved[pair[0]] - moved[pair[1]] if all(run in moved for run in pair) else None
    said = ("" if difference is None else f" The pair's difference ({norm_label(primary.arm)} − "
            f"{norm_label(primary.other)}, seed 0) moved by {difference:+.1e} nats.")
    return f"""## Floating-point order: two runs re-trained with 2 threads

`bash docs/make_threads_check.sh` re-trains the two runs of seed 0 of the primary question with `threads=2` \
(the
study's lanes run 1 thread each), everything else the same: the order of the floating-point sums changes, \
nothing
else. The primary metric (validation loss over the last 20% of training) of each:

{markdown(pd.DataFrame(rows))}
Largest move of a run: {max(map(abs, moved.values())):.1e} nats, against a quarter of the margin
({load_verdict_config().margins['val_loss'] / 4:.3f}).{said}
"""


def most_concurrent(runs: list[Path]) -> int:
    """The most runs that were training at once: each run from its run_config.yaml (written at its start) to
    its summary.json (written at its end)."""
    events = []
    for run in runs:
        start, end = RunFolder(run).run_config, RunFolder(run).summary
        if start.is_file() and end.is_file():
            events += [(start.stat().st_mtime, 1), (end.stat().st_mtime, -1)]
    running = most = 0
    for _, change in sorted(events):
        running += change
        most = max(most, running)
    return max(most, 1)


def verdict_sections(verdict: str) -> tuple[str, str]:
    """(the page's part: the intro, the primary question and the declared secondaries; the rest: the described
    rows, per arm, unpaired runs), headings moved one level down (under "## Verdict")."""
    parts = verdict.replace("# Verdict\n", "", 1).split("\n## ")
    kept = [parts[0].strip()] + [f"### {p.strip()}" for p in parts[1:] if p.startswith(PAGE_SECTIONS)]
    rest = [f"## {p.strip()}" for p in parts[1:] if not p.startswith(PAGE_SECTIONS)]
    return "\n\n".join(kept), "\n\n".join(rest)


def main(out: Path, figures_dir: Path = ROOT / "docs/figures", pilot: Path | None = None,
         details_dir: Path = ROOT / "docs", threads: Path | None = None) -> str:
    """The page's markdown; the figures are copied into ``figures_dir``, the rest goes to ``details_dir``
    (module docstring). ``pilot``: a ``docs/make_pilot.sh`` folder whose split goes on the page; ``threads``:
    a ``docs/make_threads_check.sh`` folder (two runs re-trained with 2 threads)."""
    compare = out / "compare"
    verdict, rest = verdict_sections((compare / "verdict.md").read_text())
    summary = pd.read_csv(compare / "summary.csv")
    metrics = pd.read_parquet(compare / "metrics.parquet")
    memory, worst_growth = memory_table(metrics)
    wall_s = int((out / "wall_s.txt").read_text())
    disk = int((out / "disk_bytes.txt").read_text())
    commands = repo_relative((out / "commands.txt").read_text().strip())
    runs = sorted(p.parent for p in out.glob(f"*/{SUMMARY_FILE}"))
    run_disk = [json.loads(RunFolder(run).summary.read_text()).get("disk_bytes") or {} for run in runs]
    checkpoint_mb = sum(d.get("checkpoints", 0) for d in run_disk) / 1e6
    records_mb = sum(d.get("records", 0) for d in run_disk) / 1e6
    for name in FIGURES:
        if (compare / f"{name}.png").is_file():
            shutil.copyfile(compare / f"{name}.png", figures_dir / f"study-{name}.png")
    primary = load_verdict_config().primary
    val_loss = summary[summary["arm"].isin([primary.arm, primary.other])]["val_loss"]
    unigram = unigram_baseline(runs[0])  # every run validates on the same windows (val_seed)
    learned = (
        f"**What the models learned.** Final validation loss {val_loss.mean():.3f} nats on average over the "
        f"{len(val_loss)} runs of the primary question's arms ({val_loss.min():.3f} to {val_loss.max():.3f}),"
        f" against {unigram:.3f} for the validation text's unigram cross-entropy (the training split's token "
        f"frequencies, add-half smoothing; `corpus/unigram.py`): {unigram - val_loss.mean():.2f} nats below "
        "what the frequencies alone give."
    )
    lanes = most_concurrent(runs)
    lanes_text = ("one after another" if lanes == 1 else f"{lanes} at a time (`STUDY_JOBS={lanes}`)")
    steps = int(summary["final_step"].max())
    probe_steps = sorted(int(x) for x in metrics[metrics["metric"] == "mem/peak_rss_mib"]["step"].unique())
    trained_probes = [x for x in probe_steps if x > 0]
    every = trained_probes[1] - trained_probes[0] if len(trained_probes) > 1 else steps
    tokens = int(summary["tokens"].max())
    columns = ["arm", "seed", "final_step", "tokens", "train_loss", "val_loss", "wall_s"]
    processes = ("Runs of one sweep (`train.py -m`) share a process (Hydra's basic launcher), so a later run "
                 "starts from the earlier runs' peak." if " -m " in commands
                 else "Each run is a process of its own.")
    shutil.copyfile(compare / "verdict.csv", details_dir / DETAILS_CSV)
    atomic_write_text(details_dir / DETAILS_MD, repo_relative(f"""# The CPU study: the rest of its verdict, \
every run, memory

Generated by `python docs/study_page.py` beside [study.md](study.md), from the same study folder. Every row of
the verdict, with raw and adjusted p-values and per-seed values: [{DETAILS_CSV}]({DETAILS_CSV}).

{rest}

## Every run

{markdown(summary[columns])}

## Memory across probes

Each probe logs the process's RSS (`mem/rss_mib`) and its peak RSS (`mem/peak_rss_mib`); the step-0 probe \
comes
before the optimizer state exists. {processes}

{memory}
"""))
    estimate = primary_estimate([out])
    answer = answer_text(estimate) if estimate is not None else ""
    plan = gpu_plan_text(estimate.sd, estimate.margin) if estimate is not None else ""
    threads_text = threads_section(out, threads) if threads is not None else ""
    pilot_text = ""
    if pilot is not None and (pilot / "pilot.md").is_file():
        table = (pilot / "pilot.md").read_text().split("\n| run |")[0].split("\n", 1)[1].strip()
        pilot_text = f"## Where the variance comes from: the pilot\n\n{repo_relative(table)}\n"
    return f"""# The CPU study: LayerNorm, RMSNorm, the factorial cells and DyT, over seeds

Generated by `bash docs/make_study.sh` (then `python docs/study_page.py`) on the current code: \
{len(runs)} runs
of the `study_cpu` preset (`conf/train/experiment/study_cpu.yaml`, `conf/train/size/study_cpu.yaml`) on real
OpenWebText text (`../shared/corpora/webtext`), {steps} optimizer steps and {tokens:,} tokens each, \
probed at step 0
and every {every} steps ({len(probe_steps)} probes) on Wikipedia text (`../shared/corpora/wikipedia`), \
{lanes_text}
on one 2-core machine. The arms of one seed share every non-norm initial weight and every batch, so they are
compared seed by seed. These are small models trained briefly on a CPU: the numbers answer the question for
*this* setting; at the paper's sizes the same commands run on GPUs (`experiment=paper_70m` … `paper_1b`).
Throughput is not part of this verdict (the runs share the machine with other work); the norms' cost is
[benchmarks.md](benchmarks.md)'s (`bench/norm_cost.py`).

**Wall time** {wall_s / 60:.1f} minutes in all. **Disk** {disk / 1e9:.2f} GB for the study folder: checkpoints
{checkpoint_mb:,.0f} MB, records {records_mb:,.1f} MB. Memory: the largest growth of a run's peak RSS \
from its first
trained probe to its last is {worst_growth:+,.0f} MiB.

{answer}

{learned}

{pilot_text}
{plan}
## Verdict

{verdict}

The described rows (every other contrast and metric, no test), the per-arm geometry, every run and the memory
table: [{DETAILS_MD}]({DETAILS_MD}); every row with raw and adjusted p-values: [{DETAILS_CSV}]({DETAILS_CSV}).

![The declared questions: per-seed differences, 95% and 90% t-intervals, \
the margins](figures/study-verdict.png)

![The paired difference of the validation curves, per contrast, \
with its pointwise 95% interval](figures/study-val_curve_diff.png)

![The centering intervention over training](figures/study-intervention.png)

{threads_text}
**Which numbers are bitwise.** On one machine with the same software and thread count, a re-run of a study
pair gives identical records and losses, bit for bit (`tests/test_study.py`). Another thread count or another
CPU changes the order of floating-point sums: losses agree to a few decimals, records move more, so the \
verdict
tests continuous quantities pooled per run, over seeds.

## Loss and angles

![Train and validation loss per arm](figures/study-loss.png)

![Every arm's angle with 1 before and after the norms](figures/study-factorial_ones.png)

![Energy along 1 at the norm inputs](figures/study-energy.png)

{downstream_section(out, summary)}
## The exact commands

```bash
{commands}
```
"""


if __name__ == "__main__":
    # python docs/study_page.py STUDY [PILOT [THREADS]] (an empty PILOT: none)
    given = [Path(arg) if arg else None for arg in sys.argv[2:4]] + [None, None]
    sys.stdout.write(main(Path(sys.argv[1]), pilot=given[0], threads=given[1]))
