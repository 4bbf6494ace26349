"""How a refused job ends: one line naming the key and exit 2 (a :class:`corpus.refusal.Refusal`, Hydra's own
config errors, a ``_target_`` the config cannot build: :func:`build`); in a ``-m``
sweep the refused job returns :class:`Refused`, the others run, and :class:`RefusalReport` lists the refused
ones at the end. The checks themselves are the schema's (:mod:`normgeo.config.schema`)."""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus, run_job
from hydra.errors import InstantiationException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig

from corpus.refusal import Refusal
from normgeo.config.schema import SCHEMAS, ConfigError

CONFIG_ERROR_EXIT = 2


def check_config(schema: str, cfg: DictConfig) -> Any:
    """The composed ``cfg`` as ``schema``'s (train | analyze) typed config; raises schema.ConfigError."""
    return SCHEMAS[schema][1](cfg)


def unquoted_non_ascii(args: Sequence[str]) -> str | None:
    """How to quote the first override with unquoted non-ASCII: Hydra's lexer error names no fix."""
    for arg in args:
        key, sep, value = arg.partition("=")
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
        if sep and not value.isascii() and not quoted:
            return (f"{arg}: Hydra reads non-ASCII characters only inside quotes: write {key}='{value}' "
                    f"(in a shell: \"{key}='{value}'\")")
    return None


def group_options(group: str, config_dirs: Sequence[Path]) -> list[str] | None:
    """The options of group ``group`` in ``config_dirs`` and Hydra's ConfigStore; None: no such group."""
    folders = [Path(folder) / group for folder in config_dirs if (Path(folder) / group).is_dir()]
    stored = ConfigStore.instance().repo.get(group)
    if not folders and not isinstance(stored, dict):
        return None
    options = {path.stem for folder in folders for path in folder.glob("*.yaml")}
    options |= {name.removesuffix(".yaml") for name in (stored or {}) if name.endswith(".yaml")}
    return sorted(options)


def override_refusal(args: Sequence[str], command: str) -> str | None:
    """Why ``args`` are not the overrides of one configuration, in our words (Hydra's parser judges): a word
    that is not key=value, or several values (``norm=layer,rms``), which only train.py -m sweeps."""
    try:
        overrides = OverridesParser.create().parse_overrides(list(args))
    except OverrideParseException as err:
        return f"{err.override}: not an override; {command} takes key=value overrides, e.g. norm=rms"
    swept = [override.input_line for override in overrides if override.is_sweep_override()]
    if swept:
        return f"{swept[0]}: several values; {command} takes one per key (python train.py -m sweeps several)"
    return None


def unknown_group_option(args: Sequence[str], config_dirs: Sequence[Path]) -> str | None:
    """The line listing a group's options for the first override naming none (Hydra's: its search path)."""
    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in args if not arg.startswith("-")])
    except OverrideParseException:
        return None  # Hydra says what is wrong with the syntax itself
    if any(arg.startswith(("--config-dir", "-cd", "--config-path", "-cp")) for arg in args):
        return None  # another primary config directory: Hydra knows its groups
    config_dirs = list(config_dirs)
    for override in overrides:  # the user's own config folders (hydra.searchpath=[file://...]) count too
        if override.key_or_group == "hydra.searchpath":
            paths = override.value() if isinstance(override.value(), list) else [override.value()]
            if not all(str(path).startswith("file://") for path in paths):
                return None  # a package's configs (pkg://): Hydra knows its groups
            config_dirs += [Path(str(path).removeprefix("file://")) for path in paths]
    for override in overrides:
        group = override.key_or_group
        if override.is_delete() or "." in group or group.startswith("hydra/"):
            continue  # a key, or Hydra's own groups (their options come with Hydra and its plugins)
        if (known := group_options(group, config_dirs)) is None:
            continue
        value = override.value()
        chosen = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                  else value if isinstance(value, list) else [value])
        if unknown := [option for option in chosen if option is not None and str(option) not in known]:
            return f"{group}={unknown[0]}: no such option of {group}; choose from {', '.join(known)}"
    return None


