"""Where documents come from: the Hugging Face Hub (parquet), local files, or text shipped with Python.

A source is anything with ``describe() -> str`` and ``documents() -> Iterator[str]``; the same sources
feed training data preparation and the angle probe. For the probe, ``sampled_documents(seed)`` gives the
documents in a seeded order spread over the whole source (:func:`probe_documents`), so that a probe of
100k tokens is not the first file of a corpus, and is the same in both arms and at every step.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import stat
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from corpus.refusal import Refusal

# What LocalFilesSource reads (docs/data.md): records with a text field, and plain text. "" is a file with
# no extension (WikiExtractor's wiki_00), .raw WikiText's files. Anything else is refused unless named in
# plain_text_extensions: a .csv or .py read as prose trains on its commas and code without a word.
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
PLAIN_TEXT_SUFFIXES = (".txt", ".raw", "")
# A corpus folder's own documentation (README.md, LICENSE, ...) is about the corpus, not of it: skipped
# with a note when a folder or glob is read (a file named on its own is read, or refused, by its type).
SKIPPED_NAMES = ("README", "LICENSE", "LICENCE", "COPYING", "NOTICE")
log = logging.getLogger(__name__)
# WikiExtractor output wraps each article in <doc ...> ... </doc>.
_WIKIEXTRACTOR_DOC = re.compile(r"<doc [^>]*>\n(.*?)</doc>", re.S)
# WikiText raw files: each article opens with a top-level heading line " = Title = " (sections are " = = ").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $", re.M)


class SourceError(Refusal, ValueError):
    """A document source that cannot be read; the message says what to fix."""


def special_file_kind(path: Path) -> str | None:
    """``a FIFO (named pipe)``, ``a character device``, ... for a path that exists but is not a regular file
    or a folder (reading one would block or never end), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), None)


