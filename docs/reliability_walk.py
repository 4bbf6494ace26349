"""A walk of bad inputs and faults over every entry point, tried as a new user would (issue 64):
``python docs/reliability_walk.py`` (``--only ID,ID`` for some cases, ``--no-write`` to leave the page).

Each case is one row of ``CASES``: the entry point, its arguments, what is wrong, the exit code a user should
get (2 for bad input; 0 for an odd-but-valid setting that must warn, 1 for a reader that skips a damaged run
and reads the others, 130 for a Ctrl-C) and a text the message must hold (the key, file or option at fault).
Every case runs as a real subprocess (``python train.py ...``, ``python -m normgeo.<command> ...``,
``python -m corpus ...``) in a folder of its own under a scratch folder, against a real tiny run, a real
two-arm sweep and real prepared data trained first (the reference folders); a case that damages a file
damages a copy in its own folder. The sha256 of every file of the reference folders and of the case's copy is
taken before and after the case. Each case is then classed by these rules, first match wins:

- damaging: a file the command does not own (the reference folders, the case's copy less the folders the
  case says the command writes there) changed, was added or removed;
- silent: the command exited 0, the case expected a refusal or a warning, and no line names the fault;
- cryptic: a traceback, an exit code other than the expected one, or a message without the case's text
  (for an expected exit 2, the last line of stderr; else anywhere in the output); a warning said twice;
- clean: otherwise.

The summary (counts per class and per entry point, the date, the commit, the table) goes into
docs/reliability.md between ``<!-- walk:start -->`` and ``<!-- walk:end -->``; the counts are printed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from normgeo.run_folder import (
    ANGLES_FILE,
    CHECKPOINTS_DIR,
    CSV_DIR,
    ELLIPSOID_FILE,
    ENERGY_FILE,
    EVAL_FILE,
    FIGURES_DIR,
    LAST_CHECKPOINT,
    METRICS_FILE,
    NULL_FILE,
    RUN_CONFIG_FILE,
    SUMMARY_FILE,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"
START, END = "<!-- walk:start -->", "<!-- walk:end -->"
CLASSES = ("clean", "cryptic", "silent", "damaging")
TIMEOUT_S = 300

# tests/conftest.py's FAST settings: every train.py case that might train trains a 2-layer d=32 model.
FAST = ["size=tiny", "size.n_embd=32", "size.n_head=2", "seq_len=64", "global_batch=8", "micro_batch=4",
        "logger=csv", "trainer=cpu", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "log_every=1", "val_every=1000", "probe.tokens=512", "optim.warmup_steps=0"]
# The reference folders: a run stopped at step 2 of 3 (a resume has work left), a finished two-arm sweep.
REF_RUN = ["max_steps=3", "checkpoint.steps=[2]", "checkpoint.last_every=0", "stop_at_step=2"]
RESUME = " ".join(REF_RUN).replace("stop_at_step=2", "stop_at_step=3")  # a resume with a step left
REF_SWEEP = ["max_steps=2", "checkpoint.steps=[1]", "checkpoint.last_every=0", "norm=layer,rms"]
# analyze.py on the reference run's checkpoint, cheap settings.
ANALYZE = ["model=checkpoint", f"model.checkpoint={{run}}/{CHECKPOINTS_DIR}/{LAST_CHECKPOINT}", "probe=pydoc",
           "probe.tokens=512", "device=cpu", "progress=false"]
# A line that says something is wrong (a silent command prints none).
SAYS = re.compile(r"error|warn|skipped|damaged|odd:|costly|refus|not |no such|already", re.I)


@dataclass(frozen=True)
class Case:
    """One row: ``entry`` is train.py, analyze.py, corpus or a normgeo module's name; ``args`` may hold
    {run}, {sweep}, {data} (the reference folders, read only), {case} (the case's folder) and {copy} (the
    case's copy of ``copy``: run, sweep or data); ``damage`` lists (op, path under {case}[, text]) applied
    to the case's folder first (op: trunc, empty, garbage, rm, write, mkdir; again: the last line appended
    again, with the regex text[0] replaced by text[1] when given; sub: the first match of text[0] in the file
    replaced by text[1]); ``owns``: paths under {case}/copy the
    command may write (its default output folder there)."""

    id: str
    entry: str
    args: tuple[str, ...]
    wrong: str
    exit: int
    names: str
    copy: str = ""
    damage: tuple[tuple[str, ...], ...] = ()
    owns: tuple[str, ...] = ()
    interrupt: str = ""  # Ctrl-C once this text is printed (a start that must warn before it trains)


def c(id: str, entry: str, args: str, wrong: str, exit: int, names: str, **more) -> Case:
    return Case(id, entry, tuple(args.split()), wrong, exit, names, **more)


SUMMARY = f"copy/tiny-layer-s0/{SUMMARY_FILE}"
CASES: tuple[Case, ...] = (
    # train.py: values, keys, options
    c("t-lr-text", "train.py", "optim.lr=abc", "text for a float", 2, "optim.lr"),
    c("t-micro0", "train.py", "micro_batch=0", "out of range", 2, "micro_batch"),
    c("t-steps-neg", "train.py", "max_steps=-1", "out of range", 2, "max_steps"),
    c("t-lr-nan", "train.py", "optim.lr=nan", "not finite", 2, "optim.lr"),
    c("t-betas", "train.py", "optim.betas=[0.9]", "one beta", 2, "optim.betas"),
    c("t-norm-opt", "train.py", "norm=batch", "unknown group option", 2, "norm=batch"),
    c("t-size-opt", "train.py", "size=70M", "unknown option (case)", 2, "size=70M"),
    c("t-logger-opt", "train.py", "logger=[csv,nosuch]", "unknown option in a list", 2, "nosuch"),
    c("t-typo-plus", "train.py", "+max_stpes=10", "misspelled key", 2, "max_stpes"),
    c("t-typo", "train.py", "max_stpes=10", "misspelled key", 2, "max_stpes"),
    c("t-ckpt-order", "train.py", "checkpoint.steps=[50,10]", "steps out of order", 2, "checkpoint.steps"),
    c("t-devices0", "train.py", "trainer.devices=0", "Lightning refuses", 2, "devices"),
    c("t-gpu", "train.py", "trainer=gpu", "no GPU on this machine", 2, "trainer"),
    c("t-epochs-text", "train.py", "+trainer.max_epochs=abc", "wrong type for Lightning", 2,
      "trainer.max_epochs"),
    c("t-compile", "train.py", "compile=maybe", "not a bool", 2, "compile"),
    c("t-probe-huge", "train.py", "probe.tokens=100000000", "more than the probe text", 2, "probe.tokens"),
    c("t-data-local", "train.py", "data=local", "missing path", 2, "data.source.path"),
    c("t-probe-path", "train.py", "probe=local probe.path=/no/such/folder", "missing path", 2, "probe.path"),
    c("t-probe-types", "train.py", "probe=local probe.path={root}/conf/train", "yaml as text", 2,
      "probe.plain_text_extensions"),
    c("t-tokenizer", "train.py", "data.tokenizer=nosuch", "unknown encoding", 2, "data.tokenizer"),
    # train.py: names and folders
    c("t-run-name-empty", "train.py", "run_name= output_root={case}/out", "empty name", 2, "run_name"),
    c("t-run-name-up", "train.py", "run_name=.. output_root={case}/out", "a name that climbs", 2, "run_name"),
    c("t-root", "train.py", "run_dir=/", "the filesystem's root", 2, "run_dir=/"),
    c("t-under-file", "train.py", "run_dir={case}/afile/run", "a folder under a file", 2, "afile",
      damage=(("write", "afile", "x"),)),
    c("t-in-sweep", "train.py", "run_dir={sweep}", "another command's sweep folder", 2, "holds a sweep"),
    c("t-below-run", "train.py", f"run_dir={{run}}/{CHECKPOINTS_DIR}", "a folder inside a run", 2, "inside"),
    c("t-in-data", "train.py", "run_dir={data}/pydoc/run", "a folder inside prepared data", 2,
      "prepared data"),
    c("t-data-in-run", "train.py", "data_root={run}", "data prepared inside a run", 2, "inside"),
    # train.py: resume misuse and damaged run files
    c("t-resume-word", "train.py", "resume=latest", "not a resume value", 2, "resume"),
    c("t-resume-nofile", "train.py", "resume=/no/such.ckpt", "missing checkpoint", 2, "/no/such.ckpt"),
    c("t-resume-garbage", "train.py", "resume={case}/x.ckpt", "a checkpoint that is not one", 2, "x.ckpt",
      damage=(("garbage", "x.ckpt"),)),
    c("t-resume-done", "train.py", "run_dir={copy}/tiny-layer-s0 resume=auto max_steps=2 "
      "checkpoint.steps=[1] "
      "checkpoint.last_every=0", "resume of a finished run", 0, "already finished", copy="sweep"),
    c("t-resume-nockpt", "train.py", "run_dir={copy} resume=auto " + RESUME,
      "no checkpoint to resume from", 2, "no checkpoint", copy="run",
      damage=(("rm", f"copy/{CHECKPOINTS_DIR}"),)),
    c("t-fresh-over-run", "train.py", "run_dir={copy} " + " ".join(REF_RUN), "a new start over a run", 2,
      "resume", copy="run"),
    c("t-resume-config", "train.py", "run_dir={copy} resume=auto " + RESUME,
      "run_config.yaml garbage (the checkpoint holds the config: repaired, said)", 0, RUN_CONFIG_FILE,
      copy="run", damage=(("garbage", f"copy/{RUN_CONFIG_FILE}"),), owns=("copy",)),
    c("t-resume-angles", "train.py", "run_dir={copy} resume=auto " + RESUME,
      "angles.jsonl cut mid-line", 2, ANGLES_FILE, copy="run", damage=(("trunc", f"copy/{ANGLES_FILE}"),)),
    c("t-resume-again", "train.py", "run_dir={copy} resume=auto " + RESUME,
      "energy.jsonl's last record written twice", 2, ENERGY_FILE, copy="run",
      damage=(("again", f"copy/{ENERGY_FILE}"),)),
    c("t-resume-last", "train.py", "run_dir={copy} resume=auto " + RESUME, "last.ckpt truncated", 2,
      LAST_CHECKPOINT, copy="run", damage=(("trunc", f"copy/{CHECKPOINTS_DIR}/{LAST_CHECKPOINT}"),)),
    c("t-data-meta", "train.py", "data_root={copy}", "meta.json garbage", 2, "meta.json", copy="data",
      damage=(("garbage", "copy/pydoc/meta.json"),)),
    c("t-data-bin", "train.py", "data_root={copy}", "train.bin truncated", 2, "train.bin", copy="data",
      damage=(("trunc", "copy/pydoc/train.bin"),)),
    c("t-other-ckpt", "train.py", "run_dir={case}/new resume={run}/checkpoints/last.ckpt " + RESUME,
      "another run's checkpoint", 0, "another run's checkpoint"),
    c("t-finished-last-empty", "train.py", "run_dir={copy}/tiny-layer-s0 resume=auto max_steps=2 "
      "checkpoint.steps=[1] checkpoint.last_every=0", "a finished run's last.ckpt empty", 0,
      "already finished", copy="sweep",
      damage=(("empty", f"copy/tiny-layer-s0/{CHECKPOINTS_DIR}/{LAST_CHECKPOINT}"),)),
    c("t-summary-list", "train.py", "run_dir={copy} resume=auto " + RESUME, "summary.json a JSON list", 0,
      SUMMARY_FILE, copy="run", damage=(("write", f"copy/{SUMMARY_FILE}", "[]\n"),), owns=("copy",)),
    c("t-proc", "train.py", "data_root=/proc/normgeo", "data_root that cannot be made", 2, "/proc/normgeo"),
    c("t-val-fraction", "train.py", "data.val_fraction=0.5", "another split than the prepared one", 2,
      "data.val_fraction"),
    c("t-run-name-data", "train.py", "run_name=data output_root={case}/o data_root={case}/o/data",
      "the run folder is data_root", 2, "would share a folder"),
    c("t-costly-steps", "train.py", "max_steps=100000", "500x the tiny preset's steps", 130,
      "max_steps=100000", interrupt="max_steps=100000"),
    c("t-costly-null", "train.py", "probe.null_directions=50000", "a probe of 50,000 null directions", 130,
      "probe.null_directions", interrupt="probe.null_directions"),
    c("t-costly-bootstrap", "train.py", "probe.bootstrap.replicates=100000",
      "100x the default bootstrap replicates", 130, "probe.bootstrap.replicates",
      interrupt="probe.bootstrap.replicates"),
    c("t-warmup", "train.py", "optim.warmup_steps=50 max_steps=2 probe.enabled=false", "warm-up past the end",
      0, "odd:"),
    c("t-headline", "train.py", "norm=rms size=1b", "1B model on a CPU over a small corpus", 130,
      "costly launch", interrupt="costly launch"),
    # analyze.py
    c("a-out-run", "analyze.py", "out_dir={run}", "a training run's folder", 2, "holds a training run"),
    c("a-out-below", "analyze.py", f"out_dir={{run}}/{CHECKPOINTS_DIR}", "inside a run", 2, "inside"),
    c("a-out-empty", "analyze.py", "out_dir=", "empty name", 2, "out_dir"),
    c("a-model-opt", "analyze.py", "model=nosuch", "unknown group option", 2, "model=nosuch"),
    c("a-ckpt-text", "analyze.py", "model.checkpoint={root}/README.md", "not a checkpoint", 2,
      "model.checkpoint"),
    c("a-ckpt-empty", "analyze.py", "model.checkpoint={case}/empty.ckpt", "an empty checkpoint", 2,
      "empty.ckpt", damage=(("empty", "empty.ckpt"),)),
    c("a-device", "analyze.py", "device=gpu0", "unknown device", 2, "device=gpu0"),
    c("a-probe-key", "analyze.py", "+probe.enabled=false", "a key analyze does not have", 2, "probe.enabled"),
    c("a-seq0", "analyze.py", "model.seq_len=0", "out of range", 2, "model.seq_len"),
    # compare
    c("c-formats", "compare", "{copy} --formats=png,xyz", "unknown figure format", 2, "xyz", copy="sweep"),
    c("c-refs", "compare", "{copy} --refs=nosuch", "unknown reference", 2, "nosuch", copy="sweep"),
    c("c-summary-cut", "compare", "{copy} --formats=png", "summary.json truncated", 1, SUMMARY_FILE,
      copy="sweep", damage=(("trunc", SUMMARY),), owns=("copy/compare",)),
    c("c-summary-empty", "compare", "{copy} --formats=png", "summary.json empty", 1, SUMMARY_FILE,
      copy="sweep", damage=(("empty", SUMMARY),), owns=("copy/compare",)),
    c("c-angles-empty", "compare", "{copy} --formats=png", "angles.jsonl empty", 1, ANGLES_FILE,
      copy="sweep", damage=(("empty", f"copy/tiny-rms-s0/{ANGLES_FILE}"),), owns=("copy/compare",)),
    c("c-metrics", "compare", "{copy} --formats=png", "metrics.csv garbage", 1, METRICS_FILE, copy="sweep",
      damage=(("garbage", f"copy/tiny-rms-s0/{CSV_DIR}/version_0/{METRICS_FILE}"),), owns=("copy/compare",)),
    c("c-config", "compare", "{copy} --formats=png", "run_config.yaml garbage", 1, RUN_CONFIG_FILE,
      copy="sweep", damage=(("garbage", f"copy/tiny-rms-s0/{RUN_CONFIG_FILE}"),), owns=("copy/compare",)),
    c("c-null-empty", "compare", "{copy} --formats=png", f"{NULL_FILE} empty (64 null directions)", 1,
      NULL_FILE, copy="sweep", damage=(("empty", f"copy/tiny-rms-s0/{NULL_FILE}"),), owns=("copy/compare",)),
    c("c-angles-again", "compare", "{copy} --formats=png", "angles.jsonl's last record written twice", 1,
      ANGLES_FILE, copy="sweep", damage=(("again", f"copy/tiny-rms-s0/{ANGLES_FILE}"),),
      owns=("copy/compare",)),
    c("c-metrics-again", "compare", "{copy} --formats=png", "metrics.csv's last row written twice", 1,
      "damaged metrics row", copy="sweep", owns=("copy/compare",),
      damage=(("again", f"copy/tiny-layer-s0/{CSV_DIR}/version_0/{METRICS_FILE}"),)),
    c("c-ellipsoid-rm", "compare", "{copy} --formats=png", f"{ELLIPSOID_FILE} deleted", 1, ELLIPSOID_FILE,
      copy="sweep", damage=(("rm", f"copy/tiny-rms-s0/{ELLIPSOID_FILE}"),), owns=("copy/compare",)),
    c("c-out-run", "compare", "{sweep} --out {run}", "a run's folder", 2, "--out"),
    c("c-out-data", "compare", "{sweep} --out {data}/pydoc", "prepared data's folder", 2, "prepared data"),
    c("c-missing", "compare", "/no/such", "missing folder", 2, "/no/such"),
    c("c-file", "compare", "{case}/afile", "a file, not a folder", 2, "afile",
      damage=(("write", "afile", "x"),)),
    c("c-empty", "compare", "{case}/empty", "an empty folder", 2, "empty", damage=(("mkdir", "empty"),)),
    c("c-margins-key", "compare", "{copy} --margins {case}/m.yaml", "misspelled margins key", 2, "secondry",
      copy="sweep", damage=(("write", "m.yaml", "secondry: []\n"),)),
    c("c-margin-value", "compare", "{copy} --margin val_loss=abc", "a margin that is not a number", 2,
      "val_loss", copy="sweep"),
    # report
    c("r-layer", "report", "{run} --layer=99 --out {case}/figs", "no such layer", 2, "--layer=99"),
    c("r-angles-cut", "report", "{copy}", "angles.jsonl cut mid-line", 2, ANGLES_FILE, copy="run",
      damage=(("trunc", f"copy/{ANGLES_FILE}"),), owns=(f"copy/{FIGURES_DIR}",)),
    c("r-null-nan", "report", "{copy}", "a NaN in null.jsonl", 2, NULL_FILE, copy="run",
      damage=(("sub", f"copy/{NULL_FILE}", '"mean_deg": ', '"mean_deg": NaN, "was": '),),
      owns=(f"copy/{FIGURES_DIR}",)),
    c("r-out-below", "report", "{run} --out {run}/checkpoints", "inside a run", 2, "inside"),
    c("r-data", "report", "{data}/pydoc --out {case}/figs", "a data folder, not a run", 2, ANGLES_FILE),
    c("r-out-other", "report", f"{{run}} --out {{sweep}}/tiny-layer-s0/{FIGURES_DIR}",
      "another run's figures", 2, "--out"),
    c("r-noargs", "report", "", "no run given", 2, "run_dirs"),
    # status
    c("s-empty", "status", "{case}/empty --no-slurm", "an empty folder", 2, "no runs under",
      damage=(("mkdir", "empty"),)),
    c("s-ckpts", "status", f"{{run}}/{CHECKPOINTS_DIR} --no-slurm", "a run's checkpoints folder", 2,
      "no runs under"),
    c("s-data", "status", "{data} --no-slurm", "a prepared-data folder", 2, "no runs under"),
    c("s-csv-rm", "status", "{copy} --no-slurm", "csv/ of a trained run deleted", 1, "metrics", copy="run",
      damage=(("rm", f"copy/{CSV_DIR}"),)),
    c("s-energy-step", "status", "{copy} --no-slurm", "a record of step 99 in a 2-step run", 1, "step 99",
      copy="sweep", damage=(("again", f"copy/tiny-layer-s0/{ENERGY_FILE}", r'"step": \d+', '"step": 99'),)),
    c("s-energy-empty", "status", "{copy} --no-slurm", f"{ENERGY_FILE} of a probed run empty", 1, ENERGY_FILE,
      copy="run", damage=(("empty", f"copy/{ENERGY_FILE}"),)),
    c("s-minutes", "status", "--active-minutes=-1 --no-slurm", "negative minutes", 2, "--active-minutes"),
    c("s-missing", "status", "/no/such --no-slurm", "missing folder", 2, "/no/such"),
    c("s-summary", "status", "{copy} --no-slurm", "summary.json truncated", 1, SUMMARY_FILE, copy="sweep",
      damage=(("trunc", SUMMARY),)),
    c("s-config", "status", "{copy} --no-slurm", "run_config.yaml empty", 1, RUN_CONFIG_FILE,
      copy="sweep", damage=(("empty", f"copy/tiny-rms-s0/{RUN_CONFIG_FILE}"),)),
    # export
    c("e-into-run", "export", "{run} --to hf --out {run}/exported", "an export inside its run", 2, "--out"),
    c("e-to", "export", "{run} --to onnx --out {case}/x", "unknown target", 2, "--to"),
    c("e-step", "export", "{run} --to hf --step 99 --out {case}/x", "a step not saved", 2, "99"),
    c("e-ckpt-cut", "export", "{copy} --to hf --checkpoint {copy}/checkpoints/last.ckpt --out {case}/x",
      "last.ckpt truncated", 2, LAST_CHECKPOINT, copy="run",
      damage=(("trunc", f"copy/{CHECKPOINTS_DIR}/{LAST_CHECKPOINT}"),)),
    c("e-as-rms", "export", "{sweep}/tiny-rms-s0 --to hf --as rms --out {case}/x", "--as rms of an RMS arm",
      2, "--as"),
    c("e-not-run", "export", "{data}/pydoc --to hf --out {case}/x", "a data folder, not a run", 2, "pydoc"),
    # evaluate
    c("v-task-in-run", "evaluate", "--make-task {run}/tasks", "a task inside a run", 2, "--make-task"),
    c("v-limit", "evaluate", "{run} --limit 0", "out of range", 2, "--limit"),
    c("v-tasks", "evaluate", "{run} --tasks ,", "no task", 2, "--tasks"),
    c("v-batch", "evaluate", "{run} --batch-size 0", "out of range", 2, "--batch-size"),
    c("v-eval-json", "evaluate", "{copy} --limit 2", "eval.json garbage", 2, EVAL_FILE, copy="run",
      damage=(("garbage", f"copy/{EVAL_FILE}"),)),
    # plan
    c("p-size", "plan", "size=70M", "unknown group option", 2, "size=70M"),
    c("p-values", "plan", "norm=layer,rms", "several values", 2, "several values"),
    c("p-key", "plan", "max_stpes=3", "misspelled key", 2, "max_stpes"),
    c("p-mfu", "plan", "plan.mfu=0", "out of range", 2, "plan.mfu"),
    c("p-seeds-for", "plan", "--seeds-for val_loss=abc", "not a number", 2, "--seeds-for"),
    # pilot
    c("pi-missing", "pilot", "/no/such", "missing folder", 2, "/no/such"),
    c("pi-empty", "pilot", "{case}/empty", "an empty folder", 2, "empty", damage=(("mkdir", "empty"),)),
    c("pi-out-run", "pilot", "{sweep} --out {run}", "a run's folder", 2, "--out"),
    # analysis
    c("an-noargs", "analysis", "", "no subcommand", 2, "summary"),
    c("an-empty", "analysis", "summary {case}/empty", "an empty folder", 2, "empty",
      damage=(("mkdir", "empty"),)),
    c("an-angles", "analysis", "summary {copy}", "angles.jsonl garbage", 2, ANGLES_FILE, copy="run",
      damage=(("garbage", f"copy/{ANGLES_FILE}"),)),
    c("an-out-run", "analysis", "summary {run} --out {sweep}/tiny-layer-s0", "a run's folder", 2, "--out"),
    # corpus
    c("d-opt", "corpus", "data=nosuch", "unknown group option", 2, "data=nosuch"),
    c("d-local", "corpus", "data=local", "missing path", 2, "data.source.path"),
    c("d-in-run", "corpus", "data=pydoc data_root={run}", "data prepared inside a run", 2, "inside"),
    c("d-verify-bin", "corpus", "verify data=pydoc data_root={copy}", "train.bin truncated", 2, "train.bin",
      copy="data", damage=(("trunc", "copy/pydoc/train.bin"),)),
    c("d-verify-none", "corpus", "verify data=pydoc data_root={case}/nothing", "nothing prepared", 2,
      "pydoc"),
    c("d-meta", "corpus", "data=pydoc data_root={copy}", "meta.json garbage", 0, "meta.json", copy="data",
      damage=(("garbage", "copy/pydoc/meta.json"),), owns=("copy",)),
    c("d-nosuch", "corpus", "nosuch", "not an override", 2, "nosuch"),
    c("d-proc", "corpus", "data=pydoc data_root=/proc/normgeo", "data_root that cannot be made", 2,
      "/proc/normgeo"),
    c("d-tokenizer", "corpus", "data=pydoc data.tokenizer=nosuch data_root={case}/d", "unknown encoding", 2,
      "data.tokenizer"),
    c("d-val-fraction", "corpus", "data=pydoc data_root={copy} data.val_fraction=0.5",
      "another split than the prepared one: prepared again, as asked", 0, "data.val_fraction=0.05, not 0.5",
      copy="data", owns=("copy",)),
    c("d-key", "corpus", "data=pydoc data.val_fracton=0.1", "misspelled key", 2, "val_fracton"),
)


def command(case: Case) -> list[str]:
    """The command line a user would type (argument placeholders filled in later)."""
    if case.entry.endswith(".py"):
        return [sys.executable, str(ROOT / case.entry)]
    module = "corpus" if case.entry == "corpus" else f"normgeo.{case.entry}"
    return [sys.executable, "-m", module]


def needs(case: Case) -> set[str]:
    """The reference folders a case reads (built before it runs)."""
    text = " ".join(case.args)
    wanted = {name for name in ("run", "sweep", "data") if "{" + name + "}" in text}
    if case.copy:
        wanted.add(case.copy)
    if case.entry == "analyze.py":
        wanted.add("run")
    return wanted | {"data"} if case.entry == "train.py" or wanted & {"run", "sweep"} else wanted


def environment() -> dict[str, str]:
    shared = ROOT.parent / "shared"
    return {**os.environ, "PYTHONPATH": str(ROOT), "TIKTOKEN_CACHE_DIR": os.environ.get(
        "TIKTOKEN_CACHE_DIR", str(shared / "tiktoken")), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
        "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def build_references(scratch: Path, wanted: set[str]) -> dict[str, Path]:
    """Train the reference run and sweep (tiny, on the CPU) over data prepared once, as a user would."""
    refs = {name: scratch / "ref" / name for name in ("data", "run", "sweep")}
    train = [sys.executable, str(ROOT / "train.py"), *FAST, f"data_root={refs['data']}"]
    steps = []
    if "data" in wanted:
        steps.append([sys.executable, "-m", "corpus", "data=pydoc", f"data_root={refs['data']}"])
    if "run" in wanted:
        steps.append([*train, f"run_dir={refs['run']}", *REF_RUN])
    if "sweep" in wanted:
        steps.append([*train[:2], "-m", *train[2:], f"output_root={refs['sweep']}", *REF_SWEEP])
    for step in steps:
        done = subprocess.run(step, cwd=scratch, env=environment(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"setting up the walk failed: {' '.join(step)}\n{done.stderr[-3000:]}")
    return refs


def sha_tree(folder: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """The sha256 of every file under ``folder`` (hidden ones too), less those under ``skip``."""
    if not folder.exists():
        return {}
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(p == s or s in p.parents for s in skip)}


def damage(folder: Path, ops: tuple[tuple[str, ...], ...]) -> None:
    for op, rel, *text in ops:
        path = folder / rel
        if op == "trunc":  # cut mid-file (mid-line for a records file)
            data = path.read_bytes()
            path.write_bytes(data[: max(1, len(data) // 2 - 3)])
        elif op == "empty":
            path.write_bytes(b"")
        elif op == "garbage":
            path.write_bytes(b"\x00\xff garbage {[\n")
        elif op == "rm":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif op == "write":
            path.write_text(text[0])
        elif op == "mkdir":
            path.mkdir()
        elif op == "again":  # a record or row written twice, or (edited) one whose values mean nothing
            last = path.read_text().splitlines()[-1]
            path.write_text(path.read_text() + (re.sub(text[0], text[1], last, count=1) if text else last)
                            + "\n")
        elif op == "sub":
            path.write_text(re.sub(text[0], text[1], path.read_text(), count=1))


@dataclass
class Outcome:
    case: Case
    argv: list[str]
    code: int | str
    last: str
    traceback: bool
    changed: list[str]
    outcome: str
    why: str


def run_case(case: Case, scratch: Path, refs: dict[str, Path]) -> Outcome:
    folder = scratch / "cases" / case.id
    folder.mkdir(parents=True)
    copy = folder / "copy"
    if case.copy:
        shutil.copytree(refs[case.copy], copy, symlinks=True)
    damage(folder, case.damage)
    fill = {**refs, "case": folder, "copy": copy, "root": ROOT}  # refs: the run, sweep and data folders
    args = [a.format(**fill) for a in case.args]
    keys = {a.split("=")[0].lstrip("+") for a in args}
    if case.entry == "train.py":
        base = [] if case.interrupt else FAST
        if "data_root" not in keys:
            base = [*base, f"data_root={refs['data']}"]
        if not keys & {"run_dir", "run_name", "output_root"}:
            base = [*base, f"run_dir={folder / 'run'}"]
        args = [*base, *args]
    elif case.entry == "analyze.py":
        base = [a.format(**fill) for a in ANALYZE if a.split("=")[0] not in keys]
        if "out_dir" not in keys:
            base.append(f"out_dir={folder / 'out'}")
        args = [*base, *args]
    argv = [*command(case), *args]
    skip = tuple(folder / o for o in case.owns)
    watched = [*(refs[name] for name in ("run", "sweep", "data")), copy]
    before = {k: v for f in watched for k, v in sha_tree(f, skip).items()}
    code, out, err = execute(argv, folder, case.interrupt)
    after = {k: v for f in watched for k, v in sha_tree(f, skip).items()}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    traceback = "Traceback (most recent call last)" in err
    outcome, why = classify(case, code, out, err, last, traceback, changed)
    return Outcome(case, argv, code, last, traceback, changed, outcome, why)


def execute(argv: list[str], cwd: Path, interrupt: str) -> tuple[int | str, str, str]:
    """Run the command; with ``interrupt``, send SIGINT once that text is printed (as a user's Ctrl-C)."""
    process = subprocess.Popen(argv, cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: list[str] = []
    err: list[str] = []

    def pump(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            if interrupt and interrupt in line:
                process.send_signal(signal.SIGINT)

    threads = [threading.Thread(target=pump, args=(process.stdout, out)),
               threading.Thread(target=pump, args=(process.stderr, err))]
    for thread in threads:
        thread.start()
    try:
        code: int | str = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = "timeout"
    for thread in threads:
        thread.join()
    return code, "".join(out), "".join(err)


def classify(case: Case, code: int | str, out: str, err: str, last: str, traceback: bool,
             changed: list[str]) -> tuple[str, str]:
    """The rules of the module's docstring, first match wins, with the reason."""
    if changed:
        return "damaging", f"{len(changed)} file(s) it does not own changed"
    said = out + err
    if code == 0 and case.names not in said and not any(SAYS.search(line) for line in said.splitlines()):
        return "silent", "exit 0, nothing said"
    if traceback:
        return "cryptic", "a traceback"
    if code != case.exit:
        return "cryptic", f"exit {code}, expected {case.exit}"
    # A refusal's last line; a reader's whole output (it names each skipped run), or the lines a last
    # line points to ("listed above").
    where = last if case.exit == 2 and "listed above" not in last else said
    if case.names not in where:
        return "cryptic", f"the message does not name {case.names!r}"
    if case.exit in (0, 130) and said.count(case.names) > 1 and case.interrupt:
        return "cryptic", f"{case.names!r} said {said.count(case.names)} times"
    return "clean", ""


def shown(text: str, scratch: Path) -> str:
    text = text.replace(str(scratch), "<scratch>").replace(str(ROOT) + "/", "")
    text = text.replace(sys.executable, "python")
    return text.replace("|", "\\|").replace("`", "'")


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def summary(outcomes: list[Outcome], scratch: Path, seconds: float) -> str:
    total = Counter(o.outcome for o in outcomes)
    lines = [START, "",
             f"Walked {datetime.date.today().isoformat()} on commit {commit()} by "
             "`python docs/reliability_walk.py` "
             f"({len(outcomes)} cases, {seconds / 60:.1f} minutes on this machine): "
             + ", ".join(f"{total[k]} {k}" for k in CLASSES) + ".", "",
             "| entry point | cases | " + " | ".join(CLASSES) + " |",
             "| --- | --- |" + " --- |" * len(CLASSES)]
    for entry in dict.fromkeys(o.case.entry for o in outcomes):
        mine = Counter(o.outcome for o in outcomes if o.case.entry == entry)
        counts = " | ".join(str(mine[k]) for k in CLASSES)
        lines.append(f"| {entry} | {sum(mine.values())} | {counts} |")
    lines += ["", "| case | command | what is wrong | exit (expected) | outcome | last line of stderr |",
              "| --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        entry = o.case.entry if o.case.entry.endswith(".py") else (
            "python -m corpus" if o.case.entry == "corpus" else f"normgeo.{o.case.entry}")
        argv = " ".join(o.argv[2 if o.case.entry.endswith(".py") else 3:])
        if o.case.entry == "train.py":  # the FAST settings and the folders the walk adds
            argv = " ".join(a for a in argv.split() if a not in FAST and not a.startswith(
                ("data_root=<scratch>/ref", "run_dir=<scratch>/cases")) or a in o.case.args)
        outcome = o.outcome + (f" ({o.why})" if o.why else "")
        last = o.last if len(o.last) <= 300 else o.last[:297] + "..."
        lines.append(f"| {o.case.id} | `{shown(f'{entry} {argv}'.strip(), scratch)}` | {o.case.wrong} | "
                     f"{o.code} ({o.case.exit}) | {outcome} | {shown(last, scratch)} |")
    return "\n".join([*lines, "", END])


def write_page(text: str) -> None:
    page = PAGE.read_text()
    if START in page:
        page = page[: page.index(START)] + text + page[page.index(END) + len(END):]
    else:
        page = page.rstrip("\n") + "\n\n## A walk of bad inputs and faults\n\n" + text + "\n"
    PAGE.write_text(page)


def walk(cases: list[Case], scratch: Path, jobs: int = 2) -> list[Outcome]:
    """Build the reference folders the cases need, then run the cases, ``jobs`` at a time."""
    refs = build_references(scratch, set().union(*(needs(case) for case in cases)))
    before = {name: sha_tree(path) for name, path in refs.items()}
    def one(case: Case) -> Outcome:
        done = run_case(case, scratch, refs)
        print(f"{done.outcome:9} {case.id}: exit {done.code}; {done.why}; {done.last[:160]}", flush=True)
        return done

    with ThreadPoolExecutor(jobs) as pool:
        outcomes = list(pool.map(one, cases))
    for name, path in refs.items():  # the whole walk, as a last check beside each case's own
        if sha_tree(path) != before[name]:
            print(f"the reference {name} folder changed during the walk", file=sys.stderr)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case ids (default: every case)")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/reliability.md")
    options = parser.parse_args(argv)
    wanted = [c for c in CASES if not options.only or c.id in options.only.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="normgeo-walk-") as scratch:
        outcomes = walk(wanted, Path(scratch), options.jobs)
        text = summary(outcomes, Path(scratch), time.monotonic() - started)
    counts = Counter(o.outcome for o in outcomes)
    print(", ".join(f"{counts[k]} {k}" for k in CLASSES) + f" of {len(outcomes)}")
    if not options.no_write and not options.only:
        write_page(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
