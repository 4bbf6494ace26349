"""The verdict's declarations, made before the runs (``conf/compare/margins.yaml``): a margin per metric key,
the primary question, the few secondary endpoints (Holm within them only) and each test's level."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.norms import NORM_ARMS
from normgeo.runs.config import CONF_ROOT
from normgeo.verdict.metrics import INTACT, INTERVENTION, MARGIN_KEYS, METRICS, metric

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

    def margin(self, name: str) -> float:
        return self.margins[metric(name).margin_key]


def _endpoint(raw: object, where: str, path: Path) -> Endpoint:
    if not isinstance(raw, dict) or not {"arm", "other", "metric"} <= set(raw):
        raise ValueError(f"{path}: {where} needs arm, other and metric, e.g. {{arm: layer, other: rms, "
                         "metric: val_loss/tail}")
    found = Endpoint(str(raw["arm"]), str(raw["other"]), str(raw["metric"]))
    if found.metric not in METRICS:
        raise ValueError(f"{path}: {where}.metric={found.metric} is not a verdict metric (one of "
                         f"{', '.join(METRICS)})")
    for side in (found.arm, found.other):
        if side not in NORM_ARMS and side != INTACT:
            raise ValueError(f"{path}: {where}: {side} is not a norm arm (one of {', '.join(NORM_ARMS)}) or "
                             f"{INTACT}")
    if (found.other == INTACT) != found.metric.startswith(INTERVENTION):
        raise ValueError(f"{path}: {where}: other={INTACT} goes with an {INTERVENTION} metric, and only it")
    return found


def load_verdict_config(path: Path | None = None, overrides: Sequence[str] = ()) -> VerdictConfig:
    """The margins file (default ``conf/compare/margins.yaml``) with ``key=value`` margin overrides applied.
    Raises ValueError with one line naming the file or key and the fix."""
    path = Path(path or MARGINS_FILE)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read the margins file ({type(err).__name__}); give a YAML file "
                         f"like {MARGINS_FILE}") from None
    keys = set(MARGIN_KEYS)
    margins = dict(raw.get("margins") or {})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--margin {item}: write KEY=VALUE, e.g. --margin val_loss=0.01")
        margins[key.strip()] = value
    unknown = sorted(set(margins) - keys)
    if unknown:
        raise ValueError(f"margin {unknown[0]}: unknown metric key (one of {', '.join(sorted(keys))})")
    missing = sorted(keys - set(margins))
    if missing:
        raise ValueError(f"{path}: no margin for {missing[0]}; add it under margins:")
    checked = {}
    for key, value in margins.items():
        try:
            checked[key] = float(value)
        except (TypeError, ValueError):
            checked[key] = math.nan
        if not checked[key] > 0 or math.isinf(checked[key]):
            raise ValueError(f"margin {key}={value}: a margin is a positive number, e.g. {key}=0.01")
    primary = _endpoint({"arm": "layer", "other": "rms", "metric": "val_loss/tail", **(raw.get("primary") or {})},
                        "primary", path)
    listed = raw.get("secondary") or []
    if not isinstance(listed, list) or len(listed) > MOST_SECONDARY:
        raise ValueError(f"{path}: secondary: a list of at most {MOST_SECONDARY} endpoints (Holm within them)")
    secondary = tuple(_endpoint(item, f"secondary[{i}]", path) for i, item in enumerate(listed))
    repeated = [e for i, e in enumerate(secondary) if e in secondary[:i] or e == primary]
    if repeated:
        raise ValueError(f"{path}: secondary: {repeated[0].arm} vs {repeated[0].other} {repeated[0].metric} is "
                         "declared twice (or is the primary question)")
    alpha = float(raw.get("alpha", 0.05))
    if not 0 < alpha < 0.5:
        raise ValueError(f"{path}: alpha={alpha}: a level between 0 and 0.5, e.g. 0.05")
    return VerdictConfig(checked, primary, secondary, alpha)
