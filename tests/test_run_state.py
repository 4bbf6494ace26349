"""The three state bugs of issue 12, on real runs: the final step is always checkpointed and probed; a
refused launch leaves the run it refuses untouched and a sweep runs its other jobs; status copes with
analyze.py folders (pretrained records have step null)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra.utils import instantiate

from callbacks.checkpointing import CheckpointSchedule
from normgeo.config.schema import CHECKPOINT_SCHEDULE, CheckpointSchema
from normgeo.measure.records import read_rows
from normgeo.status import main as status_main
from tests.conftest import ARM_SETTINGS, entry_point_here, metrics_rows, step_losses, train_in_process


def schedule_of(max_steps: int, **rule) -> CheckpointSchedule:
    """The schedule of ``rule`` and the schema's other defaults, built as a run builds it."""
    return instantiate(CheckpointSchema(_target_=CHECKPOINT_SCHEDULE, **rule), max_steps=max_steps)


def test_schedule_always_ends_with_the_final_step() -> None:
    assert list(schedule_of(6, steps=[2, 5])) == [2, 5, 6]
    assert list(schedule_of(250, dense_every=100, dense_until=1000, sparse_every=1000)) == [
        100,
        200,
        250,
    ]
    assert list(schedule_of(200, dense_every=100)) == [100, 200]


def test_the_final_step_off_the_schedule_is_checkpointed_probed_and_figured(arms_sweep) -> None:
    run = arms_sweep[0] / "tiny-layer-s0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt", "step-0000002.ckpt", "step-0000003.ckpt"
    ]
    assert sorted({r["step"] for r in read_rows(run / "angles.jsonl")}) == [0, 2, 3]
    assert (run / "figures" / "layers_normgeo-tiny_layer_step0000003.png").is_file()


@pytest.mark.slow
def test_a_refused_launch_leaves_hydra_files_and_log_untouched(arms_sweep, tmp_path: Path, capsys) -> None:
    root, _, _ = arms_sweep
    run = root / "tiny-layer-s0"
    before = {p: p.read_bytes() for p in [*run.glob(".hydra/*"), run / "train.log"]}
    refused = train_in_process(run, "max_steps=20", capsys=capsys)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    assert {p: p.read_bytes() for p in [*run.glob(".hydra/*"), run / "train.log"]} == before
    # A refused resume that would change the experiment: same guarantee.
    refused = train_in_process(run, *ARM_SETTINGS, "resume=auto", "optim.lr=0.5", capsys=capsys)
    assert refused.returncode == 2 and "optim.lr" in refused.stderr
    assert {p: p.read_bytes() for p in [*run.glob(".hydra/*"), run / "train.log"]} == before


def test_a_sweep_runs_its_other_jobs_and_lists_the_refused_ones(arms_sweep) -> None:
    root, sweep, before = arms_sweep
    assert sweep.returncode == 2, sweep.stderr[-3000:]
    assert "1 job(s) of the sweep were refused" in sweep.stderr
    assert f"{root / 'tiny-layer-s0'}: " in sweep.stderr
    for run in ("tiny-rms-s0", "tiny-layer-s1", "tiny-rms-s1"):
        assert sorted({r["step"] for r in read_rows(root / run / "angles.jsonl")}) == [0, 2, 3], run
    layer = root / "tiny-layer-s0"
    assert {k: (layer / k).read_bytes() for k in before} == before


