"""Input files and devices that are not what they claim, through the real entry points (train.py and
analyze.py in-process, tests/test_ranges.py's way): a FIFO or device as corpus, a corpus that is not UTF-8, a
file that is not a checkpoint, a CUDA device on a machine without one, an unknown tokenizer. Each: one line
naming the file or key and the fix, exit 2, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from corpus.sources import LocalFilesSource, SourceError
from tests.conftest import call_entry_point


class NotWeights:
    """Something torch.save pickles and weights_only loading refuses."""


LATIN1 = "Caf\xe9 cr\xe8me, na\xefve fa\xe7ade. " * 200  # é, è, ï, ç: one byte each in Latin-1, invalid UTF-8


def refused(script: str, args: list[str], tmp_path: Path, capsys) -> str:
    """The one error line of a refused ``script``.py run; nothing under tmp_path/out or tmp_path/data."""
    extra = [f"data_root={tmp_path / 'data'}"] if script == "train" else []
    code, err = call_entry_point(script, [*args, f"output_root={tmp_path / 'out'}", *extra], capsys)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert not (tmp_path / "out").exists()
    return errors[0]


@pytest.mark.parametrize("key", ["data.source.path", "probe.path"])
def test_a_fifo_as_corpus_is_named_as_a_fifo(key: str, tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    group = "data=local" if key.startswith("data") else "probe=local"
    line = refused("train", [group, f"{key}={fifo}"], tmp_path, capsys)
    assert (
        line == f"error: {key}={fifo}: a FIFO (named pipe), not a regular file; give a text file, a folder "
        "or a glob of them"
    )
    assert not (tmp_path / "data").exists()


def test_a_device_as_corpus_is_named_as_a_device(tmp_path: Path, capsys) -> None:
    line = refused("train", ["data=local", "data.source.path=/dev/zero"], tmp_path, capsys)
    assert line.startswith("error: data.source.path=/dev/zero: a character device, not a regular file")


def test_a_fifo_inside_a_corpus_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    os.mkfifo(folder / "b.txt")
    with pytest.raises(SourceError, match=r"b.txt is a FIFO \(named pipe\), not a regular file"):
        LocalFilesSource(str(folder)).check()


@pytest.mark.parametrize("script", ["train", "analyze"])
def test_a_latin1_corpus_is_refused_with_its_byte_offset(script: str, tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes(LATIN1.encode("latin-1"))
    args = (["data=local", f"data.source.path={corpus}"] if script == "train"
            else ["model=minilm", "probe=local", f"probe.path={corpus}", "probe.min_doc_tokens=0"])
    line = refused(script, args, tmp_path, capsys)
    node = "data.source" if script == "train" else "probe"
    assert line.startswith(
        f"error: {corpus}: not valid utf-8 at byte 3 (e9 20 63 72); convert the file (e.g. iconv "
        f"-f latin1 -t utf-8) or set {node}.encoding=latin-1 (its real encoding)"
    )
    assert not (tmp_path / "data").exists()


def test_the_encoding_option_reads_a_latin1_corpus(tmp_path: Path) -> None:
    (tmp_path / "latin1.jsonl").write_bytes(('{"text": "' + LATIN1 + '"}\n').encode("latin-1"))
    source = LocalFilesSource(str(tmp_path), encoding="latin-1")
    assert list(source.documents()) == [LATIN1]
    assert source.describe().endswith("(encoding: latin-1)")
    with pytest.raises(SourceError, match=r"latin1.jsonl: not valid utf-8 at byte 13 "):
        list(LocalFilesSource(str(tmp_path)).documents())
    with pytest.raises(SourceError, match=r"data.source.encoding=klingon: no such text encoding"):
        list(LocalFilesSource(str(tmp_path), encoding="klingon").documents())


def test_a_file_that_is_not_a_checkpoint_gets_its_own_line(tmp_path: Path, capsys) -> None:
    not_a_checkpoint = tmp_path / "notes.ckpt"
    not_a_checkpoint.write_text("these are notes, not weights\n")
    line = refused("analyze", ["model=checkpoint", f"model.checkpoint={not_a_checkpoint}", "progress=false"],
                   tmp_path, capsys)
    assert line == (
        f"error: model.checkpoint={not_a_checkpoint}: not a PyTorch checkpoint (not a zip archive); give "
        "a .ckpt of a train.py run, <run_dir>/checkpoints/step-XXXXXXX.ckpt or last.ckpt"
    )


def test_a_zip_that_is_not_a_checkpoint_gets_one_line(tmp_path: Path, capsys) -> None:
    """A real torch file of something else (a pickled object weights_only refuses): torch's paragraphs of
    advice become one line."""
    other = tmp_path / "other.ckpt"
    torch.save({"state": NotWeights()}, other)
    line = refused(
        "analyze", ["model=checkpoint", f"model.checkpoint={other}", "progress=false"], tmp_path, capsys
    )
    assert line.startswith(f"error: model.checkpoint={other}: not a train.py checkpoint (UnpicklingError: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("script", "args", "message"), [
    ("analyze", ["device=cuda"], "error: device=cuda: no CUDA GPU on this machine ("),
    ("analyze", ["device=cuda:1"], "error: device=cuda:1: no CUDA GPU on this machine ("),
    ("train", ["trainer=gpu"], "error: trainer.accelerator=gpu: no CUDA GPU on this machine ("),
    ("train", ["trainer=ddp"], "error: trainer.accelerator=gpu: no CUDA GPU on this machine ("),
])
def test_a_cuda_device_on_a_machine_without_cuda_gets_one_line(script: str, args: list[str], message: str,
                                                              tmp_path: Path, capsys) -> None:
    line = refused(script, args, tmp_path, capsys)
    assert line.startswith(message) and line.endswith(
        "on this machine" if script == "train" else "(or device=auto)"
    )
    assert not (tmp_path / "data").exists()


def test_an_unknown_device_name_is_refused_with_the_choices(tmp_path: Path, capsys) -> None:
    assert refused("analyze", ["device=gpu0"], tmp_path, capsys) == \
        "error: device=gpu0: expected auto, cpu, cuda or cuda:N"


def test_an_unknown_tokenizer_is_named_not_blamed_on_the_cache(tmp_path: Path, capsys) -> None:
    line = refused("train", ["data.tokenizer=nosuch"], tmp_path, capsys)
    assert line.startswith("error: data.tokenizer=nosuch: no such tiktoken encoding; choose one of gpt2, ")
    assert "TIKTOKEN_CACHE_DIR" not in line
    assert not (tmp_path / "data").exists()