def config_errors_exit_2(hydra_main: Callable[[], Any],
                         config_dirs: Sequence[Path] = ()) -> Callable[[], Any]:
    """``hydra_main`` with Hydra's config errors as one line and exit 2 (not Hydra's several lines and exit
    1), and unknown group options refused first; an exception of the task itself is a bug, raised as it is."""

    def main() -> Any:
        if refusal := unquoted_non_ascii(sys.argv[1:]) or unknown_group_option(sys.argv[1:], config_dirs):
            print(f"error: {refusal}", file=sys.stderr)
            raise SystemExit(CONFIG_ERROR_EXIT)
        before = os.environ.get(FULL_ERROR)
        os.environ[FULL_ERROR] = "1"  # Hydra raises what it would print (its text, then sys.exit(1))
        try:
            return hydra_main()
        except Exception as err:
            if raised_by_task(err):
                raise
            print(f"error: {hydra_error_line(err)}", file=sys.stderr)
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        finally:
            if before is None:
                os.environ.pop(FULL_ERROR, None)
            else:
                os.environ[FULL_ERROR] = before

    main.__doc__ = hydra_main.__doc__
    return main


FULL_ERROR = "HYDRA_FULL_ERROR"


def hydra_error_line(error: BaseException) -> str:
    """Hydra's config error in one line: its message and the first line of its cause (the value's type)."""
    cause = error.__cause__
    detail = str(cause).splitlines()[0] if cause is not None and str(cause).strip() else ""
    text = " ".join(str(error).split())
    return f"{text}: {detail}" if detail and detail not in text else text


def raised_by_task(error: BaseException | None) -> bool:
    """Whether the exception behind Hydra's exit 1 came from the task function, not Hydra's config errors
    (the same exit 1): the task's traceback passes through Hydra's ``run_job``, as Hydra's printer sees."""
    trace = getattr(error, "__traceback__", None)
    return any(frame.f_code is run_job.__code__ for frame, _ in traceback.walk_tb(trace))


# Python's words for a call whose arguments the signature does not take: a config's fault, not a bug.
SIGNATURE_ERROR = re.compile(r"\S+\(\) (got an unexpected keyword|got multiple values|missing \d+ required)")
PROJECT_PACKAGES = ("corpus", "models", "normgeo", "callbacks", "slurm")  # what refuses with a Refusal
# What a library raises for a value it refuses (by name: no Lightning import for the commands that read runs).
LIBRARY_REFUSALS = ("ValueError", "MisconfigurationException")


def config_fault(cause: BaseException | None) -> bool:
    """Whether Hydra could not build a ``_target_`` because of the config: no such target, arguments its
    signature does not take, or a library's refusal of a value (Lightning's ValueError); the project's own
    code refuses with a :class:`Refusal`, so any other exception of it is a bug."""
    if cause is None or isinstance(cause, ImportError):
        return True
    if isinstance(cause, TypeError):
        return SIGNATURE_ERROR.match(str(cause)) is not None
    frames = list(traceback.walk_tb(cause.__traceback__))
    raiser = str(frames[-1][0].f_globals.get("__name__", "")) if frames else ""
    refusal = any(kind.__name__ in LIBRARY_REFUSALS for kind in type(cause).__mro__)
    return refusal and raiser.split(".")[0] not in PROJECT_PACKAGES


def build(node: Any, key: str, **arguments: Any) -> Any:
    """Hydra's ``instantiate`` of config ``key``'s ``node``. Hydra turns whatever the target raises into one
    line without a traceback: here a :class:`Refusal` stays itself, the config's fault (:func:`config_fault`)
    is one line (ConfigError), and anything else is raised as the bug it is, with its traceback."""
    try:
        return instantiate(node, **arguments)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, Refusal) or not config_fault(cause):
            raise cause from None  # a Refusal's one line, or a bug's traceback from where it was raised
        said = str(err if cause is None or isinstance(cause, ImportError) else cause).splitlines()[0]
        raise ConfigError(f"{key}: {said.split(', set env var HYDRA_FULL_ERROR')[0]}") from err


@dataclass
class Refused:
    """What a task function returns in a ``-m`` sweep for a refused job (the sweep goes on)."""

    folder: str  # the job's run directory or output folder
    message: str


def refuse(folder: object, err: BaseException) -> Refused:
    """Exit 2 with the reason on one line; in a ``-m`` sweep return it instead, so the other jobs run."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Refused(str(folder), str(err))
    sys.exit(CONFIG_ERROR_EXIT)


class RefusalReport(Callback):
    """Hydra callback: after a ``-m`` sweep, list the refused jobs and exit 2 if any."""

    def __init__(self) -> None:
        self.refused: list[Refused] = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, Refused):
            self.refused.append(job_return.return_value)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.refused:
            lines = [f"{len(self.refused)} job(s) of the sweep were refused (the others ran):"]
            lines += [f"  {r.folder}: {r.message.splitlines()[0]}" for r in self.refused]
            print("\n".join(lines), file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT)
