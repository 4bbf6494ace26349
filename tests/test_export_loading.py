"""Issue 34: exports load as users load them and leave the user's files as they were (through
``python -m normgeo.export`` on hand-made checkpoints of the layout train.py saves).

- the tiktoken cache folder lists the same files before and after an export (before: one new 835 KB file per
  export, transformers' TikTokenConverter copying its temporary ranks file into ``$TIKTOKEN_CACHE_DIR``);
- an RMSNorm or DyT export (custom model code) loads its tokenizer as its model card says, with standard input
  closed and without running or asking about custom code, and the card says when ``trust_remote_code=True`` is
  needed and why. (A bare ``AutoTokenizer.from_pretrained(dir)`` still asks: transformers 5 reads
  ``config.json`` before the tokenizer's files, and only a model type of its own, which would let
  ``AutoModelForCausalLM`` load a plain GPT-2 over these weights, avoids that.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corpus.tokenize import tiktoken_encoding
from tests.conftest import ROOT, SHARED, module_main
from tests.test_export_cli import hand_checkpoint

pytestmark = pytest.mark.slow  # new interpreters: the tokenizer loaders, the exports with their own cache


def export(run: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "normgeo.export", str(run), "--to", "hf", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


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


LOADERS = {  # what the card says, and AutoTokenizer told that no code is to run
    "card": "GPT2TokenizerFast.from_pretrained(DIR)",
    "auto": "AutoTokenizer.from_pretrained(DIR, trust_remote_code=False)",
}
TEXT = "The norm of a vector, and its angle with 1."


@pytest.mark.parametrize("norm", ["rms", "dyt"])
def test_the_tokenizer_of_a_custom_code_export_loads_without_custom_code(tmp_path: Path, norm: str,
                                                                          capfd) -> None:
    hand_checkpoint(tmp_path / "run" / "checkpoints" / "step-0000005.ckpt", norm)
    out = tmp_path / "out"
    result = module_main(capfd, "export", tmp_path / "run", "--to", "hf", "--out", out)  # in this process
    assert result.returncode == 0, result.stderr[-3000:]
    card = (out / "README.md").read_text()
    assert (
        "GPT2TokenizerFast.from_pretrained" in card
        and "`trust_remote_code=True` is needed for the model only" in card
    )
    for name, loader in LOADERS.items():
        code = (f"from transformers import AutoTokenizer, GPT2TokenizerFast; DIR = {str(out)!r}; "
                f"print(type({loader}).__name__, {loader}({TEXT!r})['input_ids'])")
        loaded = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL, env=dict(os.environ))
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        said = loaded.stdout + loaded.stderr
        assert "custom code" not in said and "[y/N]" not in said, (name, said)
        assert loaded.stdout.split(" ", 1)[1].strip() == str(
            tiktoken_encoding("gpt2").encode_ordinary(TEXT)
        ), name
