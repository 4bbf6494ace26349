"""The variance pilot (docs/make_pilot.sh, normgeo.pilot) on real tiny runs:
the script trains both arms with the initial weights, the batch order and
the thread count varied one at a time, and the split reads them back."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from corpus.datamodule import TokenDataModule
from corpus.stream import TokenWindows
from normgeo.config.schema import DataSchema, TrainSchema
from normgeo.pilot import main as pilot_main
from normgeo.pilot import run_table, validation_windows
from normgeo.plan import main as plan_main
from tests.conftest import ROOT, metrics_rows

# TokenDataModule's other arguments at the schema's defaults (the data keys', and the run's).
DATA_DEFAULTS = {field.name: field.default for kind, names in (
    (DataSchema, ("tokenizer", "val_fraction", "auto_prepare", "prepare_command")),
    (TrainSchema, ("val_sequences", "num_workers")))
    for field in dataclasses.fields(kind) if field.name in names}
TINY = "max_steps=4 optim.warmup_steps=0 checkpoint.steps=[4] val_every=2 val_sequences=16 log_every=1"


@pytest.fixture(scope="module")
def pilot(tmp_path_factory, shared: Path) -> Path:
    out = tmp_path_factory.mktemp("pilot") / "p"
    env = {**os.environ, "PILOT_SEEDS": "2", "PILOT_FP": "1", "PILOT_OVERRIDES": TINY,
           "TIKTOKEN_CACHE_DIR": str(shared / "tiktoken")}
    done = subprocess.run(
        ["bash", str(ROOT / "docs" / "make_pilot.sh"), str(out), str(shared / "corpora" / "webtext")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_pilot_splits_the_paired_sd_by_source(pilot: Path) -> None:
    split = json.loads((pilot / "pilot.json").read_text())
    runs = pd.read_csv(pilot / "pilot_runs.csv")
    assert len(runs) == 8 and set(runs["threads"]) == {1, 2}
    assert (split["n_weights"], split["n_batches"], split["n_fp"]) == (2, 2, 1)
    d = {(r.seed, r.data_seed, r.threads): r.metric for r in runs[runs["norm"] == "layer"].itertuples()}
    e = {(r.seed, r.data_seed, r.threads): r.metric for r in runs[runs["norm"] == "rms"].itertuples()}
    diff = {k: d[k] - e[k] for k in d}
    assert split["sd_weights"] == pytest.approx(statistics.stdev([diff[(0, 0, 1)], diff[(1, 0, 1)]]))
    assert split["sd_batches"] == pytest.approx(statistics.stdev([diff[(0, 0, 1)], diff[(0, 1, 1)]]))
    # data.seed alone moves the loss (the batch order is varied), and seed alone too (the weights).
    assert d[(0, 1, 1)] != d[(0, 0, 1)] and d[(1, 0, 1)] != d[(0, 0, 1)]
    # The checkpoints scored window by window give the logged validation loss back: the windows are the run's.
    assert split["validation_windows"] == 16 and abs(split["checkpoint_gap"]) < 1e-4
    assert split["sd_validation"] > 0 and split["sd_study"] >= max(split["sd_weights"], split["sd_batches"])
    assert (
        split["seeds_equivalence"] >= 2
        and "--seeds-for val_loss/tail=0.02" in (pilot / "pilot.md").read_text()
    )
    assert "'run_name=pilot-${norm.name}" in (pilot / "commands.txt").read_text()
    # Each run's largest rise of train/loss above its running minimum, recomputed from its CSV log.
    losses = [
        float(r["train/loss"]) for r in metrics_rows(pilot / "pilot-rms-w1-b0-t1") if r.get("train/loss")
    ]
    rise = max(loss - min(losses[: i + 1]) for i, loss in enumerate(losses))
    assert runs.set_index("run").loc["pilot-rms-w1-b0-t1", "rise"] == pytest.approx(rise, abs=1e-6)


@pytest.mark.slow
def test_a_run_stopped_before_its_end_is_not_a_pilot_point(pilot: Path, tmp_path: Path) -> None:
    copy = tmp_path / "p"
    shutil.copytree(pilot, copy, ignore=shutil.ignore_patterns("data"))
    assert len(run_table(copy, "val_loss/tail")) == 8
    summary = copy / "pilot-layer-w1-b0-t1" / "summary.json"
    summary.write_text(summary.read_text().replace('"finished": true', '"finished": false'))
    kept = run_table(copy, "val_loss/tail")
    assert len(kept) == 7 and "pilot-layer-w1-b0-t1" not in set(kept["run"])


@pytest.mark.slow
def test_the_unigram_baseline_is_the_validation_targets_cross_entropy_under_the_train_counts(
    pilot: Path,
) -> None:
    """An independent count: a Counter over train.bin, add-half over the vocabulary, the run's own windows."""
    split = json.loads((pilot / "pilot.json").read_text())
    run = next(pilot.glob("pilot-layer-w0-b0-t1"))
    _, windows, count, _ = validation_windows(run)
    directory = next((pilot / "data").glob("local-*"))
    meta = json.loads((directory / "meta.json").read_text())
    train = np.fromfile(directory / "train.bin", dtype=np.uint16)
    counts = Counter(train.tolist())
    total = len(train) + 0.5 * meta["vocab_size"]
    targets = [int(t) for i in range(count) for t in windows[i][1]]
    expected = -sum(math.log((counts.get(t, 0) + 0.5) / total) for t in targets) / len(targets)
    assert split["unigram"] == pytest.approx(expected, rel=1e-9)
    # the frequencies say more than a uniform guess
    assert 0 < split["unigram"] < math.log(meta["vocab_size"])
    assert "unigram cross-entropy (the training split's token frequencies" in (pilot / "pilot.md").read_text()


@pytest.mark.slow
def test_val_seed_gives_every_seed_the_same_validation_windows(pilot: Path) -> None:
    directory = next((pilot / "data").glob("local-*"))

    def offsets(seed: int, val_seed: int | None) -> list[int]:
        module = TokenDataModule(
            name="local",
            source=None,
            directory=str(directory),
            seq_len=8,
            global_batch=8,
            micro_batch=8,
            max_steps=10,
            seed=seed,
            val_seed=val_seed,
            **DATA_DEFAULTS,
        )
        data = module.load()
        windows = TokenWindows(str(data.path("val")), data.num_tokens("val"), 8, 8, module.val_seed)
        return [windows.offset(i) for i in range(8)]

    assert offsets(0, 0) == offsets(1, 0) != offsets(1, None)


def test_bad_pilot_input_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert pilot_main([str(tmp_path / "missing")]) == 2
    assert pilot_main([str(tmp_path)]) == 2  # a folder without runs
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert plan_main(["experiment=study_cpu", "threads=0"]) == 2
    assert plan_main(["experiment=study_cpu", "val_seed=-1"]) == 2
