"""The bad-input table of docs/reliability.md is the contract: every row is tried here.

Every row composes in-process (Hydra ``compose`` + normgeo.config.schema's check, fast); the starred rows also
run through the scripts' Hydra main for the exit code and "nothing written", a few as real subprocesses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from corpus.__main__ import main as corpus_main
from normgeo.config.checks import check_config, unquoted_non_ascii
from normgeo.config.compose import ANALYZE_CONF_DIR, CONF_DIR
from normgeo.config.schema import ConfigError
from normgeo.plan import main as plan_main
from tests.conftest import ROOT, call_entry_point, entry_point_here

ROW = re.compile(
    r"^\| `(?P<script>train|analyze)\.py (?P<args>[^`]*)`(?P<star> \*)? \| `(?P<message>[^`]*)`.*\| "
    r"(?P<exit>\d) \|$"
)


def table_rows() -> list[dict]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text.split("<!-- bad-inputs:", 1)[1].split("\n\n", 1)[0]
    rows = [m.groupdict() for line in table.splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 25, "the bad-input table of docs/reliability.md lost rows"
    return rows


ROWS = table_rows()
# Refused by the entry point, not at compose time: a group option that does not exist (before Hydra
# composes, naming the options: normgeo.config.checks.unknown_group_option), and the start checks before the
# run directory is claimed (files, data, probe text, the run directory, the Trainer's argument types) or, for
# the values Lightning refuses, as train.py builds its Trainer, the start undone (normgeo/runs/start.py); run
# through the entry point (starred).
RUNTIME = (
    "norm=batch",
    "logger=[csv,nosuch]",
    "model=nosuch",
    "resume=/no/such.ckpt",
    "data=openwebtext",
    "trainer=ddp_cpu global_batch=12 micro_batch=4",
    "probe.tokens=100000000",
    "seq_len=10000 probe.tokens=20000",
    "run_dir=/dev/null/run",
    "data=local data.source.path=conf/train",
    "val_sequences=100000",
    "data=local data.source.path=/dev/zero",
    "model=checkpoint model.checkpoint=README.md",
    "trainer.devices=0",
    "trainer.num_nodes=0",
    "trainer.precision=fp8",
    "+trainer.max_epochs=abc",
    "+trainer.limit_val_batches=lots",
    "trainer.accelerator=tpuu",
    "trainer.strategy=dpp",
    "trainer=ddp_cpu trainer.strategy._target_=no.such.Strategy",
)


def refusal(script: str, args: str) -> str:
    """The message of the compose-time refusal of ``args``: Hydra's exception chain or the schema's check."""
    conf_dir = CONF_DIR if script == "train" else ANALYZE_CONF_DIR
    cwd = os.getcwd()
    os.chdir(ROOT)  # relative paths in the table (probe.path=conf/train) as the subprocesses see them
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(script, overrides=args.split())
        check_config(script, cfg)
    except ConfigError as err:
        return str(err)
    except Exception as err:  # Hydra's own: composition, override grammar, OmegaConf validation
        chain = [err]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        return "\n".join(str(e) for e in chain)
    finally:
        os.chdir(cwd)
    raise AssertionError(f"{script}.py {args} was accepted")


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r["args"] not in RUNTIME], ids=lambda r: f"{r['script']} {r['args']}"
)
def test_each_bad_input_is_refused_at_compose_time_with_its_message(row: dict) -> None:
    assert row["exit"] == "2"
    message = refusal(row["script"], row["args"])
    for part in row["message"].split(" ... "):  # " ... " stands for what varies (a count, a path)
        assert part in message, message


# The starred rows run through the scripts' Hydra main in this process (call_entry_point: the exit code and
# stderr a subprocess gets, a second instead of seven); these few also as real subprocesses, one per kind of
# refusal (Hydra's merge, the schema's check, a start check), for the process's own exit code.
SUBPROCESS_ROWS = (
    "optim.lr=abc",
    "trainer.devices=0",
    "data=local data.source.path=/dev/zero",
    "model.seq_len=0",
)


def check_refused(row: dict, code: int, stderr: str, output_root: Path, data_root: Path) -> None:
    assert code == int(row["exit"]), stderr[-3000:]
    for part in row["message"].replace("<data_root>", str(data_root)).split(" ... "):
        assert part in stderr, stderr[-3000:]
    assert not output_root.exists() or not any(output_root.iterdir()), sorted(output_root.rglob("*"))


def starred_args(row: dict, output_root: Path, data_root: Path) -> list[str]:
    args = [*row["args"].split(), f"output_root={output_root}"]
    return args + (["experiment=smoke", f"data_root={data_root}"] if row["script"] == "train" else [])


@pytest.mark.parametrize("row", [r for r in ROWS if r["star"]], ids=lambda r: f"{r['script']} {r['args']}")
def test_starred_bad_inputs_exit_2_and_leave_nothing_behind(row: dict, tmp_path: Path, capsys) -> None:
    output_root, data_root = tmp_path / "out", tmp_path / "data"
    code, stderr = call_entry_point(row["script"], starred_args(row, output_root, data_root), capsys)
    check_refused(row, code, stderr, output_root, data_root)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["star"] and r["args"] in SUBPROCESS_ROWS],
                         ids=lambda r: f"{r['script']} {r['args']}")
def test_starred_bad_inputs_as_real_processes(row: dict, tmp_path: Path) -> None:
    output_root, data_root = tmp_path / "out", tmp_path / "data"
    args = [sys.executable, str(ROOT / f"{row['script']}.py"), *starred_args(row, output_root, data_root)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    check_refused(row, done.returncode, done.stderr, output_root, data_root)


def test_every_subprocess_row_is_a_starred_row() -> None:
    assert set(SUBPROCESS_ROWS) <= {r["args"] for r in ROWS if r["star"]}


def test_every_runtime_row_is_run_through_the_entry_point() -> None:
    assert set(RUNTIME) <= {r["args"] for r in ROWS if r["star"]}


def test_every_train_key_has_a_doc_in_help() -> None:
    # train.py's main in this process (tests/test_scripts.py starts the command's help in a real one)
    done = entry_point_here("train", ["--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    groups = done.stdout.split("== Configuration groups ==")[1].split("==")[0]
    # analyze's presets stay out
    assert "model:" not in groups and "probe: local, pydoc, wikipedia, wikitext" in groups
    for line in (
        "optim.lr: float > 0 = (from conf/)  # peak learning rate",
        "checkpoint.steps: list[int >= 1] | null = null",
        "seed: int >= 0, <= 4294967295 = 0  # initial weights and dropout; also the batch order "
        "through data.seed",
        "optim.betas: list[float >= 0, < 1] (2 items) = [0.9, 0.95]  # AdamW betas",
    ):
        assert line in done.stdout


@pytest.mark.parametrize("script", ["train", "analyze"])
def test_a_non_ascii_value_outside_quotes_is_one_line_with_the_quoting_that_works(script: str, tmp_path: Path,
                                                                                 capsys) -> None:
    """Issue 34: Hydra's lexer stopped at the first non-ASCII character with an error naming no fix."""
    folder = tmp_path / "ünïcode"
    code, stderr = call_entry_point(script, [f"output_root={folder}"], capsys)
    assert code == 2 and stderr.strip() == (
        f"error: output_root={folder}: Hydra reads non-ASCII characters only inside quotes: write "
        f"output_root='{folder}' (in a shell: \"output_root='{folder}'\")")
    assert not folder.exists()
    assert unquoted_non_ascii([f"output_root='{folder}'", "norm=layer,rms", 'probe.path="é"']) is None


