"""The config check: impossible values are refused right after composition, before anything is written.

train.py and analyze.py check in their task functions (normgeo.runs.start.check_start, analyze.run), first:
Hydra writes nothing into their folders by itself. A refusal prints one line naming the key and exits 2
(:data:`CONFIG_ERROR_EXIT`), as do Hydra's own config errors (:func:`config_errors_exit_2`). The checks
themselves are the schema's (:mod:`normgeo.runs.schema`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from normgeo.runs.schema import SCHEMAS

# Hydra exits 1 for its own config errors (unknown key, bad override syntax, missing group option) and
# for a crash of the task alike; before the config is composed it can only be the former.
CONFIG_ERROR_EXIT = 2
_composed = False  # set once Hydra composed a config: a SystemExit(1) after that is not a config error


def task_started() -> None:
    """Hydra composed the config and called the task function: an exit 1 from now on is the task's."""
    global _composed
    _composed = True


def check_config(schema: str, cfg: DictConfig) -> None:
    """normgeo.runs.schema's value checks for ``schema`` (train | analyze); raises schema.ConfigError."""
    SCHEMAS[schema][1](cfg)


def unquoted_non_ascii(args: Sequence[str]) -> str | None:
    """The first ``key=value`` override whose value holds non-ASCII characters outside quotes, as the line that
    says how to write it: Hydra's override grammar stops at them with a lexer error that names no fix."""
    for arg in args:
        key, sep, value = arg.partition("=")
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
        if sep and not value.isascii() and not quoted:
            return (f"{arg}: Hydra reads non-ASCII characters only inside quotes: write {key}='{value}' "
                    f"(in a shell: \"{key}='{value}'\")")
    return None


def config_errors_exit_2(hydra_main: Callable[[], Any]) -> Callable[[], Any]:
    """``hydra_main`` (a @hydra.main function called without arguments), with Hydra's own config errors
    exiting 2 like every other refused input instead of Hydra's 1."""

    def main() -> Any:
        global _composed
        _composed = False  # each call composes anew (a test or a notebook calls main more than once)
        if refusal := unquoted_non_ascii(sys.argv[1:]):
            print(f"error: {refusal}", file=sys.stderr)
            raise SystemExit(CONFIG_ERROR_EXIT)
        try:
            return hydra_main()
        except SystemExit as done:
            if done.code == 1 and not _composed:
                raise SystemExit(CONFIG_ERROR_EXIT) from None
            raise

    main.__doc__ = hydra_main.__doc__
    return main

