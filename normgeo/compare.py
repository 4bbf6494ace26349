"""The arms side by side: ``python -m normgeo.compare outputs/`` (a sweep folder or run directories).

Reads every run's ``angles.jsonl``, logged metrics and config and writes to ``--out`` (default
``<folder>/compare``) the tidy tables (``angles``, ``metrics``: parquet and csv), ``summary.csv``/``.md`` (per
arm and seed), the figures (per-layer overlays of the arms over steps, ``loss``, the norm factorial:
:mod:`normgeo.figures.norm_figures`; others plug in with :func:`normgeo.figures.arm_overlay.register_figure`)
and the verdict (``verdict.md``/``.csv``/figure and ``val_curve_diff``: :mod:`normgeo.verdict`): the arms
paired by seed, the declared primary question and secondary endpoints tested for a difference and for
equivalence within their margins. docs/compare.md says what each file holds and how to read it.

Margins: ``conf/compare/margins.yaml`` (the primary question and the secondary endpoints are declared there
too); ``--margins FILE`` reads another file, ``--margin val_loss=0.01`` overrides one key (repeatable). A bad
margin is one line on stderr and exit status 2, nothing written.

A ``placement=post`` run's arm is its norm + ``+post`` (``layer+post``).

A run with a damaged records file (a line of ``angles.jsonl`` cut short, ...) is left out: it is listed on
stderr with the file and line, the other runs are compared and written, and the exit status is 1
(2: no readable run, nothing written).

Two folders holding the same run (arm keys and seed: a backup copy, two sweeps under one folder) are refused
before anything is read: each folder on a line of stderr, exit status 2 (:mod:`normgeo.readers.identity`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from corpus.refusal import Refusal, refused
from normgeo.figures.arm_overlay import write_comparison
from normgeo.figures.style import check_formats
from normgeo.figures.verdict import VERDICT_MD
from normgeo.paths import check_own_folder, check_writable_folder
from normgeo.readers.identity import DuplicateRuns
from normgeo.run_folder import RunFolder
from normgeo.runs.run_config import OUTPUT_MARKERS
from normgeo.signals import stop_on_signals
from normgeo.verdict.declared import load_verdict_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="a sweep folder (outputs/) or run directories")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: <first path>/compare)"
    )
    parser.add_argument("--formats", default="png,pdf", help="figure formats, comma-separated (png,pdf)")
    parser.add_argument("--refs", default=None, help="references to draw, e.g. ones (default: all)")
    parser.add_argument("--margins", type=Path, default=None,
                        help="the verdict's margins file (default: conf/compare/margins.yaml)")
    parser.add_argument("--margin", action="append", default=[], metavar="KIND=VALUE",
                        help="override one margin, e.g. --margin val_loss=0.01 (repeatable)")
    args = parser.parse_args(argv)
    stop_on_signals("during the comparison", "--out is as it was; run the same command again")
    try:
        verdict_config = load_verdict_config(args.margins, args.margin)
    except Refusal as err:
        return refused(err)
    first = args.paths[0]
    out_dir = args.out or (
        first if len(args.paths) == 1 and not RunFolder(first).angles.exists() else first.parent
    )
    out_dir = out_dir / "compare" if args.out is None else out_dir
    try:  # every option checked before anything is written
        formats = check_formats(args.formats.split(","))
        check_writable_folder(out_dir, "--out")
        check_own_folder(out_dir, "--out", OUTPUT_MARKERS, own=None, beside="compare")  # not in a run
    except ValueError as err:  # a FolderError, or check_formats' ValueError
        return refused(err)
    try:
        written, damaged = write_comparison(args.paths, out_dir, formats=formats,
                                            refs=args.refs.split(",") if args.refs else None,
                                            verdict_config=verdict_config)
    except DuplicateRuns as err:  # its message names each folder on a line and ends with the error line
        print(err, file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        return refused(err)
    except PermissionError as err:  # a folder inside out_dir, or a file in it, that this user cannot write
        return refused(f"--out={out_dir}: cannot write {err.filename} ({err.strerror}); choose another "
                       "--out=...")
    for name, paths in written.items():
        print(f"{name}: {len(paths)} file(s)")
    print(f"summary:\n{(out_dir / 'summary.md').read_text()}")
    print((out_dir / VERDICT_MD).read_text())
    print(f"written to {out_dir}")
    if damaged:  # the others are compared; the exit status says the comparison is not of every run
        for err in damaged:
            print(f"skipped {err.run_dir or err.path.parent}: {err}", file=sys.stderr)
        print(f"error: {len(damaged)} run(s) skipped for damaged records (listed above); the other runs are "
              f"compared in {out_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
