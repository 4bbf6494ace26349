"""Issue 72: runs recorded by earlier code resume on this code. ``tests/data/run_configs/`` keeps the
run_config.yaml of smoke runs recorded by earlier mains (0d301ba; a791ac8, the last before the run recorded
its format) and one recorded before ``probe.max_doc_tokens`` existed (each file's header says by which
commit and command). A key added to the schema without its resume rule (``before=``, the value those runs
had, or ``may_change``) is a change against them, named here. Issue 76, item 4: a format-1 run folder, as
a791ac8's main leaves it, resumes, and ``status``, ``compare`` and ``report`` read it before and after
(normgeo.runs.formats translates it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.readers.downstream import downstream_scores
from normgeo.readers.identity import PAIRING_MAY_DIFFER
from normgeo.run_folder import RunFolder
from normgeo.runs.formats import FORMAT, FORMAT_KEY
from normgeo.runs.run_config import RUN_CONFIG_FILE, config_changes, resolved_run_config
from tests.conftest import entry_point_here, module_main

RECORDED = sorted((Path(__file__).parent / "data" / "run_configs").glob("*.yaml"))
# The recorded sessions' command (the files' headers); precision as recorded there (null: the CPU's).
SESSION = ("experiment=smoke", "max_steps=2", "threads=1", "trainer.precision=32-true")


def recorded(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_recorded_runs_are_todays_main_and_one_from_before_max_doc_tokens() -> None:
    configs = {path.stem: recorded(path) for path in RECORDED}
    assert "max_doc_tokens" not in configs["before-max-doc-tokens-6aabeb0"]["probe"]
    assert configs["main-0d301ba"]["probe"]["max_doc_tokens"] is None
    assert all(FORMAT_KEY not in config for config in configs.values())  # format 1, all of them


def todays(tmp_path: Path) -> dict:
    """The run config this code records for the recorded sessions' command."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose("train", overrides=[*SESSION, f"output_root={tmp_path}", "run_name=now"])
    return resolved_run_config(check_config("train", composed))


@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.stem)
def test_every_key_has_a_resume_rule_for_runs_recorded_by_earlier_code(path: Path, tmp_path: Path) -> None:
    assert config_changes(recorded(path), todays(tmp_path)) == {}


@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.stem)
def test_a_run_of_today_pairs_with_one_of_earlier_code_either_way(path: Path, tmp_path: Path) -> None:
    """compare pairs two arms only when their configs differ in nothing but the arm (design_difference): a
    key added since, absent from the earlier run's, is its ``before`` on whichever side it is read."""
    now, earlier = todays(tmp_path), recorded(path)
    assert config_changes(now, earlier, allowed=PAIRING_MAY_DIFFER) == {}
    assert config_changes(earlier, now, allowed=PAIRING_MAY_DIFFER) == {}


def recorded_by(run_dir: Path, config: dict) -> Path:
    """``run_dir``'s recorded config (file and last.ckpt's copy) replaced by ``config``; last.ckpt's path."""
    (run_dir / RUN_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    last_path = RunFolder(run_dir).last_checkpoint
    last = torch.load(last_path, weights_only=False)
    last["run_config"] = config
    torch.save(last, last_path)
    return last_path


def train(run_dir: Path, *overrides: str) -> None:
    """The recorded session's command (not the tests' FAST sizes: the run must be the recorded one)."""
    done = entry_point_here("train", [*SESSION, f"run_dir={run_dir}", f"data_root={run_dir.parent / 'data'}",
                                      "probe.figures=false", *overrides])
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.stem)
def test_a_run_recorded_by_earlier_code_resumes(path: Path, tmp_path: Path) -> None:
    """The recorded session's first step on this code, its recorded config (file and checkpoint) replaced by
    the earlier code's: the resume continues it to its last step."""
    run_dir = tmp_path / "run"
    train(run_dir, "stop_at_step=1")
    last_path = recorded_by(run_dir, recorded(path))
    train(run_dir, "resume=auto")
    assert torch.load(last_path, weights_only=False)["global_step"] == 2
    assert torch.get_num_threads() == 1  # threads=1 reached torch (train.train, this process)


@pytest.mark.slow
def test_a_format_1_run_resumes_and_status_compare_and_report_read_it(tmp_path: Path, capfd) -> None:
    """The first step of a run as a791ac8's main left it (format 1: its config, file and checkpoint, that
    main's), with the files older code wrote: no lock file, a summary.json without ``session_log``, an
    eval.json whose task holds what it was measured at only at the top level. The readers read it, train.py
    resumes it to its last step, and they read it again; its run config stays the first session's."""
    run_dir = tmp_path / "run"
    train(run_dir, "stop_at_step=1")
    folder = RunFolder(run_dir)
    recorded_by(run_dir, recorded(next(path for path in RECORDED if path.stem == "main-a791ac8")))
    folder.lock.unlink()
    summary = json.loads(folder.summary.read_text())
    del summary["session_log"]
    folder.summary.write_text(json.dumps(summary))
    older_eval = {"step": 1, "limit": 8, "context": 32, "tasks": {"demo": {"acc": 0.25}}}
    folder.eval.write_text(json.dumps(older_eval))

    def read(step: int, finished: bool) -> None:
        status = module_main(capfd, "status", tmp_path, "--no-slurm", "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        (row,) = [json.loads(line) for line in status.stdout.splitlines()]
        assert (row["run"], row["step"], row["damaged"]) == ("run", step, None), row
        assert (row["state"] == "finished") == finished, row  # a first step just written reads as running
        for command in (("report", run_dir), ("compare", run_dir, "--formats=png", "--out", tmp_path / "c")):
            done = module_main(capfd, *command)
            assert done.returncode == 0, done.stderr[-3000:]
        assert downstream_scores(run_dir)["measured_at/demo"] == "step 1, limit 8, context 32"

    read(1, finished=False)
    train(run_dir, "resume=auto")
    read(2, finished=True)
    summary = json.loads(folder.summary.read_text())
    assert summary["step"] == 2 and summary["sessions"] == 2
    assert [entry["steps"] for entry in summary["session_log"]] == [[1, 2]]  # the first listed none
    assert FORMAT_KEY not in yaml.safe_load(folder.run_config.read_text())  # the first session's, kept
    last = torch.load(folder.last_checkpoint, weights_only=False)
    assert last["run_config"][FORMAT_KEY] == FORMAT  # the checkpoint's copy: the session's that wrote it
