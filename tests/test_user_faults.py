"""Issue 20: every failure a user can cause fails early, says what to do, and leaves the run directory as
it found it (docs/reliability.md, both tables)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import normgeo.report as report
from callbacks.run import build_trainer
from corpus.prepare import PreparedDataError
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import ConfigError, launch_cost
from normgeo.runs.start import check_trainer
from tests.conftest import FAST, entry_point_here, module_main, run_entry_point, train_in_process


def tree(folder: Path) -> dict[str, tuple[int, bytes]] | None:
    """Every file under ``folder`` with its mtime and bytes (None: the folder is absent)."""
    if not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def a_finished_run(run_dir: Path) -> Path:
    """A run directory as a finished run leaves it (what matters here: files that must not change)."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("max_steps: 3\n")
    (run_dir / "train.log").write_text("[train] done\n")
    (run_dir / "angles.jsonl").write_text('{"model": "m", "norm": "rms", "step": 0}\n')
    return run_dir


def composed_train(*overrides: str):
    """train.py's typed config of ``overrides``, checked."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return check_config("train", compose("train", overrides=list(overrides)))


# 1. Lightning's own argument checks: their types before the run directory is claimed, their values as
# train.py builds its Trainer (the start then undone).

@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.devices=0"],
            "trainer: `Trainer(devices=0)` value is not a valid input using cpu accelerator",
        ),
        (["trainer.devices=[]"], "trainer: `Trainer(devices=[])` value is not a valid input"),
        (["trainer.devices='0'"], "trainer: `Trainer(devices='0')` value is not a valid input"),
        # on a GPU: all
        (["trainer.devices=-1"], "trainer: `devices` selected with `CPUAccelerator` should be an int > 0"),
        (["trainer.num_nodes=0"], "trainer: `num_nodes` must be a positive integer, but got 0"),
        (["trainer.precision=fp8"], "trainer: Precision 'fp8' is invalid. Allowed precision values: ("),
        (
            ["trainer.accelerator=tpuu"],
            "trainer: You selected an invalid accelerator name: `accelerator='tpuu'`",
        ),
        (["trainer.strategy=dpp"], "trainer: You selected an invalid strategy name: `strategy='dpp'`"),
        (
            ["trainer=ddp_cpu", "trainer.strategy._target_=no.such.Strategy"],
            "trainer: Error locating target 'no.such.Strategy'",
        ),
        (
            ["trainer=ddp_cpu", "trainer.strategy._target_=lightning.Trainer"],
            "trainer: Trainer.__init__() got an unexpected",
        ),
        (
            ["trainer=ddp_cpu", "global_batch=12", "micro_batch=4"],
            "micro_batch=4: global batch 12 is not divisible by micro batch 4 x 2 devices",
        ),
    ],
)
def test_trainer_arguments_lightning_refuses_are_refused_at_the_start(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    cfg = composed_train(*overrides)  # the config's own keys are fine: Lightning, on this machine, says no
    with pytest.raises(ConfigError) as refused:  # the start's, or the config's own (the accumulation)
        check_trainer(cfg)
        build_trainer(cfg, tmp_path, callbacks=[])
    assert str(refused.value).startswith(message), refused.value


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer=cpu"],
        ["trainer=ddp_cpu"],
        ["trainer.devices='2'"],
        ["trainer.precision=16"],
        ["trainer.precision=bf16"],
        ["trainer.precision=bf16-mixed"],
        ["trainer.strategy=DDP"],
        ["trainer.strategy=ddp_spawn"],
    ],
)
def test_trainer_arguments_lightning_accepts_on_this_machine_pass(
        overrides: list[str], tmp_path: Path) -> None:
    # the GPU presets (trainer=gpu, ddp, fsdp) are checked where they run
    cfg = composed_train(*overrides)
    check_trainer(cfg)
    assert build_trainer(cfg, tmp_path, callbacks=[]).max_steps == cfg.max_steps


class BrokenStrategy:
    """A strategy whose constructor has a bug (nothing a user set): the start must not call it a refusal."""

    def __init__(self, process_group_backend: str = "gloo") -> None:
        raise RuntimeError(f"a bug in the strategy's own code ({process_group_backend})")


BROKEN = "trainer.strategy._target_=tests.test_user_faults.BrokenStrategy"


@pytest.mark.parametrize(("overrides", "code", "line"), [
    ([BROKEN], 1, "RuntimeError: a bug in the strategy's own code (gloo)"),
    ([BROKEN, "+trainer.strategy.nosuch=1"], 2,
     "error: trainer: BrokenStrategy.__init__() got an unexpected keyword argument 'nosuch'"),
])
def test_a_strategy_that_fails_by_a_bug_keeps_its_traceback_a_bad_key_is_one_line(
        overrides: list[str], code: int, line: str, tmp_path: Path, capsys) -> None:
    done = train_in_process(tmp_path / "run", "trainer=ddp_cpu", *overrides, capsys=capsys)
    assert done.returncode == code, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert any(said.startswith(line) for said in lines), done.stderr[-3000:]
    assert ("Traceback" in done.stderr) == (code == 1) and (code == 1 or len(lines) == 1), done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("override", "message"), [
    ("trainer.devices=0", "error: trainer: `Trainer(devices=0)` value is not a valid input"),
    ("trainer.precision=fp8", "error: trainer: Precision 'fp8' is invalid"),
])
def test_trainer_arguments_exit_2_and_leave_the_run_directory_as_it_was(override: str, message: str,
                                                                       tmp_path: Path, capsys) -> None:
    """train.py's main in this process (tests/test_bad_input.py runs trainer.devices=0 as a real process)."""
    run_dir = a_finished_run(tmp_path / "run")
    before = tree(run_dir)
    done = run_entry_point("train", ["experiment=smoke", override, f"run_dir={run_dir}",
                                     f"data_root={tmp_path / 'data'}"], capsys)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-3000:]
    assert tree(run_dir) == before  # the data prepared under data_root stays, for the corrected command


