"""The console commands of pyproject.toml's [project.scripts]: each target imports and has its own help."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
HYDRA_APPS = ("normgeo-train", "normgeo-analyze")


def test_the_four_commands_of_the_issue_are_declared() -> None:
    assert {"normgeo-train", "normgeo-analyze", "normgeo-compare", "normgeo-status"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - set(HYDRA_APPS)))
def test_argparse_command_has_its_own_help(name: str, capsys, monkeypatch) -> None:
    module, function = SCRIPTS[name].split(":")
    monkeypatch.setattr(sys, "argv", [name, "--help"])  # as the installed script calls it
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(module), function)()
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {name}")


@pytest.mark.parametrize("name", HYDRA_APPS)
@pytest.mark.slow
def test_hydra_command_resolves_and_prints_its_config_help(name: str) -> None:
    module, function = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}; {function}()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Configuration groups" in done.stdout or "== Config ==" in done.stdout, done.stdout[:500]
