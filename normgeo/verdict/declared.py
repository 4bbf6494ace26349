"""The verdict's declarations, made before the runs (``conf/compare/margins.yaml``): a margin per metric key,
the primary question, the few secondary endpoints (Holm within them only) and each test's level."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from corpus.refusal import Refusal
from models.norms import NORM_ARMS
from normgeo.config.compose import CONF_ROOT
from normgeo.paths import repo_relative
from normgeo.verdict.metric_table import INTACT, INTERVENTION, MARGIN_KEYS, METRICS, metric

MARGINS_FILE = CONF_ROOT / "compare" / "margins.yaml"
MOST_SECONDARY = 6  # a Holm family of 6 at 5 seeds needs |t| > 4.9; the 143 tests of issue 32 needed 11.3


@dataclass(frozen=True)
class Endpoint:
    """A declared question: ``arm`` vs ``other`` (a norm arm, or ``intact``: the arm's own model without the
    centering intervention) on ``metric``."""

    arm: str
    other: str
    metric: str


@dataclass(frozen=True)
class VerdictConfig:
    """Margins per metric key, the primary question, the secondary endpoints and each test's level."""

    margins: dict[str, float]
    primary: Endpoint = Endpoint("layer", "rms", "val_loss/tail")
    secondary: tuple[Endpoint, ...] = ()
    alpha: float = 0.05
    source: str = "conf/compare/margins.yaml"  # the file they were declared in (repo-relative): on the page

    def margin(self, name: str) -> float:
        return self.margins[metric(name).margin_key]


class MarginsError(Refusal, ValueError):
    """A margins file (or a --margin) the verdict cannot use: the file, the key and what is expected."""


TOP_KEYS = ("margins", "primary", "secondary", "alpha")
ENDPOINT_KEYS = ("arm", "other", "metric")


def _unknown_key(key: object, known: Sequence[str], where: str) -> MarginsError:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return MarginsError(f"{where}{key}: no such key ({hint}the keys are {', '.join(known)})")


def _endpoint(raw: object, where: str, path: Path) -> Endpoint:
    if not isinstance(raw, dict) or not {"arm", "other", "metric"} <= set(raw):
        raise MarginsError(f"{path}: {where} needs arm, other and metric, e.g. {{arm: layer, other: rms, "
                           "metric: val_loss/tail}")
    if unknown := [key for key in raw if key not in ENDPOINT_KEYS]:
        raise _unknown_key(unknown[0], ENDPOINT_KEYS, f"{path}: {where}.")
    found = Endpoint(str(raw["arm"]), str(raw["other"]), str(raw["metric"]))
    if found.metric not in METRICS:
        raise MarginsError(f"{path}: {where}.metric={found.metric} is not a verdict metric (one of "
                           f"{', '.join(METRICS)})")
    for side in (found.arm, found.other):
        if side not in NORM_ARMS and side != INTACT:
            raise MarginsError(f"{path}: {where}: {side} is not a norm arm (one of {', '.join(NORM_ARMS)}) "
                               f"or {INTACT}")
    if (found.other == INTACT) != found.metric.startswith(INTERVENTION):
        raise MarginsError(f"{path}: {where}: other={INTACT} goes with an {INTERVENTION} metric, and only it")
    return found


def read_margins_file(path: Path) -> dict:
    """The margins file as a mapping of TOP_KEYS only (MarginsError naming the file otherwise)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise MarginsError(f"{path}: cannot read the margins file ({type(err).__name__}); give a YAML file "
                           f"like {repo_relative(str(MARGINS_FILE))}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise MarginsError(f"{path}: expected a mapping of {', '.join(TOP_KEYS)}, not a "
                           f"{type(raw).__name__}; see {repo_relative(str(MARGINS_FILE))}")
    if unknown := [key for key in raw if key not in TOP_KEYS]:
        raise _unknown_key(unknown[0], TOP_KEYS, f"{path}: ")
    for key, kind, expected in (("margins", dict, "a mapping of metric key: margin"),
                                ("primary", dict, "a mapping of arm, other and metric"),
                                ("secondary", list, "a list of endpoints")):
        if raw.get(key) is not None and not isinstance(raw[key], kind):
            raise MarginsError(f"{path}: {key}: expected {expected}, not a {type(raw[key]).__name__}")
    return raw


def load_verdict_config(path: Path | None = None, overrides: Sequence[str] = ()) -> VerdictConfig:
    """The margins file (default ``conf/compare/margins.yaml``) with ``key=value`` margin overrides applied.
    Raises MarginsError with one line naming the file or key and the fix."""
    path = Path(path or MARGINS_FILE)
    raw = read_margins_file(path)
    keys = sorted(MARGIN_KEYS)
    margins = {key: (value, f"{path}: margins.{key}") for key, value in (raw.get("margins") or {}).items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise MarginsError(f"--margin {item}: write KEY=VALUE, e.g. --margin val_loss=0.01")
        margins[key.strip()] = (value, f"--margin {key.strip()}")
    for key, (_, where) in margins.items():
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            raise MarginsError(f"{where}: unknown metric key ({f'did you mean {close[0]}? ' if close else ''}"
                               f"one of {', '.join(keys)})")
    if missing := [key for key in keys if key not in margins]:
        raise MarginsError(f"{path}: no margin for {missing[0]}; add it under margins:")
    checked = {}
    for key, (value, where) in margins.items():
        try:
            checked[key] = float(value)
        except (TypeError, ValueError):
            checked[key] = math.nan
        if not checked[key] > 0 or math.isinf(checked[key]):
            raise MarginsError(f"{where}={value}: expected a positive number (a margin), e.g. {key}=0.01")
    declared = {"arm": "layer", "other": "rms", "metric": "val_loss/tail", **(raw.get("primary") or {})}
    primary = _endpoint(declared, "primary", path)
    listed = raw.get("secondary") or []
    if len(listed) > MOST_SECONDARY:
        raise MarginsError(f"{path}: secondary: a list of at most {MOST_SECONDARY} endpoints (Holm within "
                           "them)")
    secondary = tuple(_endpoint(item, f"secondary[{i}]", path) for i, item in enumerate(listed))
    repeated = [e for i, e in enumerate(secondary) if e in secondary[:i] or e == primary]
    if repeated:
        twice = repeated[0]
        raise MarginsError(f"{path}: secondary: {twice.arm} vs {twice.other} {twice.metric} is declared "
                           "twice (or is the primary question)")
    try:
        alpha = float(raw.get("alpha", 0.05))
    except (TypeError, ValueError):
        alpha = math.nan
    if not 0 < alpha < 0.5:
        raise MarginsError(f"{path}: alpha={raw.get('alpha')}: expected a level between 0 and 0.5, e.g. 0.05")
    return VerdictConfig(checked, primary, secondary, alpha, source=repo_relative(str(path)))
