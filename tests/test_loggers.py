"""Loggers combine (``logger=[csv,wandb,tensorboard]``): one real run logs to all three; the offline wandb
run holds per-layer probe scalars, one key per figure and the config once; TensorBoard gets the figures;
normgeo.status and normgeo.compare read the losses from whichever logger a run used."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from normgeo.metrics import read_metrics, wandb_media, wandb_records, wandb_runs
from normgeo.records import read_rows
from normgeo.status import last_loss
from tests.conftest import run_train, step_losses


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("loggers") / "run"
    run_train(run_dir, "logger=[csv,wandb,tensorboard]", "max_steps=2", "checkpoint.steps=[2]")
    return run_dir


def test_all_three_loggers_log_the_same_losses(logged_run: Path) -> None:
    assert (logged_run / "csv" / "version_0" / "metrics.csv").is_file()
    run_id = (logged_run / "wandb_run_id.txt").read_text().strip()
    assert len(list((logged_run / "wandb").glob(f"offline-run-*-{run_id}"))) == 1
    csv_losses = step_losses(logged_run)
    assert sorted(csv_losses) == [1, 2]
    for logger in ("wandb", "tensorboard"):
        frame = read_metrics(logged_run, logger)
        losses = frame[frame["metric"] == "train/loss"].set_index("step")["value"].to_dict()
        assert losses == pytest.approx(csv_losses), logger


def test_wandb_holds_per_layer_scalars_matching_the_records(logged_run: Path) -> None:
    frame = read_metrics(logged_run, "wandb").set_index(["metric", "step"])["value"]
    records = read_rows(logged_run / "angles.jsonl")
    for r in records:
        layer = f"layer{r['layer']}" if isinstance(r["layer"], int) else r["layer"]
        assert frame[(f"probe/{r['site']}/{r['ref']}/{layer}", r["step"])] == pytest.approx(r["mean_deg"])
    assert len(records) == 2 * 30  # steps 0 and 2, every (layer, site, reference)


def test_wandb_figures_have_their_own_keys_and_the_config_is_logged_once(logged_run: Path) -> None:
    from wandb.proto import wandb_internal_pb2

    media = wandb_media(logged_run)
    figures = [key for key in media if key.startswith("figures/")]
    assert sorted(figures) == sorted(f"figures/{p.stem}" for p in (logged_run / "figures").glob("*.png"))
    assert all(media[key] == {"images/separated"} for key in [*figures, "probe/layers"])
    assert media["probe/angles"] == {"table-file"}
    kinds = []
    for data in wandb_records(wandb_runs(logged_run)[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kinds.append(record.WhichOneof("record_type"))
    assert kinds.count("config") == 1  # train.py's whole config, not Lightning's module hparams again


def test_tensorboard_gets_the_figures(logged_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged_run / "tensorboard" / "version_0"))
    events.Reload()
    images = set(events.Tags()["images"])
    assert "probe/layers" in images and {f"figures/{p.stem}" for p in (logged_run / "figures").glob("*.png")} <= images
    assert "probe/ln1.in/ones/layer0" in events.Tags()["scalars"]


def test_status_reads_the_loss_from_whichever_logger_the_run_used(logged_run: Path, tmp_path: Path) -> None:
    expected = step_losses(logged_run)[2]
    for kept in ("wandb", "tensorboard"):
        copy = tmp_path / kept
        shutil.copytree(logged_run, copy, ignore=shutil.ignore_patterns("checkpoints"))
        for other in {"csv", "wandb", "tensorboard"} - {kept}:
            shutil.rmtree(copy / other)
        assert last_loss(copy) == pytest.approx(expected), kept
