"""Figures to the loggers that show images: wandb (one key per figure) and TensorBoard."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from matplotlib.image import imread


def figure_key(path: Path, prefix: str = "figures") -> str:
    """``figures/<file stem>``: one key per figure, so that wandb never mixes image sizes under one key
    (it warns that they display incorrectly) and each figure gets its own panel."""
    return f"{prefix}/{path.stem}"


def log_figures(loggers: Iterable, figures: Mapping[str, Path], step: int) -> None:
    """Each figure under its key: wandb images, TensorBoard images (HWC, RGB)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            for key, path in figures.items():
                logger.log_image(key=key, images=[str(path)], step=step, caption=[path.stem])
        elif isinstance(logger, TensorBoardLogger):
            for key, path in figures.items():
                logger.experiment.add_image(key, imread(path)[..., :3], global_step=step, dataformats="HWC")
            logger.experiment.flush()
