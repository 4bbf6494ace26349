"""The numbers docs/probe.md quotes from the factorial runs (docs/make_factorial_figures.sh writes them to
docs/factorial_numbers.md): energy along 1 and sqrt(d)/||x|| at layer 1 ln1.in, the ellipsoids' largest
condition number and normal-vs-1 angle, and each arm's final validation loss.

    python docs/factorial_numbers.py outputs/factorial > docs/factorial_numbers.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from normgeo.measure.records import read_rows
from normgeo.run_folder import ELLIPSOID_FILE, ENERGY_FILE, RunFolder

RUNS = ("layer", "layer_nobias", "rms", "rms_bias", "layer-post", "rms-post")


def main(root: Path) -> None:
    print("| run | ones_fraction mean (p50), layer 1 ln1.in, last step | sqrt(d)/‖x‖ step 0 -> last |"
          " max condition | max normal-vs-1 deg | val_loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in RUNS:
        run = RunFolder(root / f"smoke-{name}-s0")
        energy = [r for r in read_rows(run.record(ENERGY_FILE)) if r["layer"] == 1 and r["site"] == "ln1.in"]
        last = max(r["step"] for r in energy)
        at = {(r["step"], r["quantity"]): r for r in energy}
        ones, jac0, jac = at[last, "ones_fraction"], at[0, "jacobian_proxy"], at[last, "jacobian_proxy"]
        ellipsoid = read_rows(run.record(ELLIPSOID_FILE))
        condition = max(r["condition"] for r in ellipsoid)
        normal = max((r["normal_ones_deg"] or 0.0) for r in ellipsoid)
        val_loss = json.loads(run.summary.read_text())["val_loss"]
        print(f"| {name} | {ones['mean']:.3g} ({ones['p50']:.3g}) | {jac0['mean']:.3g} -> {jac['mean']:.3g} |"
              f" {condition:.4f} | {normal:.2f} | {val_loss:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
