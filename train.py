"""Train a GPT-2 arm: ``python train.py norm=rms size=1b`` (Hydra composes conf/train/train.yaml).

The LayerNorm and RMSNorm arms differ only in ``norm``: same seed, same initial non-norm weights,
same batch stream, same probe tokens and reference vectors. This file is the run's outline: compose, check
into the typed config and claim the run (normgeo.runs.start), fit and finish (callbacks.run).
"""

from __future__ import annotations

# ruff: noqa: E402  (SLURM's USR1 is handled before the slow imports, on purpose)
from normgeo.signals import BEFORE_TRAINING, OWNER, ignore_at_exit

OWNER.take_requeue()

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig  # Hydra's composed config: start_session checks it into the typed one

from callbacks.run import Run, finished
from corpus.refusal import Refusal
from normgeo.config.checks import Refused, config_errors_exit_2, refuse
from normgeo.config.compose import CONF_DIR, TRAIN_CONFIG_DIRS
from normgeo.plan import main as plan_main
from normgeo.runs.session import RunFinished
from normgeo.runs.start import start_session


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def run(composed: DictConfig) -> Refused | None:
    """compose (Hydra) -> check into the typed config and claim the run (start_session) -> fit (Run.fit) ->
    finish (Run.finish)."""
    OWNER.take_requeue()  # again: the submitit launcher unpickles run() on the node without this file's top
    try:
        start = start_session(composed)  # the config checked, the run, then the claim: nothing written before
    except RunFinished as done:
        return finished(Path(composed.run_dir), done)
    except Refusal as err:
        return refuse(composed.run_dir, err)
    session = Run(start)
    if (refused := session.fit()) is not None:
        return refused
    session.finish()
    return None


PLAN_FLAG = "plan=true"


def main() -> None:
    """python train.py <overrides> (normgeo-train); Hydra's own config errors exit 2 as well. With
    ``plan=true`` it prints the run's memory and compute plan instead (normgeo.plan: fake tensors, nothing
    trained or written)."""
    if PLAN_FLAG in sys.argv[1:]:
        sys.exit(plan_main([a for a in sys.argv[1:] if a != PLAN_FLAG]))
    # The process's signal owner (normgeo.signals) puts back a caller's handlers (a test's, a notebook's)
    # when main returns.
    with OWNER.owning(BEFORE_TRAINING):
        config_errors_exit_2(run, TRAIN_CONFIG_DIRS)()


if __name__ == "__main__":
    try:
        main()
    finally:
        ignore_at_exit()
