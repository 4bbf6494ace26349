"""Figures: one style (:mod:`normgeo.figures.style`), drawn to files, never to a screen."""

import matplotlib

# Files only: Agg needs no display (clusters, CI, SSH sessions) and is chosen before any module here
# imports pyplot, so that pyplot never starts a GUI backend.
matplotlib.use("Agg")
