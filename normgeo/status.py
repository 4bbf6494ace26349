"""Where the runs of a sweep stand: ``python -m normgeo.status outputs/`` (or one run directory).

For every run directory (one holding ``.hydra/config.yaml``) it prints the optimizer step of the newest
resumable checkpoint, the last logged training loss, the last probed step and a state:

* finished:  the checkpoint reached ``max_steps``;
* running:   SLURM says the job runs, or (no SLURM information) a file changed in the last minutes;
* preempted: asked to requeue (SLURM pending/requeued, PREEMPTED, or its summary says the latest session
  stopped to requeue) and not running now;
* stopped:   ended cleanly at ``stop_at_step`` (continue with ``resume=auto``);
* failed:    none of these: it ended before ``max_steps`` (see the job log or ``train.log``);
* diverged:  its training loss became inf/NaN (``summary.json`` says at which step); the same command
  with a lower ``optim.lr`` replaces it;
* analyzed:  not a training run but an ``analyze.py`` folder (``outputs/analyze/<model>``); its probe
  column reads ``pretrained`` for a model measured as published.

A run whose ``angles.jsonl`` is damaged (a line cut short) is still listed, its probe column reading
``damaged``; a damaged ``summary.json``, ``metrics.csv`` or config leaves what it would have said unknown
(``-``, the state ``unknown``); each file and line (or key) goes to stderr and the exit status is 1.
Two folders holding the same run (arm keys and seed, :mod:`normgeo.readers.identity`) are refused as
``normgeo.compare`` refuses them: each named, exit 2.

SLURM states come from ``squeue`` (and ``sacct`` where accounting is on) for the job ids that train.py
appends to ``slurm_jobs.tsv``; without them everything is inferred from the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from corpus.refusal import refused
from normgeo.figures.tables import print_table
from normgeo.readers.identity import DuplicateRuns, check_unique_runs
from normgeo.readers.run_states import RunStatus, find_runs, is_analysis, run_status


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


def print_status(rows: list[RunStatus]) -> None:
    header = ["RUN", "STATE", "STEP", "LOSS", "PROBE", "SLURM", "UPDATED"]
    lines = []
    for r in rows:
        step = f"{'-' if r.step is None else r.step}/{'?' if r.max_steps is None else r.max_steps}"
        if r.state == "analyzed":
            step = "-"
        slurm = "-" if r.slurm_job is None else f"{r.slurm_job} {r.slurm_state or '(gone)'}"
        loss = "-" if r.loss is None else f"{r.loss:.4f}"
        probe = "-" if r.probe_step is None else str(r.probe_step)
        lines.append([r.run, r.state, step, loss, probe, slurm, _age(r.updated_s_ago)])
    print_table(header, lines, left=("RUN", "STATE", "SLURM"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-status", description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="outputs",
                        help="a sweep folder (outputs/) or one run directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")
    parser.add_argument("--no-slurm", action="store_true", help="do not ask squeue/sacct")
    parser.add_argument(
        "--active-minutes", type=float, default=15.0,
        help="without SLURM information, a run whose files changed this recently counts as running (15)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.active_minutes < float("inf"):  # NaN fails too
        return refused(f"--active-minutes={args.active_minutes}: expected a number of minutes >= 0")
    root = Path(args.root).resolve()
    if not root.is_dir():
        return refused(f"{root} is not a directory")
    run_dirs = list(find_runs(root))
    try:  # the same rule as compare and report: two folders of one arm and seed are refused, each named
        check_unique_runs(run_dir for run_dir in run_dirs if not is_analysis(run_dir))
    except DuplicateRuns as err:
        print(err, file=sys.stderr)
        return 2
    rows = [run_status(run_dir, root, use_slurm=not args.no_slurm, active_s=args.active_minutes * 60)
            for run_dir in run_dirs]
    if not rows:
        print(f"error: no runs under {root} (a run directory holds run_config.yaml or .hydra/config.yaml)",
              file=sys.stderr)
        return 2  # compare's and report's code for the same folder
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
    else:
        print_status(rows)
    damaged = [row for row in rows if row.damaged]
    if damaged:  # every run is listed; the exit status says some could not be read whole
        for row in damaged:
            print(f"damaged {row.run}: {row.damaged}", file=sys.stderr)
        print(f"error: {len(damaged)} run(s) with damaged records (listed above); the others are shown",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
