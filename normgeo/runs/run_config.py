"""A resumed run is the same experiment: the first session writes ``<run_dir>/run_config.yaml``, every
checkpoint carries the same dict, and a later session is refused when its config differs from it (the
checkpoint's copy first: the weights were trained with it) in anything but what the schema says may change.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from corpus.atomic import atomic_open
from corpus.prepare import META_FILE
from corpus.refusal import Refusal
from models.hardware import default_precision
from normgeo.config.schema import TrainSchema, compiles, format_value
from normgeo.run_folder import RUN_CONFIG_FILE, RUN_INFO_FILE, RunFolder
from normgeo.runs.formats import FORMAT, FORMAT_KEY, config_as_today, flatten, schema_fields

log = logging.getLogger(__name__)

EXPORT_INFO = "normgeo_export.json"  # normgeo.export's record of where an export came from
# The file that says which command's outputs a folder holds (normgeo.paths.check_own_folder).
OUTPUT_MARKERS = {RUN_CONFIG_FILE: "a training run (train.py)", RUN_INFO_FILE: "an analysis (analyze.py)",
                  META_FILE: "prepared data (python -m corpus)", EXPORT_INFO: "an export (normgeo.export)"}
CHECKPOINT_KEY = "run_config"

class _Absent:
    """Stands for a key that one of the two configs does not have."""

    def __repr__(self) -> str:  # str() too: what a refusal prints for it
        return "<absent>"


ABSENT: Any = _Absent()

Changes = dict[str, tuple[Any, Any]]


class ResumeConfigError(Refusal, ValueError):
    """This session's config differs from the run's in a setting that changes the experiment."""

    def __init__(self, changes: Changes, source: str, hint: str | None = None) -> None:
        self.changes = changes
        self.source = source
        lines = [f"refusing to continue the run: its config ({source}) differs from this session's in:"]
        lines += [f"  {key}: {format_value(old)} → {format_value(new)}"
                  for key, (old, new) in changes.items()]
        lines.append(hint or "A resumed run must stay the same experiment. Start a new run with a different "
                             "run_name=... or seed=..., or resume with the original values.")
        super().__init__("\n".join(lines))


def resolved_run_config(cfg: TrainSchema) -> dict[str, Any]:
    """The session's config as plain values: what gets saved and compared."""
    config = dataclasses.asdict(cfg)
    trainer = config.get("trainer")
    # precision: null means "the hardware's default" (train.py); record what it means here, so that a
    # resume on hardware with another default (bf16 vs fp16 vs fp32) is seen as the change it is.
    if isinstance(trainer, dict) and "precision" in trainer and trainer["precision"] is None:
        trainer["precision"] = default_precision()
    config["compile"] = compiles(cfg)  # compile=auto: recorded as what this session decided
    config[FORMAT_KEY] = FORMAT  # the run's format (normgeo.runs.formats)
    return config


def resume_rules(kind: type) -> tuple[str, ...]:
    """The dotted keys (and everything under them) that may differ between sessions of one run, as the
    schema ``kind``'s fields say it (schema.doc's ``may_change``)."""
    allowed: list[str] = []
    for name, f in schema_fields(kind):
        may_change = f.metadata.get("may_change", False)  # True, or the keys of a node conf/ writes
        allowed += [name] if may_change is True else [f"{name}.{key}" for key in may_change or ()]
    return tuple(allowed)


# What two sessions of one run may differ in: where the run runs and how it reports, not what it computes
# (tests/test_training.py, tests/test_norm_factorial.py); declared on the keys (normgeo/config/schema.py).
ALLOWED_CHANGES: tuple[str, ...] = resume_rules(TrainSchema)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   allowed: Iterable[str] | None = None) -> Changes:
    """Every dotted key whose value differs (old, new), keys on one side only included as ABSENT, but for
    the keys that may change (``allowed``, default: the schema's); ``old`` read in today's format
    (normgeo.runs.formats.config_as_today)."""
    allowed = tuple(resume_rules(TrainSchema) if allowed is None else allowed)  # a test may give a schema
    flat_old, flat_new = config_as_today(flatten(old), flatten(new), TrainSchema)
    changes: Changes = {}
    for key in [*flat_old, *(k for k in flat_new if k not in flat_old)]:
        if any(key == a or key.startswith(f"{a}.") for a in allowed):
            continue
        before, after = flat_old.get(key, ABSENT), flat_new.get(key, ABSENT)
        # True == 1 in Python, but a flag that became a number is a change (1 vs 1.0 is not).
        if before != after or (isinstance(before, bool) != isinstance(after, bool)):
            changes[key] = (before, after)
    return changes


