"""A train.py session's start (:func:`start_session`): :func:`check_start`, every check a user can fail
before training, writing nothing in the run directory (Hydra writes nothing there either); :func:`claim`;
:func:`open_run_files` once accepted. Until its first optimizer step a start only adds files, appends to logs,
rewrites the small files of :data:`REWRITTEN` and moves a diverged run it replaces aside (what deletes waits
for :meth:`Start.keep`), so a start that fails before it is undone (:meth:`Start.undo`) from a listing of
names, sizes and times (:class:`Found`): the directory as it was found, byte for byte.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import stat
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from lightning import Trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig  # Hydra's composed config: checked into the typed one here, and saved
from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from corpus.atomic import remove_stale_temporaries
from corpus.prepare import META_FILE
from models.hardware import missing_cuda
from normgeo.config.checks import CONFIG_ERROR_EXIT, build, check_config
from normgeo.config.compose import attach_log_file, close_file_logs, write_hydra_files
from normgeo.config.schema import ConfigError, TrainSchema, check_val_sequences, compiler_refusal
from normgeo.measure.pipeline import tiktoken_probe_ids
from normgeo.measure.run_records import read_run_records
from normgeo.paths import (
    FolderError,
    check_own_folder,
    check_writable_folder,
    remove_created,
    topmost_missing,
)
from normgeo.run_folder import HYDRA_FILES, LOCK_FILE, PLAN_FILE, RUN_CONFIG_FILE, RunFolder
from normgeo.runs.build import make_datamodule, trainer_arguments
from normgeo.runs.lock import RunLock, check_unlocked
from normgeo.runs.preflight import KeptPlan, preflight, write_kept_plan
from normgeo.runs.run_config import OUTPUT_MARKERS, is_rank_zero, resolved_run_config
from normgeo.runs.session import KEPT_ON_REPLACE, replace_diverged_run, session_checkpoint, slurm_requeued
from normgeo.signals import OWNER, UNDO, Phase

log = logging.getLogger(__name__)


# The files a start rewrites before its first optimizer step (the lock's holder, Hydra's record of the
# session; a resume repairs a damaged run config, run_config.record_run_config): their bytes are kept for an
# undo.
REWRITTEN = (LOCK_FILE, *HYDRA_FILES, PLAN_FILE, RUN_CONFIG_FILE)
# A requeued SLURM job waits this long for its lock: the old job's process may still be exiting, and
# NFS releases a dead client's locks only when its lease expires.
REQUEUE_LOCK_WAIT_S = 120.0


@dataclass
class Found:
    """What a run directory held when a start claimed it, for :func:`put_back`."""

    created: Path | None  # the topmost folder the claim created (run_dir or an ancestor); None: it existed
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # relative path -> size, mtime_ns
    dirs: set[str] = field(default_factory=set)
    rewritten: dict[str, bytes] = field(default_factory=dict)  # the bytes of the REWRITTEN files it held


def survey(run_dir: Path) -> Found:
    if (created := topmost_missing(run_dir)) is not None:
        return Found(created)
    found = Found(None)
    for folder, subdirs, names in os.walk(run_dir):
        base = Path(folder)
        found.dirs.update(str((base / name).relative_to(run_dir)) for name in subdirs)
        for name in names:
            info = (base / name).lstat()
            found.files[str((base / name).relative_to(run_dir))] = (info.st_size, info.st_mtime_ns)
    found.rewritten = {name: (run_dir / name).read_bytes() for name in REWRITTEN if name in found.files}
    return found


def put_back(run_dir: Path, found: Found, *, replaced: bool = False) -> None:
    """``run_dir`` as :func:`survey` found it: what was added removed, logs cut back to their size, the
    REWRITTEN files written back, times reset, and a diverged run moved aside (``replaced``) moved back."""
    if found.created is not None:
        remove_created(run_dir, found.created)
        return
    if not run_dir.is_dir():
        return
    aside = RunFolder(run_dir).replaced
    if replaced and aside.is_dir():  # beside the names a replacement keeps, everything is this start's
        for path in run_dir.iterdir():
            if path.name not in KEPT_ON_REPLACE:
                remove_path(path)
        for path in aside.iterdir():
            path.rename(run_dir / path.name)
        aside.rmdir()
    for folder, subdirs, names in os.walk(run_dir):
        base = Path(folder)
        for name in names:
            if str((base / name).relative_to(run_dir)) not in found.files:
                (base / name).unlink()
        for name in list(subdirs):
            if str((base / name).relative_to(run_dir)) not in found.dirs:
                subdirs.remove(name)
                remove_path(base / name)
    for name, data in found.rewritten.items():
        (run_dir / name).write_bytes(data)
    for name, (size, mtime_ns) in found.files.items():
        path = run_dir / name
        with contextlib.suppress(FileNotFoundError):
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                continue
            if info.st_size > size:  # appended to (train.log, slurm_jobs.tsv)
                os.truncate(path, size)
            if info.st_mtime_ns != mtime_ns:
                os.utime(path, ns=(time.time_ns(), mtime_ns))


def remove_path(path: Path) -> None:
    path.unlink() if path.is_symlink() or not path.is_dir() else shutil.rmtree(path)


@dataclass
class Start(contextlib.AbstractContextManager):
    """A checked start: what training needs from the checks, and (launching process) the claim."""

    config: TrainSchema  # the run's typed config: what every consumer reads
    composed: DictConfig  # Hydra's composed config it was checked from, saved as .hydra/config.yaml
    run_dir: Path
    ckpt_path: str | None
    datamodule: Any  # corpus.datamodule.TokenDataModule, prepared and loaded
    probe_ids: Any  # numpy ids of the probe text (None without a probe): tokenized once, here
    plan: KeptPlan | None = None  # the launch gate's plan, kept in the run folder once the start is accepted
    lock: RunLock | None = None
    found: Found | None = None
    replaced: bool = False  # a diverged run was moved aside for this start (RunFolder.replaced)
    kept: bool = False  # past this session's first optimizer step (or diverged): a failure keeps its files

    def replace_diverged_run(self) -> None:
        """A fresh start in the folder of a run that diverged replaces it (rank 0)."""
        if self.ckpt_path is None and is_rank_zero():
            self.replaced = replace_diverged_run(self.run_dir)

    def keep(self) -> None:
        """The start stays (its first optimizer step is done, or its run diverged): what it would have deleted
        goes now (rank 0)."""
        if self.kept:
            return
        self.kept = True
        if is_rank_zero():
            count, size = remove_stale_temporaries(self.run_dir)  # what killed sessions were writing
            if count:
                log.warning("removed %d stale temporary file(s), %s bytes, left in %s by a killed session",
                            count, f"{size:,}", self.run_dir)
            shutil.rmtree(RunFolder(self.run_dir).replaced, ignore_errors=True)

    def undo(self) -> None:
        """The run directory as this start found it (a fresh one removed); then the lock is released. A stop
        signal meanwhile (a second Ctrl-C) waits: a half-done undo would leave neither folder."""
        with OWNER.owning(Phase(UNDO, "while this start is undone")):
            if self.found is not None:
                finish_wandb_run()  # its files are in the run directory too: closed before they go
                close_file_logs(self.run_dir)
                put_back(self.run_dir, self.found, replaced=self.replaced)
                self.found = None
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# Trainer.__init__'s signature as a pydantic type: each trainer.* value against its type hint (a value of the
# wrong type, +trainer.max_epochs=abc, would otherwise be trained with); a class (a strategy): isinstance.
TRAINER_ARGUMENTS = TypeAdapter(with_config(ConfigDict(arbitrary_types_allowed=True, extra="forbid"))(
    TypedDict("TrainerArguments", {key: hint for key, hint in typing.get_type_hints(Trainer.__init__).items()
                                   if key != "return"}, total=False)))


def trainer_factory(cfg: TrainSchema, **arguments: Any) -> functools.partial:
    """``cfg.trainer``'s Trainer class with its arguments and ``arguments`` (its strategy node built)."""
    return build(cfg.trainer, "trainer", **arguments, _partial_=True, _convert_="all")