# 2. Memory independent of max_steps.

def listed_schedule(
    max_steps: int, steps=None, dense_every=1000, dense_until=10000, sparse_every=10000
) -> list[int]:
    """The schedule as the old, materializing CheckpointSchedule built it (small max_steps only)."""
    if steps is not None:
        chosen = set(steps)
    else:
        chosen = set(range(dense_every, min(dense_until, max_steps) + 1, dense_every))
        chosen |= set(range(sparse_every, max_steps + 1, sparse_every))
    chosen = {s for s in chosen if s <= max_steps} | ({max_steps} if max_steps > 0 else set())
    return sorted(chosen)


@pytest.mark.parametrize("rule", [
    {"dense_every": 3, "dense_until": 20, "sparse_every": 7},
    {"dense_every": 5, "dense_until": 30, "sparse_every": 10},
    {"dense_every": 4, "dense_until": 2, "sparse_every": 6},
    {"dense_every": 1, "dense_until": 5, "sparse_every": 1},
    {"steps": [2, 5, 9, 40]},
    {"steps": []},
])
def test_the_arithmetic_schedule_is_the_listed_one(rule: dict) -> None:
    from tests.test_run_state import schedule_of

    for max_steps in range(0, 45):
        schedule, listed = schedule_of(max_steps, **rule), listed_schedule(max_steps, **rule)
        assert list(schedule) == listed and len(schedule) == len(listed), (max_steps, rule)
        assert [s for s in range(-2, max_steps + 3) if s in schedule] == listed
        assert [schedule.next_step_after(s) for s in range(-1, max_steps + 2)] == [
            next((t for t in listed if t > s), None) for s in range(-1, max_steps + 2)]


def test_a_schedule_of_10_to_the_12_steps_takes_no_time_or_memory() -> None:
    import time
    import tracemalloc

    from tests.test_run_state import schedule_of

    tracemalloc.start()
    started = time.perf_counter()
    schedule = schedule_of(10**12)  # the paper's rule: 1K .. 10K, then every 10K
    first = list(itertools.islice(schedule, 12))
    assert first == [*range(1000, 10001, 1000), 20000, 30000]
    assert (
        10**12 in schedule
        and 10**12 - 10000 in schedule
        and 10**12 - 1 not in schedule
        and 15000 not in schedule
    )
    assert schedule.next_step_after(10**12 - 10000) == 10**12 and schedule.next_step_after(10**12) is None
    assert len(schedule) == 10 + 10**8 - 1  # dense + sparse - the 10K on both
    odd = schedule_of(10**12 + 1, steps=[5, 10**12])
    assert list(odd) == [5, 10**12, 10**12 + 1] and 10**12 + 1 in odd and len(odd) == 3
    assert time.perf_counter() - started < 1
    assert tracemalloc.get_traced_memory()[1] < 1_000_000
    tracemalloc.stop()