class DamagedRunConfig(Refusal, ValueError):
    """run_config.yaml is there but is not a run's config (not YAML text, or not a mapping)."""


def load_run_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run's recorded config; None when there is none, DamagedRunConfig when it cannot be read."""
    path = RunFolder(run_dir).run_config
    if not path.exists():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise DamagedRunConfig(f"{path} is damaged ({type(err).__name__}): expected the run's config as "
                               "YAML, as train.py writes it") from None
    if not isinstance(config, dict):
        raise DamagedRunConfig(f"{path} is damaged: expected a mapping of the run's keys, found "
                               f"{type(config).__name__}")
    return config


def record_run_config(run_dir: str | os.PathLike, config: Mapping[str, Any]) -> bool:
    """Write run_config.yaml unless it holds a run's config (the first session's is never replaced); a damaged
    one, which only a resume gets this far with (verify_run_config), is rewritten from ``config``, the
    checkpoint's copy, and said. True if written."""
    try:
        if load_run_config(run_dir) is not None:
            return False
    except DamagedRunConfig as err:
        log.warning("%s; rewritten from the checkpoint's copy of the run's config", err)
    with atomic_open(RunFolder(run_dir).run_config, "w", encoding="utf-8") as handle:
        yaml.safe_dump(dict(config), handle, sort_keys=False, allow_unicode=True)
    return True


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's contents without reading its tensors (mmap: a 12 GB file costs little) and without
    running pickled code (weights_only: a checkpoint holds tensors and plain values)."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def checkpoint_run_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The run config stored in a checkpoint, None for checkpoints written before it was stored."""
    checkpoint = read_checkpoint(path)
    return checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None


def is_rank_zero() -> bool:
    """Before Lightning sets up ranks: the launcher/torchrun/SLURM environment of this process, read now
    (Lightning's rank_zero_only.rank is read once at import, and a node's NODE_RANK is not in it)."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def verify_run_config(run_dir: str | os.PathLike, ckpt_path: str | None, current: Mapping[str, Any]) -> None:
    """Raise ResumeConfigError when this session would continue the run as another experiment: against the
    checkpoint's config, else run_config.yaml (neither: a warning); a fresh start against a run_config.yaml
    an earlier session left without a checkpoint, since that file is never replaced."""
    run_dir = Path(run_dir)
    saved_file = RunFolder(run_dir).run_config
    if ckpt_path is None:
        try:
            saved = load_run_config(run_dir)
        except DamagedRunConfig as err:  # never replaced by a fresh start: the user decides
            raise DamagedRunConfig(f"{err}; an earlier session left it without a checkpoint: delete it to "
                                   "start this run here, or start it under another run_name=...") from None
        if saved is not None and (changes := config_changes(saved, current)):
            raise ResumeConfigError(
                changes, str(saved_file),
                hint=f"An earlier session in {run_dir} left this config but no checkpoint. Start this run "
                     f"with a different run_name=... or seed=..., or delete {saved_file} to start it here.")
        return
    saved, source = checkpoint_run_config(ckpt_path), ckpt_path
    if saved is None:
        saved, source = load_run_config(run_dir), str(saved_file)
    if saved is None:
        log.warning("%s holds no run config and %s is missing (a run from before configs were recorded): "
                    "resuming without checking that the config is unchanged", ckpt_path, saved_file)
        return
    if changes := config_changes(saved, current):
        raise ResumeConfigError(changes, str(source))
