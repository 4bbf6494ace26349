"""Whether a train.py session may use its run directory, decided before Hydra writes anything there.

Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` and opens ``train.log`` in the run directory
before the task function runs. A launch that is then refused (the directory already holds a run, or a
resume would change the experiment) used to leave those files rewritten: ``normgeo.status`` then read
the refused session's ``max_steps``. conf/train/train.yaml routes both through the ``normgeo_if_accepted``
resolver below, which runs the same checks as train.py and sends Hydra's files nowhere when they fail.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from normgeo.run_config import ResumeConfigError, resolved_run_config, verify_run_config

LAST = "last.ckpt"  # callbacks.checkpointing.LAST (not imported: that module pulls in Lightning)


class RunDirectoryError(RuntimeError):
    """The run directory holds an earlier run and no resume was asked for."""


REFUSALS = (RunDirectoryError, ResumeConfigError)


def resume_checkpoint(run_dir: Path, resume: str | None) -> str | None:
    """The checkpoint to continue from: the newest of last.ckpt and SLURM's hpc_ckpt_*.ckpt."""
    candidates = [Path(p) for p in glob.glob(str(run_dir / "hpc_ckpt_*.ckpt"))]
    candidates += [p for p in [run_dir / "checkpoints" / LAST] if p.exists()]
    if resume is None:
        if candidates:
            raise RunDirectoryError(
                f"{run_dir} already holds a run ({candidates[0].name}). Continue it with resume=auto, "
                "or start another with a different run_name=... or seed=..."
            )
        return None
    if resume == "auto":
        return str(max(candidates, key=lambda p: p.stat().st_mtime)) if candidates else None
    if not Path(resume).is_file():
        raise RunDirectoryError(f"resume={resume!r}: no such checkpoint file (use resume=auto or a .ckpt path)")
    return resume


def session_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint this session continues from, or a refusal (REFUSALS); reads, never writes."""
    resume = cfg.resume
    if resume is None and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        resume = "auto"  # a requeued job continues its own run, whatever its command line says
    run_dir = Path(cfg.run_dir)
    ckpt_path = resume_checkpoint(run_dir, resume)
    verify_run_config(run_dir, ckpt_path, resolved_run_config(cfg))
    return ckpt_path


def if_accepted(value: Any, refused: Any = None, *, _root_: DictConfig) -> Any:
    """``value`` when this session may run in its run directory, else ``refused`` (null, /dev/null)."""
    from normgeo.config import check_config, task_config
    from normgeo.schema import ConfigError

    try:  # an impossible value (a -m sweep's job; a single run stops earlier, normgeo.config.ConfigCheck)
        check_config("train", task_config(_root_))
    except ConfigError:
        return refused
    if "run_dir" not in _root_ or not Path(str(_root_.run_dir)).is_dir():
        return value  # a new directory: nothing to protect
    try:
        session_checkpoint(task_config(_root_))
    except REFUSALS:
        return refused
    return value


def register_resolver() -> None:
    if not OmegaConf.has_resolver("normgeo_if_accepted"):
        OmegaConf.register_new_resolver("normgeo_if_accepted", if_accepted)


@dataclass
class Refused:
    """What train.py's task function returns in a multirun for a refused job (the sweep goes on)."""

    run_dir: str
    message: str


def _refusal_report_base() -> type:
    from hydra.experimental.callback import Callback

    return Callback


class RefusalReport(_refusal_report_base()):
    """Hydra callback: after a ``-m`` sweep, list the jobs train.py refused (and exit 2 if any).

    A refused job returns :class:`Refused` instead of exiting, so the other jobs of the sweep still run.
    """

    def __init__(self) -> None:
        self.refused: list[Refused] = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, Refused):
            self.refused.append(job_return.return_value)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.refused:
            return
        import sys

        lines = [f"{len(self.refused)} job(s) of the sweep were refused (the others ran):"]
        lines += [f"  {r.run_dir}: {r.message.splitlines()[0]}" for r in self.refused]
        print("\n".join(lines), file=sys.stderr, flush=True)
        raise SystemExit(2)
