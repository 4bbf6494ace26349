"""Issue 34: a setting that asks for a measurement the run cannot make is said
once at start and the run goes on (``normgeo.config.schema.unmeasured_values``):
DyT has no centering for the intervention to take out or put in."""

from __future__ import annotations

from pathlib import Path

import pytest

from normgeo.config.schema import unmeasured_values
from tests.conftest import train_here
from tests.test_user_faults import composed_train

LINE = "nothing measured: probe.intervention=[all]: norm=dyt has no centering"


@pytest.mark.parametrize(("overrides", "said"), [
    (["norm=dyt", "probe.intervention=[all]"], True),
    (["norm=dyt", "probe.intervention=[]"], False),
    (["norm=dyt", "probe.intervention=[all]", "probe.enabled=false"], False),
    (["norm=rms", "probe.intervention=[all]"], False),
    (["norm=layer"], False),
])
def test_intervention_scopes_on_an_arm_without_centering_are_named(overrides: list[str], said: bool) -> None:
    lines = unmeasured_values(composed_train(*overrides))
    assert len(lines) == int(said)
    if said:
        assert lines[0].startswith("probe.intervention=[all]: norm=dyt has no centering") and "[]" in lines[0]


@pytest.mark.slow  # trains a tiny DyT arm for 2 steps
def test_a_dyt_run_with_intervention_scopes_says_so_once_and_runs(tmp_path: Path) -> None:
    run = tmp_path / "outputs" / "dyt"
    result = train_here(run, "norm=dyt", "probe.intervention=[all]", "max_steps=2", "checkpoint.steps=[2]",
                       "checkpoint.last_every=0")
    said = result.stdout + result.stderr
    assert said.count(LINE) == 1, said[-3000:]
    assert (run / "angles.jsonl").is_file() and not (run / "intervention.jsonl").exists()
