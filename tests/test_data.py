"""Data preparation on real text with the real GPT-2 tokenizer: idempotent, atomic, verified on load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from corpus.prepare import META_FILE, PreparedDataError, load_prepared, prepare
from corpus.sources import HubParquetSource, LocalFilesSource, PydocSource, SourceError
from corpus.tokenize import tiktoken_encoding


@pytest.fixture(scope="module")
def webtext(shared: Path, tmp_path_factory) -> tuple[LocalFilesSource, Path]:
    source = LocalFilesSource(str(shared / "corpora" / "webtext"))
    directory = tmp_path_factory.mktemp("webtext")
    prepare(source, directory, progress=False)
    return source, directory


def test_local_jsonl_is_tokenized_with_gpt2_and_eot_between_documents(webtext) -> None:
    source, directory = webtext
    data = load_prepared(directory)
    meta = data.meta
    assert meta["tokenizer"] == "gpt2" and meta["eot_token"] == 50256 and meta["dtype"] == "uint16"
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    documents = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert documents == 1408 + 1000 + 426  # every jsonl line of the three files
    # The shared README counts 2,473,799 tokens without EOT; we add one per document.
    assert total == 2_473_799 + documents
    train = data.tokens("train")
    assert (train == 50256).sum() == meta["splits"]["train"]["documents"]
    first, second = list(zip(range(2), source.documents(), strict=False))
    encoding = tiktoken_encoding("gpt2")
    # Document 0 goes to validation (every k-th document does), document 1 opens the training split.
    expected_val = [*encoding.encode_ordinary(first[1]), 50256]
    expected_train = [*encoding.encode_ordinary(second[1]), 50256]
    assert np.array_equal(data.tokens("val")[: len(expected_val)], expected_val)
    assert np.array_equal(train[: len(expected_train)], expected_train)


def test_finished_prepare_is_not_redone(webtext) -> None:
    source, directory = webtext
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    prepare(source, directory, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert before == after


class ExplodingSource:
    """A source that fails half way, like a job killed mid-prepare."""

    def describe(self) -> str:
        return "exploding"

    def documents(self):
        yield from list(PydocSource().documents())[:20]
        raise KeyboardInterrupt


def test_interrupted_prepare_leaves_nothing_that_looks_finished(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        prepare(ExplodingSource(), tmp_path, progress=False)
    assert not (tmp_path / META_FILE).exists()
    assert not (tmp_path / "train.bin").exists()
    with pytest.raises(PreparedDataError, match="python -m corpus data=pydoc"):
        load_prepared(tmp_path, prepare_hint="python -m corpus data=pydoc")


def copy_prepared(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("train.bin", "val.bin", META_FILE):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_truncated_bin_is_detected(webtext, tmp_path: Path) -> None:
    copy = copy_prepared(webtext[1], tmp_path / "copy")
    with open(copy / "train.bin", "r+b") as handle:
        handle.truncate(os.path.getsize(copy / "train.bin") - 2)
    with pytest.raises(PreparedDataError, match="truncated"):
        load_prepared(copy, prepare_hint="python -m corpus data=local")


def test_foreign_bin_of_the_same_size_is_detected(webtext, tmp_path: Path) -> None:
    copy = copy_prepared(webtext[1], tmp_path / "copy")
    size = os.path.getsize(copy / "val.bin")
    np.random.default_rng(0).integers(0, 50257, size // 2).astype(np.uint16).tofile(copy / "val.bin")
    with pytest.raises(PreparedDataError, match="foreign"):
        load_prepared(copy)


def test_other_tokenizer_is_detected(webtext, tmp_path: Path) -> None:
    copy = copy_prepared(webtext[1], tmp_path / "copy")
    meta = json.loads((copy / META_FILE).read_text())
    meta["tokenizer"] = "cl100k_base"
    (copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(PreparedDataError, match="cl100k_base"):
        load_prepared(copy)


def test_wikiextractor_files_split_into_articles(shared: Path) -> None:
    source = LocalFilesSource(str(shared / "corpora" / "wikipedia" / "enwiki-wikiextractor" / "wiki_00"))
    articles = list(source.documents())
    assert len(articles) == 1530  # the <doc> count in the shared README
    assert not any("<doc" in a for a in articles[:50])


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        list(LocalFilesSource(str(tmp_path / "nope")).documents())


def test_pydoc_source_needs_no_download() -> None:
    docs = list(PydocSource().documents())
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000


def write_parquet(path: Path, texts: list[str], column: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: texts, "url": [f"u{i}" for i in range(len(texts))]}), path)


def test_parquet_source_reads_the_first_alternative_that_matches(tmp_path: Path) -> None:
    """Real ``datasets.load_dataset("parquet", ...)`` on local files, as it reads hf:// ones."""
    write_parquet(tmp_path / "converted" / "train" / "0000.parquet", ["first doc", "second doc"])
    source = HubParquetSource([str(tmp_path / "main" / "train-*.parquet"), str(tmp_path / "converted" / "train" / "*.parquet")])
    assert list(source.documents()) == ["first doc", "second doc"]
    with pytest.raises(SourceError, match="no parquet files match"):
        list(HubParquetSource([str(tmp_path / "main" / "train-*.parquet")]).documents())


def test_parquet_source_without_the_text_column_says_which_columns_it_has(tmp_path: Path) -> None:
    write_parquet(tmp_path / "data.parquet", ["a"], column="content")
    with pytest.raises(SourceError, match="'content'"):
        list(HubParquetSource(str(tmp_path / "data.parquet")).documents())


def test_hub_source_offline_says_to_prepare_elsewhere() -> None:
    source = HubParquetSource("hf://datasets/Skylion007/openwebtext/plain_text/train-*.parquet")
    with pytest.raises(SourceError, match="prepare the data on one with internet"):
        next(source.documents())
