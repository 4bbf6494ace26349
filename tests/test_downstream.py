"""eval.json accumulates (issue 34): a second evaluation with other tasks or another --limit keeps the first
one's scores, each task carries what it was measured at, and a damaged file is named before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from normgeo.readers.downstream import downstream_scores, merged_eval, read_eval
from normgeo.run_folder import EVAL_FILE

FIRST = {"step": 100, "checkpoint": "a/step-100.ckpt", "limit": None, "lm_eval_version": "0.4.13"}
SECOND = {"step": 200, "checkpoint": "a/step-200.ckpt", "limit": 50, "lm_eval_version": "0.4.13"}


def test_a_new_evaluation_replaces_only_the_tasks_it_measured(tmp_path: Path) -> None:
    first = merged_eval(
        {}, FIRST, {"lambada": {"acc": 0.3, "examples": 500}, "piqa": {"acc": 0.6, "examples": 800}}
    )
    second = merged_eval(first, SECOND, {"piqa": {"acc": 0.62, "examples": 50}, "arc_easy": {"acc": 0.4}})
    assert sorted(second["tasks"]) == ["arc_easy", "lambada", "piqa"]
    assert second["tasks"]["lambada"] == {"acc": 0.3, "examples": 500, **FIRST}  # kept as measured
    assert second["tasks"]["piqa"] == {"acc": 0.62, "examples": 50, **SECOND}  # replaced, with its --limit
    assert {k: second[k] for k in SECOND} == SECOND  # the top level: the latest evaluation
    (tmp_path / EVAL_FILE).write_text(json.dumps(second))
    assert downstream_scores(tmp_path) == {"downstream/arc_easy/acc": 0.4, "downstream/lambada/acc": 0.3,
                                           "downstream/piqa/acc": 0.62,
                                           # what each task was measured at: the verdict pairs only equal ones
                                           "measured_at/arc_easy": "step 200, limit 50",
                                           "measured_at/lambada": "step 100, limit none",
                                           "measured_at/piqa": "step 200, limit 50"}


@pytest.mark.parametrize(
    "text",
    ['{"step": 3, "tasks": {"piqa": {"acc": 0.5', '["not", "a", "record"]', '{"tasks": {"piqa": 0.5}}'],
)
def test_a_damaged_eval_json_is_named_with_the_fix(tmp_path: Path, text: str) -> None:
    (tmp_path / EVAL_FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path / EVAL_FILE}: .*move it away and evaluate again"):
        read_eval(tmp_path)
    assert read_eval(tmp_path / "elsewhere") == {}
