"""normgeo: the geometry of LayerNorm and RMSNorm, from Python (docs/notebooks/quickstart.ipynb).

    import normgeo
    records = normgeo.measure(model, texts, tokenizer=tokenizer)  # analyze.py's records, as DataFrames
    run = normgeo.load_run("outputs/smoke-rms-s0")                 # a run's records and metrics

``normgeo.measure`` is the measurements' package (``normgeo.measure.pipeline``, ...) and, called, the API's
:func:`normgeo.api.measure`: here, where the API is declared, the package's module is given a class with
``__call__``, so that the package itself knows nothing of the API above it. The API is imported on first
use, so ``import normgeo`` (and every ``python -m normgeo.<tool>``) stays as light as before."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import normgeo.measure

# The API's other names -> the module that defines them, imported when a name is first used.
LAZY = {"load_checkpoint": "normgeo.api", "load_run": "normgeo.readers.frames",
        "load_sweep": "normgeo.readers.frames"}
__all__ = ["measure", *LAZY]


class MeasurePackage(ModuleType):
    """normgeo.measure: the package, callable as :func:`normgeo.api.measure`."""

    def __call__(self, model: Any, texts_or_ids: Any, **options: Any) -> Any:
        from normgeo.api import measure  # at the first call: see the module docstring

        return measure(model, texts_or_ids, **options)


sys.modules[normgeo.measure.__name__].__class__ = MeasurePackage


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'normgeo' has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *LAZY])