@pytest.fixture(scope="module")
def with_analysis(arms_sweep, shared: Path) -> Path:
    """The sweep folder plus an analyze.py folder of a pretrained model (records with step null)."""
    root = arms_sweep[0]
    if not (root / "analyze" / "minilm").is_dir():
        done = entry_point_here(
            "analyze",
            [
                "progress=false",
                "model=minilm",
                "probe=local",
                f"probe.path={shared / 'corpora' / 'wikipedia'}",
                "probe.tokens=512",
                "model.seq_len=256",
                f"output_root={root}",
            ],
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.slow
def test_status_shows_analysis_folders_and_the_finished_runs(with_analysis: Path, capsys) -> None:
    assert status_main([str(with_analysis), "--no-slurm", "--json"]) == 0
    rows = {r["run"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (
        rows["analyze/minilm"]["state"] == "analyzed" and rows["analyze/minilm"]["probe_step"] == "pretrained"
    )
    # The refused launches did not rewrite max_steps: the layer run still reads 3/3, finished.
    assert (rows["tiny-layer-s0"]["step"], rows["tiny-layer-s0"]["max_steps"]) == (3, 3)
    assert {rows[f"tiny-{n}-s{s}"]["state"] for n in ("layer", "rms") for s in (0, 1)} == {"finished"}
    assert status_main([str(with_analysis), "--no-slurm"]) == 0
    assert "pretrained" in capsys.readouterr().out


def test_a_finished_run_whose_checkpoints_were_deleted_is_still_finished(
    arms_sweep, tmp_path: Path, capsys
) -> None:
    """Issue 34: its summary.json says it finished; before, status read the missing checkpoints as
    running/failed."""
    copy = tmp_path / "tiny-rms-s1"
    shutil.copytree(arms_sweep[0] / "tiny-rms-s1", copy)
    shutil.rmtree(copy / "checkpoints")
    assert status_main([str(copy), "--no-slurm", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["state"], row["step"], row["max_steps"]) == ("finished", 3, 3)


@pytest.mark.parametrize(("ended", "state"), [("requeue", "preempted"), ("stopped", "failed")])
def test_a_requeue_is_read_from_the_summary_not_from_the_log(
    arms_sweep, tmp_path: Path, capsys, ended: str, state: str
) -> None:
    """A run whose summary says its latest session stopped to requeue is preempted (waiting for SLURM to
    start it again); one that stopped otherwise before max_steps failed. Its train.log says neither."""
    copy = tmp_path / "tiny-rms-s1"
    shutil.copytree(arms_sweep[0] / "tiny-rms-s1", copy)
    shutil.rmtree(copy / "checkpoints")
    summary = json.loads((copy / "summary.json").read_text())
    session = {"steps": [0, 2], "wall_s": 1.0, "ended": ended}
    summary.update(step=2, finished=False, session_log=[session])
    (copy / "summary.json").write_text(json.dumps(summary))
    assert "requeue" not in (copy / "train.log").read_text()
    assert status_main([str(copy), "--no-slurm", "--active-minutes=0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == state


def test_end_of_run_summary_on_the_console_and_in_summary_json(arms_sweep) -> None:
    root, sweep, _ = arms_sweep
    rms = root / "tiny-rms-s0"
    summary = json.loads((rms / "summary.json").read_text())
    assert (summary["step"], summary["max_steps"], summary["finished"]) == (3, 3, True)
    assert summary["train_loss"] == pytest.approx(step_losses(rms)[3])
    assert summary["tokens_seen"] == 3 * 8 * 64 and summary["wall_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["records"] == str(rms / "angles.jsonl") and summary["figures"]
    assert summary["logs"]["CSVLogger"] == str(rms / "csv" / "version_0")
    assert summary["logs"]["TensorBoardLogger"] == str(rms / "tensorboard" / "version_0")
    run_id = (rms / "wandb_run_id.txt").read_text().strip()
    assert summary["logs"]["WandbLogger"].startswith(str(rms / "wandb" / "offline-run-"))
    assert summary["logs"]["WandbLogger"].endswith(run_id)
    assert "run summary: step 3/3 (finished) · train loss" in sweep.stdout + sweep.stderr
    assert f"summary:     {rms / 'summary.json'}" in sweep.stdout + sweep.stderr


def test_losses_and_probes_share_step_numbers(arms_sweep) -> None:
    run = arms_sweep[0] / "tiny-layer-s0"
    assert sorted(step_losses(run)) == [1, 2, 3]  # the k-th update's loss at step k
    probed = {int(r["step"]) for r in metrics_rows(run) if r.get("probe/ln1.in/ones_deg")}
    assert probed == {r["step"] for r in read_rows(run / "angles.jsonl")} == {0, 2, 3}
    tokens = {
        int(r["step"]): float(r["train/tokens_seen"]) for r in metrics_rows(run) if r.get("train/tokens_seen")
    }
    assert all(value == step * 8 * 64 for step, value in tokens.items())
