"""How a config key is declared: its range (``Count``: int >= 1), default, ``--help`` line and resume rules
(:func:`doc`) on a dataclass field that Hydra composes with and pydantic validates (:func:`schema`). Apart
from the schema (normgeo.config.schema), so that the modules owning a part of it (the probe's,
normgeo.measure.probe_config) declare their keys without importing the whole schema."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval
from pydantic import ConfigDict

# The ranges the keys share; a float is also finite (schema(): allow_inf_nan=False).
Count = Annotated[int, Ge(1)]
Natural = Annotated[int, Ge(0)]
Seed = Annotated[int, Interval(ge=0, le=2**32 - 1)]  # numpy's and Lightning's largest seed
Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
Fraction = Annotated[float, Interval(ge=0, le=1)]


def schema(cls: type) -> type:
    """A config node: a dataclass (Hydra's structured config) that pydantic validates strictly."""
    cls.__pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)  # type: ignore[attr-defined]
    return dataclasses.dataclass(cls)


def doc(default: Any, text: str, *, may_change: bool | tuple[str, ...] = False,
        before: Any = dataclasses.MISSING) -> Any:
    """A field's default (or node class), ``--help`` line and resume rules (run_config.resume_rules and
    formats.added_keys read them):
    ``may_change`` between sessions (how the run runs and reports, not what it computes); ``before``, for a
    key added later, the value earlier runs had ({key: value} and a tuple of keys for an ``Any`` node)."""
    metadata = {"doc": text, "may_change": may_change, "before": before}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# The resume rules of a source's keys added later (an Any node: doc()'s before).
SOURCE_BEFORE = {"plain_text_extensions": [], "encoding": "utf-8"}
