"""A SLURM launcher for Hydra sweeps whose resources follow each run's config (hydra/launcher=slurm).

hydra-submitit-launcher resolves ``hydra.launcher`` once, from the sweep's primary config, so in
``python train.py -m size=70m,1b`` every job would get the GPUs and time limit of the default size.
This subclass re-composes each run's config (as the job itself will), resolves the launcher's
resources there (``gpus_per_node: ${size.gpus}``, ``timeout_min: ${size.minutes}``), and submits one
job array per distinct set of resources. Everything else is submitit's: the pickled launcher runs the
job on the node, and the sweep waits for all results.

It lives in the ``hydra_plugins`` namespace because Hydra only instantiates launchers from there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

# Keys that configure the submitit executor itself rather than one job's sbatch options.
_EXECUTOR_INIT_KEYS = {"submitit_folder", "max_num_timeout"}


class PerRunSlurmLauncher(SlurmLauncher):
    def run_parameters(self, overrides: Sequence[str]) -> dict[str, Any]:
        """``hydra.launcher`` resolved in the config of the run with these sweep overrides."""
        assert self.hydra_context is not None and self.config is not None
        run_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        params = OmegaConf.to_container(run_config.hydra.launcher, resolve=True)
        params.pop("_target_", None)
        return params

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit  # lazily, as the parent does: plugin discovery stays fast

        assert self.config is not None and len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")

        groups: dict[str, list[int]] = {}
        run_params: list[dict[str, Any]] = []
        for position, overrides in enumerate(job_overrides):
            params = self.run_parameters(overrides)
            run_params.append(params)
            groups.setdefault(json.dumps(params, sort_keys=True, default=str), []).append(position)

        queue_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        submitted: dict[int, Any] = {}
        for positions in groups.values():
            params = run_params[positions[0]]
            executor = submitit.AutoExecutor(
                folder=params["submitit_folder"], slurm_max_num_timeout=params.get("max_num_timeout", 0)
            )
            executor.update_parameters(
                **{
                    key if key in queue_keys else f"slurm_{key}": value
                    for key, value in params.items()
                    if key not in _EXECUTOR_INIT_KEYS
                }
            )
            arguments = []
            for position in positions:
                index = initial_job_idx + position
                overrides = list(job_overrides[position])
                log.info(
                    f"\t#{index} : {' '.join(filter_overrides(overrides))}  "
                    f"[gpus/node={params.get('gpus_per_node')}, tasks/node={params.get('tasks_per_node')}, "
                    f"nodes={params.get('nodes')}, time={params.get('timeout_min')} min]"
                )
                arguments.append(
                    (overrides, "hydra.sweep.dir", index, f"job_id_for_{index}", Singleton.get_state())
                )
            for position, job in zip(
                positions, executor.map_array(self, *zip(*arguments, strict=True)), strict=True
            ):
                submitted[position] = job
        return [submitted[position].results()[0] for position in range(len(job_overrides))]
