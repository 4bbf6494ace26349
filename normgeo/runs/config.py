"""Hydra/OmegaConf glue: where conf/ lives, the one name slug, the resolvers conf/ uses, the schemas'
registration (the config check itself: :mod:`normgeo.runs.checks`), and the files Hydra would write into a
job's folder, written by the entry points themselves once a start is accepted (Hydra writes none: its job
folder is the working directory, ``hydra.output_subdir`` null, conf/shared/hydra/job_logging/console.yaml)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from normgeo.runs.schema import SCHEMAS, key_docs
from normgeo.runs.schema import register as register_schemas

# conf/train: train.py's (and python -m corpus's) groups; conf/analyze: analyze.py's model presets;
# conf/shared: the probe presets both use (added by hydra_plugins/normgeo_searchpath).
CONF_ROOT = Path(__file__).resolve().parents[2] / "conf"
CONF_DIR = str(CONF_ROOT / "train")
ANALYZE_CONF_DIR = str(CONF_ROOT / "analyze")
SHARED_CONF_DIR = str(CONF_ROOT / "shared")
REPO_ROOT = CONF_ROOT.parent
# An absolute path in a generated page: a "/" not inside a word, a number or a URL ("https://"), then no space.
ABSOLUTE_PATH = re.compile(r"(?<![\w./])/(?!/)[^\s,;)'\"`]+")


def repo_relative(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with every absolute path on this machine written relative to the repository (``../shared/...``),
    so that a generated page's commands and sources run from any checkout."""

    def relative(match: re.Match[str]) -> str:
        path = match.group(0)
        top = Path("/", Path(path).parts[1]) if len(Path(path).parts) > 1 else None
        return os.path.relpath(path, root) if top is not None and top.exists() else path

    return ABSOLUTE_PATH.sub(relative, text)


def slug(name: object, empty: str = "unnamed") -> str:
    """The one file/folder-name rule for a model name, Hub id or path: a Hub id's ``/`` becomes ``--``
    (the Hub cache's convention), every run of other characters than ``A-Za-z0-9._-`` one ``-``.

    ``EleutherAI/pythia-1.4b`` -> ``EleutherAI--pythia-1.4b``; independent of the working directory.
    """
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name or "").replace("/", "--"))
    return text.strip("-.") or empty


def path_slug(value: str) -> str:
    """A readable, collision-safe folder name for a path: 'webtext-1a2b3c4d' (its slug and a hash)."""
    text = str(value)
    stem = slug(Path(text.rstrip("/*")).name, empty="root")
    return f"{stem}-{hashlib.sha256(os.path.abspath(text).encode()).hexdigest()[:8]}"


def write_hydra_files(folder: Path, config: DictConfig) -> None:
    """``<folder>/.hydra/``: the composed config, Hydra's config and the command's overrides, as Hydra would."""
    hydra_cfg = HydraConfig.get()
    target = folder / ".hydra"
    target.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", config), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                       ("overrides.yaml", OmegaConf.select(hydra_cfg, "overrides.task", default=[]))):
        OmegaConf.save(node, target / name)


def attach_log_file(path: Path) -> None:
    """Log into ``path`` as well, in Hydra's format (until :func:`close_file_logs`)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(HydraConfig.get().job_logging.formatters.simple.format))
    logging.getLogger().addHandler(handler)


def close_file_logs(folder: Path) -> None:
    """Stop logging into files under ``folder``, so that a removed folder stays removed and the next job of a
    ``-m`` sweep (same process) logs into its own."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
                handler.close()
                logger.removeHandler(handler)


def topmost_missing(path: Path) -> Path | None:
    """The topmost of ``path`` and its parents that does not exist: what ``mkdir(parents=True)`` would create
    first (None: ``path`` exists)."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_created(path: Path, created: Path | None) -> None:
    """Undo ``mkdir(parents=True)`` of ``path`` whose topmost new folder was ``created``: ``path`` removed with its
    contents, then each parent it created while empty (something else may live there by now)."""
    if created is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    folder = path.parent
    while folder == created or created in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def register_resolvers() -> None:
    for name, resolver in (("abspath", lambda path: os.path.abspath(os.path.expanduser(str(path)))),
                           ("slug", path_slug),
                           ("model_slug", slug),  # conf/analyze/analyze.yaml's output folder
                           ("normgeo_key_docs", _key_docs)):  # hydra.help.template: every key with its doc
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def _key_docs(schema: str) -> str:
    return "\n".join(key_docs(SCHEMAS[schema][0])).replace("$", "$$")  # the help template is a string.Template


register_resolvers()
register_schemas()  # conf/ uses both (the resolvers, the schemas at the head of its defaults lists) before Hydra composes
