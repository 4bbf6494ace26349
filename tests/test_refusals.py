"""One kind of refusal (corpus.refusal.Refusal): a user's mistake is one line and exit 2; anything else is a
bug and keeps its traceback with exit 1, wherever it is raised. Before: a bug in the data module's
constructor was Hydra's one line ``Error in call to target 'corpus.datamodule.TokenDataModule'``, exit 1,
no traceback; the user's errors were listed three times (START_ERRORS, REFUSALS, USER_ERRORS)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from corpus import __main__ as corpus_command
from corpus.sources import LocalFilesSource
from tests.conftest import FAST, ROOT, train_in_process

# A bug injected where it is named, then train.py's main (a process of its own: each run its own patch).
BUGGY_TRAIN = """
import sys
sys.path.insert(0, {root!r})
import callbacks.angle_probe, corpus.datamodule, models.lit

where = sys.argv.pop(1)


def bug(*args, **kwargs):
    raise RuntimeError(f"a bug in {{where}}")


owner, name = {{"data module": (corpus.datamodule.TokenDataModule, "__init__"),
               "LightningModule": (models.lit.LitGPT, "__init__"),
               "callback setup": (callbacks.angle_probe.AngleProbe, "setup")}}[where]
setattr(owner, name, bug)
import train
sys.argv = ["train.py", *sys.argv[1:]]
train.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["data module", "LightningModule", "callback setup"])
def test_a_bug_in_a_constructor_or_a_callback_keeps_its_traceback(where: str, tmp_path: Path) -> None:
    script = tmp_path / "buggy_train.py"
    script.write_text(BUGGY_TRAIN.format(root=str(ROOT)))
    run_dir = tmp_path / "run"
    args = [*FAST, "max_steps=2", f"run_dir={run_dir}", f"data_root={tmp_path / 'data'}"]
    done = subprocess.run([sys.executable, str(script), where, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback (most recent call last)" in done.stderr, done.stderr[-3000:]
    assert f"RuntimeError: a bug in {where}" in done.stderr, done.stderr[-3000:]
    assert "Error in call to target" not in done.stderr and "error: a bug" not in done.stderr
    assert not run_dir.exists()  # a start that failed before its first optimizer step is undone


def test_a_bad_config_key_is_still_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    done = train_in_process(tmp_path / "run", "max_step=3", capsys=capsys)
    last = done.stderr.strip().splitlines()[-1]  # after Hydra's own account of the key
    assert done.returncode == 2 and last.startswith("error: Could not override 'max_step'"), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_bug_in_a_corpus_source_keeps_its_traceback_a_missing_path_is_one_line(tmp_path: Path,
                                                                               monkeypatch, capsys) -> None:
    """python -m corpus builds its source through the same ``build`` as train.py: a source constructor's bug
    was Hydra's one line with exit 2 (a HydraException), as if the config were wrong."""
    args = ["data=local", f"data.source.path={tmp_path / 'nowhere'}", f"data_root={tmp_path / 'data'}"]
    assert corpus_command.main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")

    def bug(*args, **kwargs) -> None:
        raise RuntimeError("a bug in the source")

    monkeypatch.setattr(LocalFilesSource, "__init__", bug)
    with pytest.raises(RuntimeError, match="a bug in the source"):
        corpus_command.main(args)
