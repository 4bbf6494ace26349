"""Every numeric key's range is declared once in the schema (normgeo/config/schema.py: its type, as ``Count``
or ``Annotated[float, Interval(...)]``) and enforced through the real entry points by pydantic: for each
key a value outside its range, NaN and inf give one line naming the key, exit 2 and no folder. The quick
tier calls train.py's and analyze.py's Hydra entry points in-process (a subprocess per case would take
minutes); a few of the same cases run as real subprocesses (slow)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Len
from hydra import compose, initialize_config_dir

from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import AnalyzeSchema, TrainSchema, costly_values
from tests.conftest import ROOT, call_entry_point

SCRIPTS = {"train": TrainSchema, "analyze": AnalyzeSchema}


@dataclass(frozen=True)
class NumericKey:
    key: str
    integer: bool
    is_list: bool
    bounds: dict[str, float]  # ge / gt / le / lt, from the type's constraints


def numeric_keys(schema: type, prefix: str = "") -> list[NumericKey]:
    """Every int or float key of a schema (nested nodes, optional and list types unwrapped), with its
    bounds."""
    found = []
    hints = typing.get_type_hints(schema, include_extras=True)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):
            found += numeric_keys(f.default_factory, f"{prefix}{f.name}.")
            continue
        hint, bounds, is_list = hints[f.name], {}, False
        while True:
            args = typing.get_args(hint)
            if typing.get_origin(hint) is Annotated:
                for limit in args[1:]:
                    if not isinstance(limit, Len):
                        bounds |= {
                            b: getattr(limit, b)
                            for b in ("ge", "gt", "le", "lt")
                            if getattr(limit, b, None) is not None
                        }
                hint = args[0]
            elif typing.get_origin(hint) in (typing.Union, types.UnionType):
                hint = next(a for a in args if a is not type(None))
            elif typing.get_origin(hint) is list:
                hint, is_list = args[0], True
            else:
                break
        if hint in (int, float):
            found.append(NumericKey(f"{prefix}{f.name}", hint is int, is_list, bounds))
    return found


def introspected_numeric_keys(schema: type, prefix: str = "") -> set[str]:
    """The numeric keys of a schema found from its dataclass fields' types as written (not via the walker)."""
    keys: set[str] = set()
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):
            keys |= introspected_numeric_keys(f.default_factory, f"{prefix}{f.name}.")
        elif any(
            word in str(f.type)
            for word in ("int", "float", "Count", "Natural", "Seed", "Positive", "Fraction", "NonNegative")
        ):
            keys.add(f"{prefix}{f.name}")
    return keys


def outside(spec: NumericKey) -> str:
    """A value just outside the key's range (below its lower bound, else above its upper bound)."""
    b: dict[str, Any] = spec.bounds
    value = (b["ge"] - 1 if "ge" in b else b["gt"] if "gt" in b else b["le"] + 1 if "le" in b else b["lt"])
    text = str(int(value)) if spec.integer else str(float(value))
    return f"[{text}]" if spec.is_list else text


def cases() -> list:
    """(script, key, value) for every numeric key: a value outside its range, and for every float key NaN and
    inf, which pydantic refuses. An integer key's NaN and inf are refused by Hydra's type check, the same code
    path for every key: its first integer key and first integer list per script (slow-marked; every
    integer key took ~100 cases)."""
    found = []
    for script, schema in SCRIPTS.items():
        hydra_checked: set[bool] = set()  # the integer kinds (list or not) already given their NaN and inf
        for spec in numeric_keys(schema):
            found.append(
                pytest.param(script, spec.key, outside(spec), id=f"{script}:{spec.key}={outside(spec)}")
            )
            if spec.integer and spec.is_list in hydra_checked:
                continue
            if spec.integer:
                hydra_checked.add(spec.is_list)
            for value in ("nan", "inf"):
                text = f"[{value}]" if spec.is_list else value
                marks = [pytest.mark.slow] if spec.integer else []
                found.append(
                    pytest.param(script, spec.key, text, marks=marks, id=f"{script}:{spec.key}={text}")
                )
    return found


CASES = cases()


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_key_has_a_declared_range(script: str) -> None:
    """A new numeric key without a range fails here: the walker sees exactly the keys the types say are
    numeric, and each has a bound."""
    schema = SCRIPTS[script]
    walked = numeric_keys(schema)
    assert {spec.key for spec in walked} == introspected_numeric_keys(schema)
    assert [spec.key for spec in walked if not spec.bounds] == []
    assert {case.values[1] for case in CASES if case.values[0] == script} == {spec.key for spec in walked}


