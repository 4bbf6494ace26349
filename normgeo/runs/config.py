"""Hydra/OmegaConf glue: resolvers used by conf/, the schemas' registration and the config check that
train.py and analyze.py share."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

# conf/train: train.py's (and python -m corpus's) groups; conf/analyze: analyze.py's model presets;
# conf/shared: the probe presets both use (added by hydra_plugins/normgeo_searchpath).
CONF_ROOT = Path(__file__).resolve().parents[2] / "conf"
CONF_DIR = str(CONF_ROOT / "train")
ANALYZE_CONF_DIR = str(CONF_ROOT / "analyze")
SHARED_CONF_DIR = str(CONF_ROOT / "shared")
# Hydra exits 1 for its own config errors (unknown key, bad override syntax, missing group option) and
# for a crash of the task alike; before the config is composed it can only be the former.
CONFIG_ERROR_EXIT = 2
_composed = False


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


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda path: os.path.abspath(os.path.expanduser(str(path))))
    if not OmegaConf.has_resolver("slug"):
        OmegaConf.register_new_resolver("slug", path_slug)
    if not OmegaConf.has_resolver("model_slug"):
        OmegaConf.register_new_resolver("model_slug", slug)  # conf/analyze/analyze.yaml's output folder
    if not OmegaConf.has_resolver("normgeo_key_docs"):  # hydra.help.template: every key with its doc
        OmegaConf.register_new_resolver("normgeo_key_docs", _key_docs)
    from normgeo.runs.session import register_resolver

    register_resolver()  # normgeo_if_accepted (conf/train/train.yaml's hydra.output_subdir and train.log)


def _key_docs(schema: str) -> str:
    from normgeo.runs.schema import SCHEMAS, key_docs

    return "\n".join(key_docs(SCHEMAS[schema][0])).replace("$", "$$")  # the help template is a string.Template


def task_config(root: DictConfig) -> DictConfig:
    """The config the task function will get: Hydra's full config without its ``hydra`` node."""
    task = copy.deepcopy(root)
    with read_write(task), open_dict(task):
        task.pop("hydra", None)
    return task


def check_config(schema: str, cfg: DictConfig) -> None:
    """normgeo.runs.schema's value checks for ``schema`` (train | analyze); raises schema.ConfigError."""
    from normgeo.runs.schema import SCHEMAS

    SCHEMAS[schema][1](cfg)


class ConfigCheck(Callback):
    """Hydra callback (conf/*/*.yaml hydra.callbacks): refuse impossible values right after composition,
    before Hydra creates the output directory or writes anything (exit 2, one line naming the key)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _composed
        _composed = True
        from normgeo.runs.schema import ConfigError

        try:
            check_config(self.schema, task_config(config))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _composed
        _composed = True  # each job is checked on its own (the task function; normgeo_if_accepted)


def config_errors_exit_2(hydra_main: Callable[[], Any]) -> Callable[[], Any]:
    """``hydra_main`` (a @hydra.main function called without arguments), with Hydra's own config errors
    exiting 2 like every other refused input instead of Hydra's 1."""

    def main() -> Any:
        try:
            return hydra_main()
        except SystemExit as done:
            if done.code == 1 and not _composed:
                raise SystemExit(CONFIG_ERROR_EXIT) from None
            raise

    main.__doc__ = hydra_main.__doc__
    return main


register_resolvers()
from normgeo.runs.schema import register as _register_schemas  # noqa: E402  (needs the resolvers above)

_register_schemas()
