"""``python -m normgeo.analysis summary DIR...``: the cross-model summary (Table 1) of analyze.py outputs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from corpus.refusal import refused
from normgeo.figures.model_summary import print_summary, summarize, write_summary
from normgeo.measure.records import DamagedRecords, read_rows
from normgeo.paths import FolderError, check_own_folder
from normgeo.run_folder import NULL_FILE, RunFolder
from normgeo.runs.run_config import OUTPUT_MARKERS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normgeo.analysis",
                                     description="Cross-model summary (Table 1) of analyze.py outputs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="summary")  # named when missing
    summary_parser = commands.add_parser("summary",
                                         help="pool angles.jsonl of one or more output directories")
    summary_parser.add_argument("run_dirs", nargs="+", type=Path, help="directories holding angles.jsonl")
    summary_parser.add_argument("--out", type=Path, default=None, help="also write summary.csv/md here")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    null: list[dict] = []
    try:  # a command writes only into a folder it owns: not into a run or an analysis (issue 64)
        if args.out is not None:
            check_own_folder(args.out, "--out", OUTPUT_MARKERS, own=None, beside="summary")
        for run_dir in args.run_dirs:
            if not RunFolder(run_dir).angles.is_file():
                return refused(f"{RunFolder(run_dir).angles} not found (is {run_dir} an analyze.py output "
                               "directory?)")
            rows += read_rows(RunFolder(run_dir).angles)
            null += read_rows(RunFolder(run_dir).record(NULL_FILE))
    except (FolderError, DamagedRecords) as err:
        return refused(err)
    summary = summarize(rows, null)
    print_summary(summary)
    if args.out is not None:
        for path in write_summary(args.out, summary):
            print(path)
    return 0



if __name__ == "__main__":
    sys.exit(main())
