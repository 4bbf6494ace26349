"""Figures in the style of the paper from ``angles.jsonl``: ``python -m normgeo.report <run_dir> [...]``.

- ``layers_<model>_<norm>_step<k>.png``: mean +- std angle per layer before (``.in``) and after (``.out``)
  each norm, one panel per reference vector (paper Figures 3, 6-13);
- ``steps_<model>_<norm>_layer<l>.png``: angle against checkpoint step at one layer, one curve per
  reference (Figure 4);
- ``compare_<...>.png``: the LayerNorm and RMSNorm arms side by side when given runs of both;
  the figures of several runs go to ``--out``, by default the first run's ``figures/`` (said on stderr);
- with several runs also ``ellipsoid.png``, ``energy.png``, ``factorial_ones.png`` (:mod:`normgeo.figures.norm_figures`);
- ``null_layers_<model>_<norm>_<step>.png`` (from ``null.jsonl``): per layer, 1's mean angle (with its
  95% block-bootstrap interval) over the 5-95% band and median of the K random directions' mean angles,
  one panel per site kind (before the norm, after it);
- ``null_steps_<model>_<norm>_layer<l>_<site>.png``: the same at one layer against the training step.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from normgeo.figures.angles import plot_compare, write_run_figures
from normgeo.measure.records import ANGLES_FILE, read_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="normgeo-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding angles.jsonl")
    parser.add_argument("--layer", default=None, help="layer for the angle-vs-step figure (default: middle)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the figures comparing several runs go (default: <first run>/figures)")
    args = parser.parse_args(argv)
    layer = int(args.layer) if args.layer is not None and args.layer.isdigit() else args.layer
    runs = {}
    for run_dir in args.run_dirs:
        if not (run_dir / ANGLES_FILE).exists():
            print(f"error: {run_dir / ANGLES_FILE} not found (is {run_dir} a normgeo run directory?)", file=sys.stderr)
            return 2
        for figure in write_run_figures(run_dir, layer):
            print(figure)
        runs[str(run_dir)] = read_rows(run_dir / ANGLES_FILE)
    if len(runs) > 1:
        out_dir = args.out or args.run_dirs[0] / "figures"
        # Said before they are written: by default they land inside the first run's own folder.
        where = "" if args.out else " (the first run's figures folder; --out to choose another)"
        print(f"figures comparing the {len(runs)} runs go to {out_dir}{where}", file=sys.stderr)
        for ref in ("ones", "rand_a", "rand_b"):
            print(plot_compare(runs, out_dir, ref=ref))
        # The factorial's figures, drawn as normgeo.compare draws them.
        from normgeo.figures.norm_figures import write_norm_figures

        for figure in write_norm_figures(args.run_dirs, out_dir):
            print(figure)
    return 0



if __name__ == "__main__":
    sys.exit(main())
