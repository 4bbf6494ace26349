"""Hydra/OmegaConf glue: where conf/ lives, its resolvers and schemas, and the files Hydra would write into a
job's folder, written by the entry points once a start is accepted (Hydra writes none: ``hydra.output_subdir``
null, conf/shared/hydra/job_logging/console.yaml)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from normgeo.config.schema import SCHEMAS, key_docs
from normgeo.config.schema import register as register_schemas
from normgeo.paths import REPO_ROOT, path_slug, slug
from normgeo.run_folder import HYDRA_FILES, RunFolder

# conf/shared: the probe presets train.py and analyze.py share (added by hydra_plugins/normgeo_searchpath).
CONF_ROOT = REPO_ROOT / "conf"
CONF_DIR = str(CONF_ROOT / "train")
ANALYZE_CONF_DIR = str(CONF_ROOT / "analyze")
# Where every entry point composing train.py's config lists a group's options from.
TRAIN_CONFIG_DIRS = (Path(CONF_DIR), CONF_ROOT / "shared")


def write_hydra_files(folder: Path, config: DictConfig) -> None:
    """``<folder>/.hydra/``: the composed config, Hydra's config and the overrides, as Hydra would."""
    hydra_cfg = HydraConfig.get()
    RunFolder(folder).hydra.mkdir(parents=True, exist_ok=True)
    nodes = (config, OmegaConf.create({"hydra": hydra_cfg}),
             OmegaConf.select(hydra_cfg, "overrides.task", default=[]))
    for name, node in zip(HYDRA_FILES, nodes, strict=True):
        OmegaConf.save(node, folder / name)


def attach_log_file(path: Path) -> None:
    """Log into ``path`` as well, in Hydra's format (until :func:`close_file_logs`)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(HydraConfig.get().job_logging.formatters.simple.format))
    logging.getLogger().addHandler(handler)


def close_file_logs(folder: Path) -> None:
    """Stop logging into files under ``folder``, so a removed folder stays removed and the next job of a
    ``-m`` sweep (same process) logs into its own."""
    loggers = [logging.getLogger(),
               *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
                handler.close()
                logger.removeHandler(handler)


def register_resolvers() -> None:
    for name, resolver in (("abspath", lambda path: os.path.abspath(os.path.expanduser(str(path)))),
                           ("slug", path_slug),
                           ("model_slug", slug),  # conf/analyze/analyze.yaml's output folder
                           # hydra.help.template (a string.Template, hence $$): every key with its doc
                           ("normgeo_key_docs",
                            lambda schema: "\n".join(key_docs(SCHEMAS[schema][0])).replace("$", "$$"))):
        OmegaConf.register_new_resolver(name, resolver, replace=True)


# conf/ uses the resolvers and the schemas (at the head of its defaults lists) before Hydra composes.
register_resolvers()
register_schemas()
