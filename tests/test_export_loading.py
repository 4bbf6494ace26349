"""Issue 34: exports load as users load them and leave the user's files as they were (through
``python -m normgeo.export`` on hand-made checkpoints of the layout train.py saves).

- the tiktoken cache folder lists the same files before and after an export (before: one new 835 KB file per
  export, transformers' TikTokenConverter copying its temporary ranks file into ``$TIKTOKEN_CACHE_DIR``);
- ``AutoTokenizer.from_pretrained(dir)`` on an RMSNorm or DyT export (custom model code) loads GPT-2's tokenizer
  with standard input closed, without ``trust_remote_code`` and without asking.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SHARED
from tests.test_export_cli import hand_checkpoint

pytestmark = pytest.mark.slow  # a python -m normgeo.export per case (transformers' import, the BPE merges)


def export(run: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "normgeo.export", str(run), "--to", "hf", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL)


def test_an_export_leaves_the_tiktoken_cache_as_it_found_it(tmp_path: Path) -> None:
    cache = tmp_path / "tiktoken"
    shutil.copytree(SHARED / "tiktoken", cache)  # a copy: the shared folder is never written
    before = sorted(p.name for p in cache.iterdir())
    hand_checkpoint(tmp_path / "run" / "checkpoints" / "step-0000005.ckpt", "rms")
    for out in ("a", "b"):  # each export used to add one file
        result = export(tmp_path / "run", tmp_path / out, {"TIKTOKEN_CACHE_DIR": str(cache)})
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / out / "tokenizer.json").is_file()
    assert sorted(p.name for p in cache.iterdir()) == before
