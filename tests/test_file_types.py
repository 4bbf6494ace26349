"""Files read as something they are not: data=local and probe=local read the documented types only.

A ``.csv`` or ``.py`` file used to be tokenized as prose without a word; now such files are refused,
all named in one line with the option that reads them as plain text, before anything is written.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from corpus.prepare import load_prepared, prepare
from corpus.sources import LocalFilesSource, SourceError
from corpus.tokenize import tiktoken_encoding
from normgeo.config.checks import check_config
from normgeo.config.compose import ANALYZE_CONF_DIR, CONF_DIR
from normgeo.config.schema import ConfigError
from tests.conftest import ROOT, train_here, train_in_process

CSV_ROW = "Another row of comma separated text about the quick brown fox"
PROSE = "The quick brown fox jumps over the lazy dog, again and again. " * 200


def csv_and_py(folder: Path) -> Path:
    """A folder of two .csv files and a .py file: three files no documented reader reads."""
    folder.mkdir(parents=True)
    for name in ("a.csv", "b.csv"):
        (folder / name).write_text("id,text\n" + "".join(f'{i},"{CSV_ROW} {i}"\n' for i in range(200)))
    (folder / "c.py").write_text("def f():\n    return 1\n" * 50)
    return folder


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def corpus_command(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "corpus", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def decoded(directory: Path) -> str:
    data = load_prepared(directory)
    return "".join(
        tiktoken_encoding("gpt2").decode(data.tokens(split).tolist()) for split in ("train", "val")
    )


# The source itself


def test_other_types_are_refused_in_one_line_naming_each_type_and_the_option(tmp_path: Path) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    with pytest.raises(SourceError) as refused:
        LocalFilesSource(str(folder)).check()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"data.source.path={folder}: 3 files of unsupported types (.csv: 2, .py: 1); supported: "
    )
    assert message.endswith("set data.source.plain_text_extensions=[.csv,.py]")
    # The probe's source names the probe's keys; a single file is refused as well.
    with pytest.raises(SourceError, match=r"^probe.path=.*a.csv: 1 file of an unsupported type \(.csv: 1\).*"
                                          r"probe.plain_text_extensions=\[.csv\]$"):
        list(LocalFilesSource(str(folder / "a.csv"), config_node="probe").documents())


def test_a_folder_mixing_text_and_csv_is_refused_not_silently_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "book.txt").write_text(PROSE)
    (folder / "table.csv").write_text("id,text\n1,hello\n")
    with pytest.raises(SourceError, match=r"1 file of an unsupported type \(.csv: 1\)"):
        list(LocalFilesSource(str(folder)).documents())
    with pytest.raises(SourceError, match="1 file of an unsupported type"):  # a glob that matches both too
        list(LocalFilesSource(str(folder / "*")).documents())


def test_the_option_reads_other_extensions_as_plain_text(tmp_path: Path) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    source = LocalFilesSource(str(folder), plain_text_extensions=["csv", ".PY"])  # with or without the dot
    documents = list(source.documents())
    assert len(documents) == 3 and CSV_ROW in documents[0] and "def f()" in documents[2]
    assert source.describe() == f"local:{folder} (plain text: .csv, .py)"  # another corpus than the default's
    # unchanged: prepared data stays valid
    assert LocalFilesSource(str(folder)).describe() == f"local:{folder}"
    assert LocalFilesSource(str(folder), plain_text_extensions=".csv,py").extra_plain_text == (".csv", ".py")
    with pytest.raises(SourceError, match=r"\(.py: 1\).*plain_text_extensions=\[.csv,.py\]$"):  # all to list
        LocalFilesSource(str(folder), plain_text_extensions=[".csv"]).check()


def test_readme_and_license_files_in_a_folder_are_skipped_with_a_note(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "book.txt").write_text(PROSE)
    (folder / "README.md").write_text("# How this corpus was made")
    (folder / "LICENSE").write_text("MIT")
    with caplog.at_level(logging.WARNING, logger="corpus.sources"):
        assert list(LocalFilesSource(str(folder)).documents()) == [PROSE]
    assert "skipped LICENSE, README.md" in caplog.text
    with pytest.raises(SourceError, match=r"\(.md: 1\)"):  # named on its own, a README is read by its type
        LocalFilesSource(str(folder / "README.md")).check()
    assert list(LocalFilesSource(str(folder / "README.md"), plain_text_extensions=[".md"]).documents()) == [
        "# How this corpus was made"
    ]


def test_the_shared_corpora_still_load(shared: Path, caplog) -> None:
    corpora = shared / "corpora"
    assert len(LocalFilesSource(str(corpora / "webtext")).files()) == 3  # .jsonl
    assert len(LocalFilesSource(str(corpora / "wikipedia")).files()) == 6  # wiki_00 (no extension), .raw
    with caplog.at_level(logging.WARNING, logger="corpus.sources"):
        assert len(LocalFilesSource(str(corpora)).files()) == 9  # the folder's README.md skipped, with a note
    assert "skipped README.md" in caplog.text


def test_a_refused_prepare_writes_nothing_and_leaves_a_prepared_folder_as_it_was(tmp_path: Path) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    data = tmp_path / "data" / "local-mixed"
    with pytest.raises(SourceError):
        prepare(LocalFilesSource(str(folder)), data, progress=False)
    assert not (tmp_path / "data").exists()  # not even the data_root a first prepare would create
    prepare(LocalFilesSource(str(folder), plain_text_extensions=[".csv", ".py"]), data, progress=False)
    before = snapshot(data)
    with pytest.raises(SourceError):  # the same folder without the option: another corpus, refused
        prepare(LocalFilesSource(str(folder)), data, progress=False)
    assert snapshot(data) == before  # meta.json kept: the earlier prepare still counts


# The real entry points


def test_python_m_corpus_refuses_other_types_and_prepares_them_with_the_option(tmp_path: Path) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    data_root = tmp_path / "data"
    args = ["data=local", f"data.source.path={folder}", f"data_root={data_root}"]
    refused = corpus_command(*args)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = error_lines(refused.stderr)
    assert "3 files of unsupported types (.csv: 2, .py: 1)" in line
    assert line.endswith("data.source.plain_text_extensions=[.csv,.py]")
    assert not data_root.exists()
    done = corpus_command(*args, "data.source.plain_text_extensions=[.csv,.py]")
    assert done.returncode == 0, done.stderr[-2000:]
    (prepared,) = data_root.glob("local-*")
    assert f"{CSV_ROW} 7" in decoded(prepared) and "def f():" in decoded(prepared)


@pytest.mark.slow
def test_train_refuses_other_types_before_writing_and_trains_on_them_with_the_option(
    tmp_path: Path, capsys
) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    run_dir, data_root = tmp_path / "run", tmp_path / "data"
    args = (
        "data=local",
        f"data.source.path={folder}",
        "data.val_fraction=0.05",
        "max_steps=2",
        "probe.enabled=false",
    )
    refused = train_in_process(run_dir, *args, capsys=capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = error_lines(refused.stderr)
    assert "3 files of unsupported types (.csv: 2, .py: 1)" in line
    assert not run_dir.exists() and not data_root.exists()
    train_here(run_dir, *args, "data.source.plain_text_extensions=[.csv,.py]")
    (prepared,) = data_root.glob("local-*")
    assert f"{CSV_ROW} 7" in decoded(prepared)
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_probe_local_refuses_other_types_before_writing(tmp_path: Path, capsys) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    run_dir = tmp_path / "run"
    refused = train_in_process(run_dir, "probe=local", f"probe.path={folder}", "max_steps=2", capsys=capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = error_lines(refused.stderr)
    assert line.endswith(
        "3 files of unsupported types (.csv: 2, .py: 1); supported: .jsonl, .json, .parquet, "
        ".txt, .raw, no extension; to read other extensions as plain text set "
        "probe.plain_text_extensions=[.csv,.py]"
    )
    assert not run_dir.exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize(("script", "conf_dir"), [("train", CONF_DIR), ("analyze", ANALYZE_CONF_DIR)])
def test_probe_plain_text_extensions_reads_them_in_train_and_analyze(
    tmp_path: Path, script: str, conf_dir: str
) -> None:
    folder = csv_and_py(tmp_path / "mixed")
    overrides = ["probe=local", f"probe.path={folder}"]
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        refused = compose(script, overrides=overrides)
        allowed = compose(script, overrides=[*overrides, "probe.plain_text_extensions=[.csv,.py]"])
    with pytest.raises(ConfigError, match=r"^probe.path=.*probe.plain_text_extensions=\[.csv,.py\]$"):
        check_config(script, refused)
    check_config(script, allowed)
    documents = list(instantiate(allowed.probe.source).sampled_documents(allowed.probe.seed))
    assert sum(CSV_ROW in doc for doc in documents) == 2 and len(documents) == 3
    assert np.any(["def f()" in doc for doc in documents])