def check_trainer(cfg: TrainSchema) -> None:
    """Each trainer.* value against its type in Trainer.__init__'s signature, before the claim; the values
    are Lightning's to refuse when train.py builds the Trainer (:func:`instantiate_trainer`)."""
    try:
        TRAINER_ARGUMENTS.validate_python(trainer_factory(cfg).keywords)
    except ValidationError as err:
        # a value outside a Literal (trainer.precision=fp8): Lightning's error names the allowed ones
        if errors := [e for e in err.errors(include_url=False) if e["type"] != "literal_error"]:
            raise ConfigError(type_refusal(errors)) from None


def instantiate_trainer(cfg: TrainSchema, **attached: Any) -> Trainer:
    """The run's Trainer with ``attached`` (callbacks, loggers, plugins); what Lightning refuses on this
    machine (``trainer.devices=0`` on the CPU, an unknown precision) is one line (ConfigError)."""
    factory = trainer_factory(cfg, **trainer_arguments(cfg))  # the run's arguments win
    try:
        return factory(**attached)
    except (ValueError, TypeError, MisconfigurationException) as err:  # Lightning's refusals
        raise ConfigError(f"trainer: {str(err).splitlines()[0]}") from err


def type_refusal(errors: list) -> str:
    """pydantic's refusal of a trainer.* value in one line, naming what the Trainer takes there."""
    key, value = errors[0]["loc"][0], errors[0]["input"]
    if errors[0]["type"] == "extra_forbidden":
        return f"trainer.{key}: Lightning's Trainer takes no argument {key}"
    takes = sorted({e["msg"].removeprefix("Input should be ").split(", ")[0]
                    for e in errors if e["loc"][0] == key})
    return f"trainer.{key}={value!r}: Lightning's Trainer takes {' or '.join(takes)} there"