@pytest.mark.parametrize(("script", "key", "value"), CASES)
def test_out_of_range_nan_and_inf_are_refused_by_the_entry_point(
    script: str, key: str, value: str, tmp_path: Path, capsys
) -> None:
    output_root, data_root = tmp_path / "out", tmp_path / "data"
    extra = [f"data_root={data_root}"] if script == "train" else []
    code, err = call_entry_point(script, [f"{key}={value}", f"output_root={output_root}", *extra], capsys)
    assert code == 2, err
    # One line naming the key: the schema's checker ("expected ..."), or Hydra's own type error for nan or
    # inf given to an integer key, which Hydra alone would print as several lines.
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], err
    assert "expected" in lines[0] or "could not be converted" in lines[0], err
    assert not output_root.exists() and not data_root.exists()


def check_train_refusal(overrides: list[str], tmp_path: Path, capsys) -> str:
    """The one error line of a refused train.py (after the data preparation's progress bar, if any)."""
    output_root = tmp_path / "out"
    code, err = call_entry_point("train", [*overrides, f"output_root={output_root}",
                                           f"data_root={tmp_path / 'data'}"], capsys)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert not output_root.exists()
    return errors[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["checkpoint.steps=[100,500]"],
            "error: checkpoint.steps=[100, 500]: step 500 is beyond max_steps=200",
        ),
        (
            ["probe.tokens=300"],
            "error: probe.tokens=300: expected at least 2 sequences of seq_len=256 (512 tokens)",
        ),
        (
            ["probe.bootstrap.block=9"],
            "error: probe.bootstrap.block=9: the probe's 16 sequences (probe.tokens=4096 / "
            "seq_len=256) make fewer than 2 whole blocks",
        ),
        (
            ["probe.min_doc_tokens=64", "probe.max_doc_tokens=32"],
            "error: probe.max_doc_tokens=32: below probe.min_doc_tokens=64",
        ),
    ],
)
def test_cross_key_rules_are_refused_by_the_entry_point(overrides: list[str], message: str, tmp_path: Path,
                                                        capsys) -> None:
    assert check_train_refusal(overrides, tmp_path, capsys).startswith(message)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["experiment=smoke", "max_steps=3"],
            "optim.warmup_steps=20 is not fewer than max_steps=3: the learning rate "
            "rises for the whole run and never reaches its peak",
        ),
        (
            ["experiment=smoke", "max_steps=4", "optim.warmup_steps=4"],
            "reaches its peak only at the last step",
        ),
    ],
)
def test_a_warm_up_as_long_as_the_run_is_odd_not_refused(overrides: list[str], words: str, tmp_path: Path,
                                                         capsys) -> None:
    """Issue 34: `python train.py experiment=smoke max_steps=10` was refused (the
    preset warms up for 20 steps); now one warning line at start (read from the run's
    train.log, which holds what the console shows), and the run trains to its end."""
    run_dir = tmp_path / "run"
    code, err = call_entry_point(
        "train",
        [
            *overrides,
            f"run_dir={run_dir}",
            f"data_root={tmp_path / 'data'}",
            "probe.enabled=false",
            "trainer.enable_progress_bar=false",
        ],
        capsys,
    )
    assert code == 0, err[-3000:]
    (line,) = [line for line in (run_dir / "train.log").read_text().splitlines() if "odd: " in line]
    assert words in line and "(0: none) warms up, then decays" in line
    assert json.loads((run_dir / "summary.json").read_text())["finished"]


def test_more_validation_windows_than_the_split_holds_are_refused_once_the_data_is_prepared(tmp_path: Path,
                                                                                          capsys) -> None:
    """pydoc's validation split has 5,031 tokens: 100,000 windows of 128 could only repeat them."""
    err = check_train_refusal(["experiment=smoke", "val_sequences=100000"], tmp_path, capsys)
    assert err.startswith(
        "error: val_sequences=100000: expected at most 4,903: the validation split holds 5,031 tokens"
    ), err


@pytest.mark.slow
def test_analyze_applies_the_probe_rule_with_the_models_own_seq_len(tmp_path: Path, capsys) -> None:
    """all-MiniLM-L6-v2 reads 512 positions: model.seq_len=1024 is capped, and 600 probe tokens are 2
    sequences of 512 only in name (the second one 88 tokens)."""
    output_root = tmp_path / "out"
    code, err = call_entry_point(
        "analyze",
        ["model=minilm", "probe=pydoc", "probe.tokens=600", "progress=false", f"output_root={output_root}"],
        capsys,
    )
    assert code == 2, err
    assert err.strip().splitlines()[-1] == ("error: probe.tokens=600: expected at least 2 sequences of "
                                            "model.seq_len=512 (1024 tokens); raise probe.tokens")
    assert not output_root.exists()