# 3. One damaged file: its run is listed as damaged, the others are compared and shown.

def a_sweep_with_one_damaged_run(root: Path) -> tuple[list[Path], Path]:
    from tests.test_verdict import make_run

    runs = [make_run(root, norm, seed, val_loss=5.0 + seed, tokens_per_s=1000.0, dev=1.0 + seed)
            for norm in ("layer", "rms") for seed in (0, 1)]
    for run in runs:  # what find_runs (normgeo.status) looks for
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("max_steps: 10\nstop_at_step: null\n")
    damaged = runs[-1] / "angles.jsonl"
    text = damaged.read_text()
    damaged.write_text(text[: text.index("\n", len(text) // 2) + 30])  # a copy cut mid-line
    return runs, damaged


def test_compare_skips_a_run_with_a_damaged_angles_file_and_compares_the_others(
    tmp_path: Path, capsys
) -> None:
    from normgeo.compare import main as compare_main

    runs, damaged = a_sweep_with_one_damaged_run(tmp_path / "outputs")
    line = damaged.read_text().count("\n") + 1
    before = tree(runs[-1])
    assert compare_main([str(tmp_path / "outputs"), "--formats", "png", "--refs=ones"]) == 1
    out, err = capsys.readouterr()
    assert f"skipped {runs[-1]}: {damaged}:{line}: damaged record (" in err
    assert (
        err.strip().splitlines()[-1].startswith("error: 1 run(s) skipped for damaged records (listed above)")
    )
    summary = (tmp_path / "outputs" / "compare" / "summary.md").read_text()
    assert all(run.name in summary for run in runs[:3]) and runs[-1].name not in summary
    assert (tmp_path / "outputs" / "compare" / "verdict.md").is_file()
    assert tree(runs[-1]) == before


def test_compare_with_only_damaged_runs_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    from normgeo.compare import main as compare_main

    runs, damaged = a_sweep_with_one_damaged_run(tmp_path / "outputs")
    assert compare_main([str(runs[-1]), "--out", str(tmp_path / "compared")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: no readable training runs") and f"{damaged}:" in last
    assert not (tmp_path / "compared").exists()


@pytest.mark.parametrize("folder", ["empty", "a run's checkpoints", "an export"])
def test_the_readers_refuse_a_folder_without_runs_with_one_line_and_exit_2(folder: str, tmp_path: Path,
                                                                           capfd) -> None:
    """Issue 75, class 9: status exited 1 where compare and report exit 2 for the same folder."""
    root = {"empty": tmp_path / "empty", "a run's checkpoints": tmp_path / "run" / "checkpoints",
            "an export": tmp_path / "hf"}[folder]
    root.mkdir(parents=True)
    if folder == "a run's checkpoints":
        a_finished_run(root.parent)
        (root / "last.ckpt").write_bytes(b"")
    elif folder == "an export":
        (root / "config.json").write_text("{}")
    for command in ("status", "compare", "report"):
        done = module_main(capfd, command, root)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (command, done)
        assert str(root) in lines[0], (command, lines)


def test_status_lists_a_run_with_a_damaged_angles_file_as_damaged_and_shows_the_others(tmp_path: Path,
                                                                                      capsys) -> None:
    from normgeo.status import main as status_main

    runs, damaged = a_sweep_with_one_damaged_run(tmp_path / "outputs")
    before = tree(runs[-1])
    assert status_main([str(tmp_path / "outputs"), "--no-slurm", "--json"]) == 1
    out, err = capsys.readouterr()
    rows = {row["run"]: row for row in map(json.loads, out.splitlines())}
    assert set(rows) == {run.name for run in runs}
    assert rows[runs[-1].name]["probe_step"] == "damaged" and rows[runs[0].name]["probe_step"] == 10
    assert rows[runs[-1].name]["damaged"].startswith(f"{damaged}:")
    assert f"damaged {runs[-1].name}: {damaged}:" in err
    assert err.strip().splitlines()[-1].startswith("error: 1 run(s) with damaged records (listed above)")
    assert tree(runs[-1]) == before


def test_status_names_a_config_that_is_empty_or_not_a_mapping_and_shows_the_others(
    tmp_path: Path, capsys
) -> None:
    """Issue 52, class 5: a run whose only config is empty or a YAML list is listed as damaged with its file
    and line (before: an empty .hydra/config.yaml showed a finished run as failed, with no word why); a run
    whose run_config.yaml is whole is read from it, its empty .hydra/config.yaml aside."""
    from normgeo.status import main as status_main

    runs, _ = a_sweep_with_one_damaged_run(tmp_path / "outputs")
    for run, text in zip(runs[:3], ("", "- a\n- list\n", ""), strict=True):
        (run / ".hydra" / "config.yaml").write_text(text)
    for run in runs[:2]:
        (run / "run_config.yaml").unlink()
    before = [tree(run) for run in runs]
    assert status_main([str(tmp_path / "outputs"), "--no-slurm", "--json"]) == 1
    out, err = capsys.readouterr()
    rows = {row["run"]: row for row in map(json.loads, out.splitlines())}
    assert set(rows) == {run.name for run in runs}
    empty, listed = (run / ".hydra" / "config.yaml" for run in runs[:2])
    assert f"damaged {runs[0].name}: {empty}:1: damaged record (empty: no setting in it)" in err
    assert f"damaged {runs[1].name}: {listed}:1: damaged record (a YAML list, not a mapping)" in err
    assert rows[runs[2].name]["damaged"] is None and rows[runs[2].name]["max_steps"] == 10
    assert [tree(run) for run in runs] == before


def test_read_rows_names_the_file_and_line_of_a_damaged_record(tmp_path: Path) -> None:
    from normgeo.measure.records import DamagedRecords, read_rows

    path = tmp_path / "angles.jsonl"
    key = '"model": "m", "norm": "rms", '
    path.write_text(f'{{{key}"step": 0}}\n\n{{{key}"step": 1}}\n{{{key}"step": 2, "mea\n')
    with pytest.raises(
        DamagedRecords, match=rf"^{path}:4: damaged record \(Invalid control character at column 46\); copy"
    ) as raised:
        read_rows(path)
    assert (raised.value.path, raised.value.line) == (path, 4)
    # Read whole but not a record: each named with what was expected (issue 52, class 5).
    for text, expected in (
        (f'{{{key}"step": 0}}\n[1, 2]\n', r":2: damaged record \(a JSON list, not an object\)"),
        (f'{{{key}"step": 0}}\n{{}}\n', r":2: damaged record \(no 'model', 'norm', 'step': every record has"),
        (f'{{{key}"step": 0, "mean_deg": "89.9"}}\n', r":1: damaged record \('mean_deg' is '89.9', expected"),
        (f'{{{key}"step": 0.5}}\n', r":1: damaged record \('step' is 0.5, expected a whole number or null\)"),
        (f'{{{key}"step": 0, "site": 3}}\n', r":1: damaged record \('site' is 3, expected text\)"),
    ):
        path.write_text(text)
        with pytest.raises(DamagedRecords, match=expected):
            read_rows(path)


# 4. Wrong words.

@pytest.mark.parametrize(
    ("val_fraction", "short", "advice"), [(0.5, "train", "smaller"), (0.02, "val", "larger")]
)
def test_a_split_too_small_for_seq_len_advises_the_val_fraction_that_helps(
    tmp_path: Path, val_fraction: float, short: str, advice: str
) -> None:
    from corpus.datamodule import TokenDataModule
    from corpus.prepare import prepare
    from corpus.sources import LocalFilesSource
    from tests.test_pilot import DATA_DEFAULTS

    # 0.5: two documents, every second one (a.txt, ~600 tokens) held out, b.txt (~20 tokens) left to train;
    # 0.02: one document, split by tokens: 2% of ~600 to validation.
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    if val_fraction == 0.5:
        (tmp_path / "text" / "b.txt").write_text("The quick brown fox jumps over the lazy dog. " * 2)
    data = TokenDataModule(name="local", source=LocalFilesSource(str(tmp_path / "text")),
                           directory=str(tmp_path / "data"), seq_len=64, global_batch=2, micro_batch=2,
                           max_steps=1, seed=0, val_seed=None,
                           **{**DATA_DEFAULTS, "val_fraction": val_fraction})
    prepare(data.source, data.directory, val_fraction=val_fraction, progress=False)
    with pytest.raises(PreparedDataError,
                       match=rf"{short}.bin has \d+ tokens: too few for sequences of 64; use more data "
                             rf"or a shorter seq_len, or a {advice} data.val_fraction \(now {val_fraction}"):
        data.load()


def test_report_says_where_the_figures_of_several_runs_go(tmp_path: Path, monkeypatch, capsys) -> None:
    runs = []
    for name in ("layer", "rms"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "angles.jsonl").write_text(f'{{"model": "m", "norm": "{name}", "step": 0}}\n')
        runs.append(str(tmp_path / name))
    drawn: list[Path] = []  # the drawing itself is tested elsewhere: only where it goes matters here
    monkeypatch.setattr(report, "write_run_figures", lambda run_dir, layer, out_dir=None: [])
    monkeypatch.setattr(
        report, "plot_compare", lambda runs, out_dir, ref: drawn.append(out_dir) or out_dir / ref
    )
    monkeypatch.setattr(report, "write_norm_figures", lambda run_dirs, out_dir: [])
    assert report.main(runs) == 0
    assert (
        f"figures comparing the 2 runs go to {tmp_path / 'layer' / 'figures'} (the first run's "
        "figures folder; "
        "--out to choose another)"
    ) in capsys.readouterr().err
    assert report.main([*runs, "--out", str(tmp_path / "both")]) == 0
    assert f"figures comparing the 2 runs go to {tmp_path / 'both'}\n" in capsys.readouterr().err
    assert drawn == [tmp_path / "layer" / "figures"] * 3 + [tmp_path / "both"] * 3


def test_analyze_lists_no_probe_key_it_ignores_and_refuses_them() -> None:
    from normgeo.config.schema import AnalyzeSchema, TrainSchema, key_docs

    analyze, train = "\n".join(key_docs(AnalyzeSchema)), "\n".join(key_docs(TrainSchema))
    assert (
        "probe.enabled" not in analyze and "probe.batch_size" not in analyze and "model.batch_size" in analyze
    )
    assert "probe.enabled: bool = true" in train and "probe.batch_size: int >= 1 = 8" in train


def test_the_headline_launch_without_a_gpu_says_once_what_it_costs_and_what_to_run_instead() -> None:
    """Issue 64, class 6: ``train.py norm=rms size=1b`` on a CPU over the embedded pydoc corpus (~139k
    training tokens): one warning line with the passes over the data and the model on the CPU, and what to
    run instead (before: not a word); the smoke-sized default says nothing."""
    cfg = composed_train("norm=rms", "size=1b", "trainer=cpu")
    [line] = launch_cost(cfg, parameters=1_010_000_000, train_tokens=139_000, device="cpu",
                         precision="32-true")
    assert "50,000 steps of 65,536 tokens are ~23,574 passes over the 139,000 training tokens" in line, line
    assert "data=openwebtext" in line and "1,010M-parameter model trained in 32-true on the CPU" in line
    assert "a GPU machine (or size=tiny here)" in line
    # On a GPU over a large corpus, or the small default run: nothing to say.
    assert launch_cost(cfg, parameters=1_010_000_000, train_tokens=9_000_000_000, device="cuda",
                       precision="bf16-mixed") == []
    tiny = composed_train("size=tiny", "trainer=cpu")
    assert launch_cost(tiny, parameters=400_000, train_tokens=139_000, device="cpu",
                       precision="32-true") == []


@pytest.mark.slow
def test_the_costly_launch_warning_is_one_line_at_start(tmp_path: Path) -> None:
    """The same warning through train.py (the data's real token count): once, and the run goes on."""
    done = entry_point_here("train", [*FAST, f"run_dir={tmp_path / 'run'}", f"data_root={tmp_path / 'data'}",
                                      "size.max_steps=30000", "stop_at_step=1", "probe.enabled=false"])
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if "costly launch:" in line]
    assert len(said) == 1 and "passes over the" in said[0] and "data=openwebtext" in said[0], said
