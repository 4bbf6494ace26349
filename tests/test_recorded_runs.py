"""Issue 72: runs recorded by earlier code resume on this code. ``tests/data/run_configs/`` keeps the
run_config.yaml of a smoke run recorded by today's main and one recorded before ``probe.max_doc_tokens``
existed (each file's header says by which commit and command). A key added to the schema without its resume
rule (``before=``, the value those runs had, or ``may_change``) is a change against them, named here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.runs.run_config import RUN_CONFIG_FILE, config_changes, resolved_run_config
from tests.conftest import entry_point_here

RECORDED = sorted((Path(__file__).parent / "data" / "run_configs").glob("*.yaml"))
# The recorded sessions' command (the files' headers); precision as recorded there (null: the CPU's).
SESSION = ("experiment=smoke", "max_steps=2", "threads=1", "trainer.precision=32-true")


def recorded(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_recorded_runs_are_todays_main_and_one_from_before_max_doc_tokens() -> None:
    configs = {path.stem: recorded(path) for path in RECORDED}
    assert "max_doc_tokens" not in configs["before-max-doc-tokens-6aabeb0"]["probe"]
    assert configs["main-0d301ba"]["probe"]["max_doc_tokens"] is None


@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.stem)
def test_every_key_has_a_resume_rule_for_runs_recorded_by_earlier_code(path: Path, tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose("train", overrides=[*SESSION, f"output_root={tmp_path}", "run_name=now"])
    now = resolved_run_config(check_config("train", composed))
    assert config_changes(recorded(path), now) == {}


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
    config = recorded(path)
    (run_dir / RUN_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    last_path = run_dir / "checkpoints" / "last.ckpt"
    last = torch.load(last_path, weights_only=False)
    last["run_config"] = config
    torch.save(last, last_path)
    train(run_dir, "resume=auto")
    assert torch.load(last_path, weights_only=False)["global_step"] == 2
    assert torch.get_num_threads() == 1  # threads=1 reached torch (train.train, this process)