def check_start(composed: DictConfig) -> Start:
    """Everything a user can get wrong that is known before training, cheapest first (each a Refusal),
    the first being Hydra's ``composed`` config checked into the typed one; writes nothing in the run
    directory (data is prepared under data_root, as training would)."""
    cfg: TrainSchema = check_config("train", composed)
    # Not a config check: the same config plans (normgeo.plan) on a machine without the GPUs it will run on.
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    instead = "trainer=cpu (or trainer=ddp_cpu) on this machine"
    if refusal := missing_cuda("trainer.accelerator", accelerator, instead) or compiler_refusal(cfg):
        raise ConfigError(refusal)
    check_trainer(cfg)
    run_dir = Path(cfg.run_dir)
    check_writable_folder(run_dir, "run_dir")
    check_own_folder(run_dir, "run_dir", OUTPUT_MARKERS, own=RUN_CONFIG_FILE, beside="run")
    # The data folder by the same rule: prepared data is a folder of its own, never inside a run.
    check_own_folder(Path(cfg.data.directory), "data.directory", OUTPUT_MARKERS, own=META_FILE, beside="data")
    data_dir, run = Path(cfg.data.directory).resolve(), run_dir.resolve()
    if data_dir.is_relative_to(run) or run.is_relative_to(data_dir):  # a fresh folder has no marker yet
        raise ConfigError(f"run_dir={run_dir} and data.directory={cfg.data.directory} would share a folder: "
                         "a run and its prepared data are folders of their own; choose another run_name=... "
                         "(or data_root=...)")
    if is_rank_zero() and not slurm_requeued():
        check_unlocked(run_dir)  # before the slow checks; claim() decides
    ckpt_path = session_checkpoint(cfg)
    if ckpt_path is not None:  # a resumed run adds to its records files: a damaged one is named now
        read_run_records(run_dir, resolved_run_config(cfg))
    probe_ids = None
    if cfg.probe.enabled:  # the tokens the probe will measure: never tokenized twice
        probe_ids = tiktoken_probe_ids(build(cfg.probe.source, "probe.source"), cfg.probe)
    datamodule = make_datamodule(cfg)
    datamodule.prepare_data()  # prepares once (a file lock serializes ranks), else checks what is there
    data = datamodule.load()  # long enough for seq_len
    check_val_sequences(cfg, data.num_tokens("val"))  # now that the split's size is known
    plan = preflight(cfg)  # on a GPU, a config whose least memory cannot fit: dearest, so last
    return Start(cfg, composed, run_dir, ckpt_path, datamodule, probe_ids, plan=plan)


def claim(start: Start) -> None:
    """Take the run directory: note what it holds, create it, lock it (RunInUseError: nothing changed)."""
    run_dir = start.run_dir
    found = survey(run_dir)
    lock = RunLock(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire(wait_s=REQUEUE_LOCK_WAIT_S if slurm_requeued() else 0.0)
    except BaseException as err:
        put_back(run_dir, found)
        if isinstance(err, OSError):
            raise ConfigError(f"run_dir={run_dir}: cannot create or lock it ({err})") from err
        raise
    start.lock, start.found = lock, found


def start_session(composed: DictConfig) -> Start:
    """:func:`check_start` of Hydra's ``composed`` config, then :func:`claim` in the launching process
    (global rank 0; the processes Lightning's DDP launcher starts re-run train.py and share it)."""
    start = check_start(composed)
    if is_rank_zero():
        claim(start)
    return start


def open_run_files(start: Start) -> None:
    """What Hydra would have written into the run directory, now that the start is accepted: ``.hydra/`` and
    the launch gate's ``plan.json`` (rank 0), and ``train.log`` (every rank)."""
    if is_rank_zero():
        write_hydra_files(start.run_dir, start.composed)
        if start.plan is not None:  # every rank and every later session of the run reads it
            write_kept_plan(start.run_dir, start.plan)
    # another rank (an srun task) may not have seen rank 0's yet
    start.run_dir.mkdir(parents=True, exist_ok=True)
    attach_log_file(start.run_dir / f"{HydraConfig.get().job.name}.log")


def finish_wandb_run() -> None:
    """Close this session's wandb run. Lightning leaves it open, and in a local ``-m`` sweep (all jobs in
    one process) the next job's WandbLogger would then log into it instead of its own run."""
    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish()


class SweepFolderCheck(Callback):
    """Hydra callback (conf/train/train.yaml): a sweep's folder can be created (exit 2, one line, if not)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:  # Hydra's callback signature
        try:
            check_writable_folder(Path(str(config.hydra.sweep.dir)), "output_root")
        except FolderError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT) from None