@pytest.mark.parametrize(
    ("script", "override", "named"),
    [("train", "max_stpes=10", "Could not override 'max_stpes'"),
     ("train", "optim.lr=abc", "optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
     ("analyze", "probe.tokenz=5", "Could not override 'probe.tokenz'")],
)
def test_hydras_own_errors_are_one_line_naming_the_override(script: str, override: str, named: str,
                                                            capsys) -> None:
    """Issue 64's walk: Hydra's last line was its HYDRA_FULL_ERROR advice, naming nothing; issue 76: its
    several lines of context came before ours."""
    code, stderr = call_entry_point(script, [override], capsys)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], stderr



@pytest.mark.parametrize(
    ("command", "args", "named"),
    [("plan", ["norm=layer,rms"], "norm=layer,rms: several values; normgeo.plan takes one per key"),
     ("plan", ["nosuch"], "nosuch: not an override; normgeo.plan takes key=value overrides"),
     ("corpus", ["nosuch"], "nosuch: not an override; python -m corpus takes key=value overrides"),
     ("corpus", ["verify", "data=pydoc,local"], "data=pydoc,local: several values; python -m corpus"),
     ("corpus", ["data=pydoc", "data_root=/proc/normgeo"], "cannot create the data folder /proc/normgeo"),
     ("corpus", ["data=pydoc", "data.tokenizer=nosuch", "data_root={tmp}"],
      "data.tokenizer=nosuch: no such tiktoken encoding")],
)
def test_the_commands_that_compose_one_config_say_what_is_wrong_in_one_line(
        command: str, args: list[str], named: str, tmp_path: Path, capfd) -> None:
    """Issue 75, class 9: Hydra's own words (plan's sweep: "Ambiguous value for argument"; a word that is not
    key=value: "missing EQUAL at '<EOF>'" and a link), and python -m corpus's tracebacks for a data folder
    that cannot be created and for its own tokenizer error, are one line of ours with exit 2."""
    main = plan_main if command == "plan" else corpus_main
    capfd.readouterr()
    code = main([arg.format(tmp=tmp_path) for arg in args])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"error: {named}"), err
    assert "Traceback" not in err and "hydra.cc" not in err
    assert not list(tmp_path.iterdir())  # nothing prepared, nothing left