@dataclass
class LocalFilesSource:
    """A directory (searched recursively), a single file, or a glob of ``.txt``/``.jsonl``/``.parquet``.

    ``.jsonl``/``.json`` lines and ``.parquet`` rows give their ``text_field``; ``.txt``, ``.raw`` and
    files without an extension are plain text, one document per file (WikiExtractor files are split into
    their ``<doc>`` articles, WikiText raw files into their articles at the `` = Title = `` lines). Other
    extensions are refused, all of them named at once, unless listed in ``plain_text_extensions``
    (then read as plain text). In a folder or glob, README/LICENSE/COPYING/NOTICE files are skipped.
    ``config_node`` is the config node the refusals name (``data.source``, or ``probe`` for probe=local).
    Only regular files are read (a FIFO or a device is refused by name), decoded as ``encoding`` (UTF-8
    unless set): a byte that does not decode is refused with the file and its byte offset.
    """

    path: str
    text_field: str = "text"
    plain_text_extensions: Sequence[str] = ()
    config_node: str = "data.source"
    # of the text files (.txt, .jsonl, ...); invalid bytes are refused, never replaced
    encoding: str = "utf-8"
    _files: list[Path] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def extra_plain_text(self) -> tuple[str, ...]:
        """plain_text_extensions as lower-case suffixes with their dot (``csv`` and ``.CSV`` mean
        ``.csv``)."""
        given = self.plain_text_extensions
        given = given.split(",") if isinstance(given, str) else given  # plain_text_extensions=.csv is one
        suffixes = (str(ext).strip().lower() for ext in given)
        return tuple(sorted({ext if ext.startswith(".") else f".{ext}" for ext in suffixes if ext}))

    def files(self) -> list[Path]:
        """The files to read, checked once: every one of a type this source reads (else SourceError)."""
        if self._files is not None:
            return self._files
        expanded = os.path.expanduser(self.path)
        if any(ch in expanded for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True))
        elif Path(expanded).is_dir():
            matches = sorted(
                p for p in Path(expanded).rglob("*") if not p.is_dir() and not p.name.startswith(".")
            )
        elif Path(expanded).is_file():
            matches = [Path(expanded)]
        elif (kind := special_file_kind(Path(expanded))) is not None:
            raise SourceError(
                f"{self.config_node}.path={self.path}: {kind}, not a regular file; give a text file, "
                "a folder or a glob of them"
            )
        else:
            raise SourceError(
                f"{self.config_node}.path={self.path}: no such file or directory (give a directory, "
                "file or glob)"
            )
        special = [(p, kind) for p in matches if (kind := special_file_kind(p)) is not None]
        if special:
            raise SourceError(
                f"{self.config_node}.path={self.path}: {special[0][0]} is {special[0][1]}, not a regular "
                "file; remove it from the folder or narrow the glob"
            )
        matches = [p for p in matches if p.is_file()]
        if not matches:
            raise SourceError(f"{self.config_node}.path={self.path}: no files match")
        if len(matches) > 1 or not Path(expanded).is_file():  # a folder or glob: skip its documentation
            skipped = [p for p in matches if p.name.split(".")[0].upper() in SKIPPED_NAMES]
            if skipped:
                log.warning("%s.path=%s: skipped %s (a corpus's README/LICENSE files are not read)",
                            self.config_node, self.path, ", ".join(p.name for p in skipped))
                matches = [p for p in matches if p not in skipped]
                if not matches:
                    raise SourceError(
                        f"{self.config_node}.path={self.path}: no files but README/LICENSE files"
                    )
        self._check_types(matches)
        self._files = matches
        return matches

    def _check_types(self, files: list[Path]) -> None:
        readable = {*RECORD_SUFFIXES, *PLAIN_TEXT_SUFFIXES, *self.extra_plain_text}
        refused = Counter(p.suffix.lower() for p in files if p.suffix.lower() not in readable)
        if not refused:
            return
        count = sum(refused.values())
        found = f"{count} files of unsupported types" if count > 1 else "1 file of an unsupported type"
        kinds = ", ".join(
            f"{suffix}: {n}" for suffix, n in sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        supported = ", ".join([*RECORD_SUFFIXES, ".txt", ".raw", "no extension", *self.extra_plain_text])
        allow = ",".join(sorted({*self.extra_plain_text, *refused}))  # the whole list to set, kept ones too
        raise SourceError(
            f"{self.config_node}.path={self.path}: {found} ({kinds}); supported: {supported}; to read other "
            f"extensions as plain text set {self.config_node}.plain_text_extensions=[{allow}]"
        )

    def check(self) -> None:
        """Refuse a missing path or files of unsupported types before anything is written (prepare)."""
        self.files()

    def describe(self) -> str:
        where = f"local:{os.path.abspath(os.path.expanduser(self.path))}"
        # Named only when set: data prepared before the options existed keeps its description (meta.json).
        notes = [f"plain text: {', '.join(self.extra_plain_text)}"] if self.extra_plain_text else []
        notes += (
            [f"encoding: {self.encoding}"]
            if self.encoding.lower().replace("_", "-") not in ("utf-8", "utf8")
            else []
        )
        return f"{where} ({'; '.join(notes)})" if notes else where

    def decode(self, file: Path, data: bytes) -> str:
        """``data`` (the bytes of ``file``) as text in ``encoding``; SourceError at the first byte that does
        not decode (a Latin-1 file read as UTF-8 would otherwise train on replacement characters)."""
        try:
            return data.decode(self.encoding)
        except LookupError:
            raise SourceError(
                f"{self.config_node}.encoding={self.encoding}: no such text encoding (e.g. utf-8, "
                "latin-1, cp1252)"
            ) from None
        except UnicodeDecodeError as err:
            raise SourceError(
                f"{file}: not valid {self.encoding} at byte {err.start} "
                f"({data[err.start : err.start + 4].hex(' ')}); convert the file (e.g. iconv -f latin1 -t "
                f"utf-8) or set {self.config_node}.encoding=latin-1 (its real encoding)"
            ) from None

    def documents(self) -> Iterator[str]:
        for file in self.files():
            yield from self._read(file)

    def sampled_documents(self, seed: int) -> Iterator[str]:
        """Every document once, in a seeded random order (local corpora are read into memory)."""
        yield from _permuted(list(self.documents()), seed)

    def _text(self, value: object, where: str) -> str:
        if not isinstance(value, str):
            raise SourceError(
                f"{where}: field {self.text_field!r} is {type(value).__name__} {value!r:.40}, not a string "
                "(set data.source.text_field to the field that holds the text)"
            )
        return value

    def _read(self, file: Path) -> Iterator[str]:
        suffix = file.suffix.lower()
        if suffix in (".jsonl", ".json"):
            # Decoded whole, so that a bad byte is reported at its offset in the
            # file; lines end where a text-mode file's would (\n, \r\n, \r), not
            # at U+2028 inside a JSON string as str.splitlines would split.
            text = self.decode(file, file.read_bytes()).replace("\r\n", "\n").replace("\r", "\n")
            for line_no, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise SourceError(f"{file}:{line_no}: not a JSON line ({err.msg})") from err
                if self.text_field not in record:
                    raise SourceError(f"{file}:{line_no}: no {self.text_field!r} field (set text_field)")
                yield self._text(record[self.text_field], f"{file}:{line_no}")
        elif suffix == ".parquet":
            # Only for parquet sources (pyarrow is heavy to import).
            import pyarrow.parquet as pq

            table = pq.read_table(file, columns=[self.text_field])
            for row, value in enumerate(table.column(self.text_field).to_pylist()):
                yield self._text(value, f"{file} row {row}")
        else:
            data = file.read_bytes()
            if b"\0" in data[:8192]:  # text never holds NUL bytes; binaries almost always do
                raise SourceError(f"{file} is a binary file, not text: give .txt, .jsonl or .parquet files")
            text = self.decode(file, data)
            if text.startswith("<doc "):
                articles = _WIKIEXTRACTOR_DOC.findall(text)
            elif _WIKITEXT_TITLE.fullmatch(
                next((line for line in text[:4096].splitlines() if line.strip()), "")
            ):
                starts = [m.start() for m in _WIKITEXT_TITLE.finditer(text)]
                articles = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
            else:
                articles = []
            yield from (articles or [text])


@dataclass
class HubParquetSource:
    """A Hub dataset read from its parquet files (current ``datasets`` no longer runs dataset scripts).

    ``data_files`` is one pattern (``hf://datasets/<repo>[@<revision>]/<glob>.parquet``) or a list of
    alternatives tried in order: the first that matches any file is read. That covers a repository that
    moves its data, e.g. from the Hub's automatic parquet conversion (``@refs%2Fconvert%2Fparquet``) to
    parquet files on its main branch. Any other failure (network, authentication) is reported at once.
    """

    data_files: str | list[str]
    text_field: str = "text"
    num_proc: int | None = None
    docs_per_group: int = 16  # sampled_documents: documents taken from each drawn parquet row group

    @property
    def candidates(self) -> list[str]:
        return [self.data_files] if isinstance(self.data_files, str) else list(self.data_files)

    def describe(self) -> str:
        return "hub:" + " | ".join(self.candidates)

    def matched(self, hint: str) -> tuple[Any, str, list[str]]:
        """The filesystem, pattern and files of the first candidate that matches any file."""
        for pattern in self.candidates:
            try:
                filesystem, path = url_to_fs(pattern)
                files = sorted(filesystem.glob(path))
            except FileNotFoundError:  # no such repository or revision: try the next alternative
                files = []
            except Exception as err:  # the Hub raises many types; all mean "could not reach it"
                raise SourceError(f"could not list {pattern}: {err}. {hint}") from err
            if files:
                return filesystem, pattern, files
        raise SourceError(
            f"no parquet files match any of {self.candidates}; check the repository's file list"
        )

    def documents(self) -> Iterator[str]:
        # HF datasets takes seconds to import: only for hub sources.
        import datasets

        offline_hint = (
            "On a machine without internet, prepare the data on one with internet (python -m corpus "
            "data=...) and copy the prepared folder."
        )
        _, pattern, _ = self.matched(offline_hint)
        try:
            dataset = datasets.load_dataset("parquet", data_files=pattern, split="train",
                                            num_proc=self.num_proc)
        except Exception as err:
            raise SourceError(f"could not load {pattern}: {err}. {offline_hint}") from err
        if self.text_field not in dataset.column_names:
            raise SourceError(
                f"{pattern} has no {self.text_field!r} column (columns: {dataset.column_names})"
            )
        for record in dataset.select_columns([self.text_field]):
            yield record[self.text_field]

    def sampled_documents(self, seed: int) -> Iterator[str]:
        """Documents spread over the whole dataset, without reading all of it.

        The row groups of every matched parquet file (from their footers) are visited in a seeded random
        order, and ``docs_per_group`` seeded random rows of each are taken: a million probe tokens of English
        Wikipedia (one article per row) touch ~100 row groups all over the dump instead of its first file.
        """
        # Only for parquet sources (pyarrow is heavy to import).
        import pyarrow.parquet as pq

        filesystem, _, files = self.matched("Offline, use probe=local")
        groups: list[tuple[str, int]] = []
        for file in files:
            with filesystem.open(file, "rb") as handle:
                parquet = pq.ParquetFile(handle)
                if self.text_field not in parquet.schema_arrow.names:
                    raise SourceError(
                        f"{file} has no {self.text_field!r} column (columns: {parquet.schema_arrow.names})"
                    )
                groups += [(file, g) for g in range(parquet.metadata.num_row_groups)]
        rng = np.random.default_rng([seed, 0x5A4D])
        for index in rng.permutation(len(groups)):
            file, group = groups[index]
            with filesystem.open(file, "rb") as handle:
                texts = pq.ParquetFile(handle).read_row_group(group, columns=[self.text_field])
            texts = texts.column(self.text_field).to_pylist()
            for row in rng.permutation(len(texts))[: self.docs_per_group]:
                yield texts[row]


@dataclass
class PydocSource:
    """The English documentation topics that ship inside CPython: a corpus that needs no download."""

    def describe(self) -> str:
        return "pydoc_data.topics"

    def documents(self) -> Iterator[str]:
        for name in sorted(topics):
            yield topics[name]

    def sampled_documents(self, seed: int) -> Iterator[str]:
        yield from _permuted(list(self.documents()), seed)


@dataclass
class TextsSource:
    """Documents handed over in Python (normgeo.measure(model, texts)): each text one document."""

    texts: Sequence[str]

    def describe(self) -> str:
        return f"{len(self.texts)} text(s) given in Python"

    def documents(self) -> Iterator[str]:
        yield from self.texts

    def sampled_documents(self, seed: int) -> Iterator[str]:
        yield from _permuted(list(self.texts), seed)


def _permuted(documents: list[str], seed: int) -> Iterator[str]:
    order = np.random.default_rng([seed, 0x5A4D]).permutation(len(documents))
    return (documents[i] for i in order)


def probe_documents(source, *, sample: bool, seed: int) -> Iterator[str]:
    """The probe's documents: the source's seeded sample (``sample``) or its own order."""
    if not sample:
        return source.documents()
    sampler = getattr(source, "sampled_documents", None)
    if sampler is None:
        raise SourceError(f"{type(source).__name__} cannot sample its documents; set probe.sample=false")
    return sampler(seed)