def test_costly_values_get_one_line_each_above_their_threshold() -> None:
    def composed(*overrides: str) -> TrainSchema:
        return check_config("train", compose("train", overrides=["experiment=smoke", *overrides]))

    tiny = 1_000_000  # parameters: 12 MB a full checkpoint
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        smoke = composed()
        costly = composed("val_sequences=100000", "probe.tokens=1000000")
        long = composed("max_steps=1000000")
        dense = composed("checkpoint.dense_every=1", "probe.tokens=1024")
        knobs = composed("probe.null_directions=50000", "probe.bootstrap.replicates=200000")
    assert costly_values(smoke, probes=5, checkpoints=4, parameters=tiny) == []
    lines = costly_values(costly, probes=5, checkpoints=4, parameters=tiny)
    assert [line.split("=")[0] for line in lines] == ["val_sequences", "probe.tokens"]
    assert lines[0] == (
        "val_sequences=100000: each of the 2 validation(s) forwards 12,800,000 tokens, the compute of "
        "about 4,167 training steps (8333% of the training's)"
    )
    assert lines[1].startswith("probe.tokens=1000000: each of the 5 probes (one at every scheduled step: "
                               "checkpoint.dense_every=25 to dense_until=100, sparse_every=100) forwards")
    assert costly_values(long, probes=44, checkpoints=43, parameters=tiny) == [
        "max_steps=1000000: 1,024,000,000 training tokens, 5,000x the 200 steps of size=tiny"]
    # Issue 75, class 7: the probe's own knobs and the disk are counted, and a schedule's many probes name
    # the schedule (before: dense_every=1 warned about probe.tokens alone).
    dense_lines = costly_values(dense, probes=101, checkpoints=100, parameters=tiny)
    assert len(dense_lines) == 1 and "checkpoint.dense_every=1 to dense_until=100" in dense_lines[0]
    knob_lines = costly_values(knobs, probes=5, checkpoints=4, parameters=tiny)
    assert [line.split(":")[0] for line in knob_lines] == [
        "probe.null_directions=50000", "probe.bootstrap.replicates=200000"]
    assert costly_values(long, probes=44, checkpoints=1_003, parameters=13_000_000)[-1] == (
        "checkpoint: the schedule keeps 1,003 checkpoints of 0.05 GB and last.ckpt, about 52.3 GB; a larger "
        "checkpoint.sparse_every or dense_every keeps fewer")
    assert costly_values(smoke, probes=5, checkpoints=4, parameters=tiny, free_bytes=10**6) == [
        "checkpoint: the schedule keeps 4 checkpoints of 0.00 GB and last.ckpt, about 0.0 GB, more than the "
        "0.0 GB free there; a larger checkpoint.sparse_every or dense_every keeps fewer"]


# One real process per kind of refusal (a range, a list element, Hydra's own type error, analyze.py's): every
# key's out-of-range value and every float key's nan and inf are refused in this process above (a process
# costs seconds of imports).
@pytest.mark.slow
@pytest.mark.parametrize(("script", "override", "message"), [
    ("train", "optim.lr=nan", "error: optim.lr=nan: expected a finite float > 0"),
    ("train", "optim.betas=[0.9,1.0]", "error: optim.betas[1]=1.0: expected float >= 0, < 1"),
    ("train", "max_steps=inf", "error: Error merging override max_steps=inf: Value 'inf' of type 'float' "
                               "could not be converted to Integer"),
    ("analyze", "probe.bootstrap.replicates=0", "error: probe.bootstrap.replicates=0: expected int >= 1"),
])
def test_real_subprocesses_refuse_with_one_line(
    script: str, override: str, message: str, tmp_path: Path
) -> None:
    args = [sys.executable, str(ROOT / f"{script}.py"), override, f"output_root={tmp_path / 'out'}"]
    if script == "train":
        args.append(f"data_root={tmp_path / 'data'}")
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == message, done.stderr[-3000:]  # Hydra's own errors too: one line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("group", ["experiment", "size"])
def test_every_shipped_preset_is_within_the_ranges(group: str, shared: Path) -> None:
    """A range tighter than a value conf/ ships (size=study_cpu's gpus: 0, a CPU-only SLURM job) fails
    here."""
    local = [
        f"data.source.path={shared / 'corpora' / 'webtext'}",
        f"probe.path={shared / 'corpora' / 'wikipedia'}",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for preset in sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")):
            extra = local if preset == "study_cpu" and group == "experiment" else []
            check_config("train", compose("train", overrides=[f"{group}={preset}", *extra]))
