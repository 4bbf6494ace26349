"""Loggers combine (``logger=[wandb,tensorboard]``, the jobs of the conftest sweep): every job logs to both,
to its own wandb run (a local sweep runs its jobs in one process) and to the CSV every run writes though
no CSV logger was asked for; the offline wandb run holds per-layer probe scalars, one key per figure and
the config once; TensorBoard gets the figures; normgeo.readers.run_states reads the losses from the CSV."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from normgeo.measure.records import DamagedRecords, read_rows
from normgeo.readers.run_states import last_loss
from tests.conftest import step_losses, train_here
from tests.wandb_log import wandb_media, wandb_records, wandb_runs, wandb_scalars

pytestmark = pytest.mark.slow  # trained runs shared by the module (the quick tier skips them)

SWEPT = ("tiny-layer-s1", "tiny-rms-s0", "tiny-rms-s1")  # the jobs the sweep ran (layer-s0 was refused)


def end_figures(run_dir: Path) -> list[str]:
    """The figures written at the end of the run (figures/ also holds each probe step's layer figure)."""
    return json.loads((run_dir / "summary.json").read_text())["figures"]


@pytest.fixture(scope="module")
def logged_run(arms_sweep) -> Path:
    return arms_sweep[0] / "tiny-rms-s1"  # the sweep's last job: it would log into the first job's wandb run


def tensorboard_losses(run_dir: Path) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "tensorboard" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return {int(event.step): float(event.value) for event in events.Scalars("train/loss")}


@pytest.mark.parametrize("job", SWEPT)
def test_every_job_logs_its_own_losses_to_both_loggers_and_the_csv(arms_sweep, job: str) -> None:
    run_dir = arms_sweep[0] / job
    assert (run_dir / "csv" / "version_0" / "metrics.csv").is_file()  # though logger= named no CSV
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert [p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")] == [run_id]
    csv_losses = step_losses(run_dir)
    assert sorted(csv_losses) == [1, 2, 3]
    wandb = wandb_scalars(run_dir)
    assert wandb[wandb["metric"] == "train/loss"].set_index("step")["value"].to_dict() == pytest.approx(
        csv_losses
    )
    assert tensorboard_losses(run_dir) == pytest.approx(csv_losses)


def test_wandb_holds_per_layer_scalars_matching_the_records(logged_run: Path) -> None:
    frame = wandb_scalars(logged_run).set_index(["metric", "step"])["value"]
    records = read_rows(logged_run / "angles.jsonl")
    for r in records:
        layer = f"layer{r['layer']}" if isinstance(r["layer"], int) else r["layer"]
        assert frame[(f"probe/{r['site']}/{r['ref']}/{layer}", r["step"])] == pytest.approx(r["mean_deg"])
    assert len(records) == 3 * 45  # steps 0, 2 and 3, every (layer, site, reference)


def test_wandb_figures_have_their_own_keys_and_the_config_is_logged_once(logged_run: Path) -> None:
    media = wandb_media(logged_run)
    figures = [key for key in media if key.startswith("figures/")]
    assert sorted(figures) == sorted(f"figures/{Path(p).stem}" for p in end_figures(logged_run))
    # layers at steps 0 and 3, the angle against step, 1 among the null directions per layer and per step, and
    # the centering intervention per block and where the mean lives at the last step
    assert len(figures) == 7
    assert all(media[key] == {"images/separated"} for key in [*figures, "probe/layers"])
    assert media["probe/angles"] == {"table-file"}
    kinds = [record.WhichOneof("record_type") for record in wandb_records(wandb_runs(logged_run)[0])]
    assert kinds.count("config") == 1  # train.py's whole config, not Lightning's module hparams again


def test_tensorboard_gets_the_figures(logged_run: Path) -> None:
    events = EventAccumulator(str(logged_run / "tensorboard" / "version_0"))
    events.Reload()
    images = set(events.Tags()["images"])
    assert "probe/layers" in images and {f"figures/{Path(p).stem}" for p in end_figures(logged_run)} <= images
    assert "probe/ln1.in/ones/layer0" in events.Tags()["scalars"]


def test_status_reads_the_loss_from_the_csv_alone(logged_run: Path, tmp_path: Path) -> None:
    expected = step_losses(logged_run)[3]
    copy = tmp_path / "run"
    shutil.copytree(logged_run, copy, ignore=shutil.ignore_patterns("checkpoints", "wandb", "tensorboard"))
    assert last_loss(copy) == pytest.approx(expected)
    shutil.rmtree(copy / "csv")
    with pytest.raises(DamagedRecords, match="damaged metrics"):  # wandb's and TensorBoard's logs never read
        last_loss(copy)


def test_the_last_steps_loss_is_logged_where_log_every_skips_it(tmp_path: Path) -> None:
    """Issue 75, class 5: Lightning writes its loggers every log_every steps, so a run of 5 steps logging
    every 2 left step 5's loss, the summary's, out of its log: status showed step 4's."""
    run_dir = tmp_path / "run"
    train_here(run_dir, "max_steps=5", "log_every=2")
    losses = step_losses(run_dir)
    assert sorted(losses) == [2, 4, 5]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert losses[5] == pytest.approx(summary["train_loss"], rel=1e-6)
    assert last_loss(run_dir) == losses[5]
