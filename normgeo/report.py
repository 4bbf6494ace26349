"""Figures in the style of the paper from ``angles.jsonl``: ``python -m normgeo.report <run_dir> [...]``.

- ``layers_<model>_<norm>_step<k>.png``: mean +- std angle per layer before (``.in``) and after (``.out``)
  each norm, one panel per reference vector (paper Figures 3, 6-13);
- ``steps_<model>_<norm>_layer<l>.png``: angle against checkpoint step at one layer, one curve per
  reference (Figure 4);
- ``compare_<...>.png``: the LayerNorm and RMSNorm arms side by side when given runs of both;
  the figures of several runs go to ``--out``, by default the first run's ``figures/`` (said on stderr);
  with ``--out`` each run's own figures go to ``<out>/<run folder name>`` (else ``<run>/figures``);
- with several runs also ``ellipsoid.png``, ``energy.png``, ``factorial_ones.png``
  (:mod:`normgeo.figures.norm_figures`);
- ``null_layers_<model>_<norm>_<step>.png`` (from ``null.jsonl``): per layer, 1's mean angle (with its
  95% block-bootstrap interval) over the 5-95% band and median of the K random directions' mean angles,
  one panel per site kind (before the norm, after it);
- ``null_steps_<model>_<norm>_layer<l>_<site>.png``: the same at one layer against the training step.

Every records file of a run is read before the first figure (:mod:`normgeo.measure.run_records`): a damaged
line is named with its file and line and the run skipped (exit 1; 2 when no run is left), as ``compare`` does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from corpus.refusal import refused
from normgeo.figures.angle_panels import plot_compare, write_run_figures
from normgeo.figures.norm_figures import write_norm_figures
from normgeo.measure.records import DamagedRecords
from normgeo.paths import FolderError, check_own_folder, check_writable_folder
from normgeo.readers.identity import DuplicateRuns, check_unique_runs, read_run_files
from normgeo.run_folder import ANGLES_FILE, FIGURES_DIR, RunFolder
from normgeo.runs.run_config import OUTPUT_MARKERS
from normgeo.signals import stop_on_signals


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding angles.jsonl")
    parser.add_argument("--layer", default=None, help="layer for the angle-vs-step figure (default: middle)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the figures go: each run's in <out>/<run folder name>, those comparing several "
        "runs in <out> (default: <run>/figures, and the first run's figures folder)",
    )
    args = parser.parse_args(argv)
    stop_on_signals("while drawing the report", "each figure is whole or absent; run the same command again")
    layer = int(args.layer) if args.layer is not None and args.layer.lstrip("-").isdigit() else args.layer
    # Everything is read and checked before the first figure is written.
    try:  # the rule of every sweep reader: two folders of one arm and seed are refused, each named
        check_unique_runs(args.run_dirs)
    except DuplicateRuns as err:
        print(err, file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {}
    skipped: list[DamagedRecords] = []
    for run_dir in args.run_dirs:
        if not RunFolder(run_dir).angles.exists():
            return refused(f"{RunFolder(run_dir).angles} not found (is {run_dir} a normgeo run directory?)")
        try:
            # every file of the run by its one reader (compare's and status's): a damaged one skips the run
            runs[str(run_dir)] = read_run_files(run_dir).records[ANGLES_FILE]
        except DamagedRecords as err:
            print(f"skipped {run_dir}: {err}", file=sys.stderr)
            skipped.append(err)
    if not runs:
        return refused(f"no readable run among {', '.join(map(str, args.run_dirs))} (damaged records, listed "
                       "above)")
    if layer is not None:
        held = {row["layer"] for rows in runs.values() for row in rows}
        if layer not in held:
            blocks = sorted(x for x in held if isinstance(x, int))
            named = sorted(str(x) for x in held if not isinstance(x, int))
            span = f"0 to {blocks[-1]}" if blocks else "none"
            these = "these runs" if len(runs) > 1 else "this run"
            return refused(f"--layer={args.layer}: no such layer in {these} (blocks {span}"
                           f"{', or ' + ', '.join(named) if named else ''})")
    run_out = {run: (args.out / Path(run).name if args.out else RunFolder(run).figures) for run in runs}
    out_dir = args.out or RunFolder(next(iter(runs))).figures
    try:
        for folder in dict.fromkeys([out_dir, *run_out.values()]):  # --out first: the folder named
            check_writable_folder(folder, "--out")
            # Not into a run's other folders (checkpoints/, csv/), another run, nor another command's: the
            # drawn run's own figures/ (report's default) is the one folder it keeps inside a run.
            check_own_folder(folder, "--out", OUTPUT_MARKERS, own=None, own_subfolders=(FIGURES_DIR,),
                             beside="figures", owners=[Path(run) for run in runs])
    except FolderError as err:
        return refused(err)
    try:
        write_figures(runs, run_out, out_dir, layer, said_where=args.out is not None)
    except PermissionError as err:  # what os.access could not tell (a filesystem refusing even root)
        return refused(f"cannot write {err.filename} ({err.strerror}); choose another --out=...")
    if skipped:
        print(
            f"error: {len(skipped)} run(s) skipped for damaged records (listed above); the others are drawn",
            file=sys.stderr,
        )
        return 1
    return 0


def write_figures(runs: dict[str, list[dict]], run_out: dict[str, Path], out_dir: Path,
                  layer: int | str | None, said_where: bool) -> None:
    """Each run's figures into its folder of ``run_out``; with several runs, those comparing them into
    ``out_dir``."""
    for run_dir, folder in run_out.items():
        for figure in write_run_figures(run_dir, layer, folder):
            print(figure)
    if len(runs) > 1:
        # Said before they are written: by default they land inside the first run's own folder.
        where = "" if said_where else " (the first run's figures folder; --out to choose another)"
        print(f"figures comparing the {len(runs)} runs go to {out_dir}{where}", file=sys.stderr)
        for ref in ("ones", "rand_a", "rand_b"):
            print(plot_compare(runs, out_dir, ref=ref))
        # The factorial's figures, drawn as normgeo.compare draws them.
        for figure in write_norm_figures([Path(run) for run in runs], out_dir):
            print(figure)


if __name__ == "__main__":
    sys.exit(main())
