"""Issue 76, item 4: what changed between the formats of a run's files is translated into today's in one place
(normgeo/runs/formats.py); each translation here on a file as older code wrote it and as today's writes it.
The resume and the readers on a whole format-1 run folder: tests/test_recorded_runs.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from normgeo.readers.downstream import merged_eval
from normgeo.run_folder import RunFolder
from normgeo.runs.formats import FORMAT, FORMAT_KEY, eval_as_today, logger_nodes, metrics_as_today
from normgeo.runs.summary import read_summary, write_summary

CSV_LOGGER, TENSORBOARD = "lightning.pytorch.loggers.CSVLogger", "lightning.pytorch.loggers.TensorBoardLogger"


def test_a_logger_config_naming_the_csv_every_run_writes_adds_no_second_one(tmp_path: Path) -> None:
    nodes = {"csv": {"_target_": CSV_LOGGER, "save_dir": str(tmp_path), "name": "csv"}, "off": None,
             "tb": {"_target_": TENSORBOARD, "save_dir": str(tmp_path), "name": "tensorboard"},
             "mine": {"_target_": CSV_LOGGER, "save_dir": str(tmp_path), "name": "mine"}}
    assert logger_nodes(nodes, RunFolder(tmp_path).csv) == [nodes["tb"], nodes["mine"]]
    assert logger_nodes(None, RunFolder(tmp_path).csv) == []


def test_a_format_1_runs_train_metrics_move_to_the_step_of_their_update() -> None:
    """Format 1 logged the k-th update's loss at step k-1 (tokens_seen says k); today's logs it at k."""
    older = pd.DataFrame({"step": [0, 0, 1, 1, 2], "value": [9.0, 16.0, 8.0, 32.0, 7.5],
                          "metric": ["train/loss", "train/tokens_seen"] * 2 + ["val/loss"]})
    shifted = metrics_as_today(older, {}, tokens_per_step=16)
    assert shifted["step"].tolist() == [1, 1, 2, 2, 2]  # val/loss stays where it was measured
    assert metrics_as_today(older, {FORMAT_KEY: FORMAT}, tokens_per_step=16) is older


def test_an_older_summary_lists_none_of_its_sessions(tmp_path: Path) -> None:
    write_summary(tmp_path, {"step": 1, "sessions": 1})
    assert read_summary(tmp_path)["session_log"] == []
    assert read_summary(tmp_path / "nothing") == {}


def test_an_older_eval_json_keeps_what_each_task_was_measured_at_when_another_is_added() -> None:
    older = {"step": 3, "limit": 8, "context": 32, "tasks": {"old": {"acc": 0.5}}}
    measured = {"step": 9, "limit": None, "context": 64}
    merged = merged_eval(eval_as_today(older), measured, {"new": {"acc": 0.6}})
    assert merged["tasks"]["old"] == {"acc": 0.5, "step": 3, "limit": 8, "context": 32}
    assert merged["tasks"]["new"] == {"acc": 0.6, **measured}
    assert eval_as_today(merged) == merged  # today's: nothing to translate
