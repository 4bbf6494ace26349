"""Figures: one style (:mod:`normgeo.figures.style`), drawn to files, never to a screen (in a notebook, also
shown in it: :meth:`normgeo.model_records.ModelRecords.plot`)."""

import os

import matplotlib

# Files only: Agg needs no display (clusters, CI, SSH sessions) and is chosen before any module here
# imports pyplot, so that pyplot never starts a GUI backend. A Jupyter kernel's inline backend, which
# ipykernel names in MPLBACKEND, opens no window either and shows the figures in the notebook: kept.
if "inline" not in os.environ.get("MPLBACKEND", ""):
    matplotlib.use("Agg")
