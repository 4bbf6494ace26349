"""docs/notebooks/quickstart.ipynb runs from top to bottom (nbclient, offline, small sizes) and is committed
without outputs; it fails where any of normgeo's Python API calls it makes breaks."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT

NOTEBOOK = ROOT / "docs" / "notebooks" / "quickstart.ipynb"
# Small: 256 probe tokens in windows of 64, and a smoke run of 4 steps probed at 2 and 4.
SMALL = {"NORMGEO_NOTEBOOK_TOKENS": "256", "NORMGEO_NOTEBOOK_SEQ_LEN": "64",
         "NORMGEO_NOTEBOOK_TRAIN": "max_steps=4 checkpoint.steps=[2,4] seq_len=64 probe.tokens=512 "
                                   "log_every=1 val_every=1000 probe.figures=false"}


def test_the_notebook_is_committed_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


@pytest.mark.slow  # SmolLM2 (~25 s to load) in a kernel of its own, and a 4-step smoke run
def test_the_notebook_runs_top_to_bottom(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A failing cell raises CellExecutionError with its traceback.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "refused: null_directions=-1: expected int >= 0" in text
    assert "of the norms' inputs and outputs lie in the null band" in text
    images = [output for output in outputs if "image/png" in output.get("data", {})]
    # records.plot(), the saved null band and mean sources figures, the run's angles across steps
    assert len(images) == 4
