"""Issue 75, class 6: no command writes into another's folder. Each slipped through before: report's figures
into another run, evaluate's task inside a run, a run named like its data folder (the run folder and
data_root one folder). Each is now one line, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from normgeo.run_folder import RunFolder
from tests.conftest import FAST, main_exit_code, module_main, train_here

pytestmark = pytest.mark.slow

COMMON = ("max_steps=2", "checkpoint.steps=[2]", "probe.tokens=512")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("others")
    train_here(root / "a", *COMMON)
    train_here(root / "b", *COMMON)
    return root / "a", root / "b"


def test_report_does_not_draw_into_another_runs_figures(two_runs: tuple[Path, Path], capfd) -> None:
    a, b = two_runs
    figures = RunFolder(b).figures
    done = module_main(capfd, "report", a, "--out", figures)
    assert done.returncode == 2 and f"--out={figures} is inside {b.resolve()}" in done.stderr, done.stderr
    assert not figures.exists()
    assert module_main(capfd, "report", a).returncode == 0  # its own figures/ stays report's default


def test_evaluate_does_not_make_its_task_inside_a_run(two_runs: tuple[Path, Path], capfd) -> None:
    tasks = two_runs[0] / "tasks"
    done = module_main(capfd, "evaluate", "--make-task", tasks)
    assert done.returncode == 2 and f"--make-task={tasks} is inside" in done.stderr, done.stderr
    assert not tasks.exists()


def test_a_run_named_like_its_data_folder_is_refused(tmp_path: Path, capfd) -> None:
    # data_root's default is ./data: run_name=data in the working folder is the same folder, and a fresh one
    # has no marker yet to tell the two apart.
    capfd.readouterr()
    code = main_exit_code("train", [*FAST, *COMMON, f"output_root={tmp_path}",
                                    f"data_root={tmp_path / 'data'}", "run_name=data"])
    err = capfd.readouterr().err
    assert code == 2 and "would share a folder" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "data").exists()



def test_a_resume_from_another_runs_checkpoint_says_so(two_runs: tuple[Path, Path], tmp_path: Path,
                                                       capfd) -> None:
    """resume=<another run's last.ckpt> run_dir=<new> said "already finished" of a folder that held nothing,
    or started a run whose records begin mid-way without a word."""
    last, data = RunFolder(two_runs[0]).last_checkpoint, f"data_root={two_runs[0].parent / 'data'}"
    new = tmp_path / "branch"
    capfd.readouterr()
    code = main_exit_code("train", [*FAST, *COMMON, f"run_dir={new}", data, f"resume={last}"])
    out = capfd.readouterr().out
    said = f"resume={last} is another run's checkpoint at step 2, max_steps=2: nothing to train here"
    assert code == 0 and said in out, out
    assert not new.exists()
    stopped = tmp_path / "stopped"
    train_here(stopped, "max_steps=4", "checkpoint.steps=[4]", "probe.tokens=512", "stop_at_step=2")
    last = RunFolder(stopped).last_checkpoint
    done = train_here(new, "max_steps=4", "checkpoint.steps=[4]", "probe.tokens=512", f"resume={last}")
    assert f"resume={last} is another run's checkpoint: {new} continues it" in done.stdout + done.stderr
    assert RunFolder(new).summary.is_file()
