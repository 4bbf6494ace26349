"""Data preparation on real text with the real GPT-2 tokenizer: idempotent, atomic, verified on load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from corpus.prepare import META_FILE, PreparedDataError, load_prepared, prepare
from corpus.sources import HubParquetSource, LocalFilesSource, PydocSource, SourceError, probe_documents
from corpus.tokenize import first_tokens, tiktoken_batch_encoder, tiktoken_encoding


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
    source = HubParquetSource(
        [str(tmp_path / "main" / "train-*.parquet"), str(tmp_path / "converted" / "train" / "*.parquet")]
    )
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


# Probe documents: sampled over the whole source, stubs skipped


def test_wikitext_raw_files_are_split_into_articles(shared: Path) -> None:
    docs = list(LocalFilesSource(str(shared / "corpora" / "wikipedia" / "wikitext-2-raw")).documents())
    assert len(docs) == 62 + 60  # the " = Title = " lines of wiki.test.raw and wiki.valid.raw
    assert docs[0].startswith(" = Robert Boulter = \n") and all(d.startswith(" = ") for d in docs)
    assert not any(" = Robert Boulter = " in d for d in docs[1:])


def test_local_sample_is_a_seeded_permutation_spread_over_the_folder(shared: Path) -> None:
    source = LocalFilesSource(str(shared / "corpora" / "wikipedia"))
    ordered = list(source.documents())
    sampled = list(source.sampled_documents(1234))
    assert sorted(sampled) == sorted(ordered) and sampled != ordered
    assert sampled == list(source.sampled_documents(1234)) and sampled != list(source.sampled_documents(1))
    # The first 300 sampled documents come from every file, not from the first one.
    position = {doc: i for i, doc in enumerate(ordered)}
    wikitext = sum(d.startswith(" = ") for d in ordered)
    files = {"wikiextractor": 0, "wikitext": 0}
    for doc in sampled[:300]:
        files["wikitext" if position[doc] >= len(ordered) - wikitext else "wikiextractor"] += 1
    assert min(files.values()) >= 1 and files["wikiextractor"] > files["wikitext"]
    assert max(position[d] for d in sampled[:300]) > len(ordered) // 2


def test_min_doc_tokens_skips_stubs(shared: Path) -> None:
    encode, eot, _ = tiktoken_batch_encoder("gpt2")
    docs = ["Title only\n\n", "A real article with enough words to pass the bar " * 4, "Stub\n"]
    ids = first_tokens(docs, encode, eot, 20, min_tokens=10)
    assert list(ids) == [*encode([docs[1]])[0], eot][:20]
    with pytest.raises(ValueError, match="only 0 tokens in documents of at least 1000 tokens"):
        first_tokens(docs, encode, eot, 20, min_tokens=1000)
    # The shared WikiExtractor files: most documents are title-only stubs, which the probe skips.
    wiki = LocalFilesSource(str(shared / "corpora" / "wikipedia" / "enwiki-wikiextractor"))
    lengths = [len(ids) for ids in encode(list(wiki.documents()))]
    assert sum(n < 64 for n in lengths) > len(lengths) / 2


def test_parquet_sample_draws_row_groups_all_over_the_dataset(tmp_path: Path) -> None:
    """The Hub path of probe=wikipedia, through local parquet files (the Hub is not reachable here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = {f: [f"file {f} row {r}" for r in range(30)] for f in range(4)}
    for f, rows in texts.items():
        pq.write_table(pa.table({"text": rows}), tmp_path / f"train-{f:05d}.parquet", row_group_size=10)
    source = HubParquetSource(str(tmp_path / "train-*.parquet"), docs_per_group=3)
    sampled = list(source.sampled_documents(7))
    assert len(sampled) == 4 * 3 * 3 and len(set(sampled)) == len(sampled)  # 3 of each of 12 row groups
    assert sampled == list(source.sampled_documents(7)) and sampled != list(source.sampled_documents(8))
    assert len({doc.split(" row ")[0] for doc in sampled[:9]}) >= 2  # the first row groups: several files
    everything = HubParquetSource(str(tmp_path / "train-*.parquet"), docs_per_group=10).sampled_documents(7)
    assert sorted(everything) == sorted(t for rows in texts.values() for t in rows)
    with pytest.raises(SourceError, match="'body'"):
        next(HubParquetSource(str(tmp_path / "train-*.parquet"), text_field="body").sampled_documents(0))


def test_probe_documents_sample_or_keep_order() -> None:
    source = PydocSource()
    assert list(probe_documents(source, sample=False, seed=0)) == list(source.documents())
    assert list(probe_documents(source, sample=True, seed=0)) == list(source.sampled_documents(0))
