"""Where documents come from: the Hugging Face Hub (parquet), local files, or text shipped with Python.

A source is anything with ``describe() -> str`` and ``documents() -> Iterator[str]``; the same sources
feed training data preparation and the angle probe.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".jsonl", ".json", ".parquet"}
# WikiExtractor output wraps each article in <doc ...> ... </doc>.
_WIKIEXTRACTOR_DOC = re.compile(r"<doc [^>]*>\n(.*?)</doc>", re.S)


class SourceError(ValueError):
    """A document source that cannot be read; the message says what to fix."""


@dataclass
class LocalFilesSource:
    """A directory (searched recursively), a single file, or a glob of ``.txt``/``.jsonl``/``.parquet``.

    ``.jsonl`` and ``.parquet`` records give their ``text_field``; any other file is plain text, one
    document per file (WikiExtractor files are split into their ``<doc>`` articles).
    """

    path: str
    text_field: str = "text"

    def files(self) -> list[Path]:
        expanded = os.path.expanduser(self.path)
        if any(ch in expanded for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True))
        elif Path(expanded).is_dir():
            matches = sorted(p for p in Path(expanded).rglob("*") if p.is_file() and not p.name.startswith("."))
        elif Path(expanded).is_file():
            matches = [Path(expanded)]
        else:
            raise SourceError(f"no such file or directory: {self.path!r} (give a directory, file or glob)")
        matches = [p for p in matches if p.is_file()]
        if not matches:
            raise SourceError(f"no files match {self.path!r}")
        return matches

    def describe(self) -> str:
        return f"local:{os.path.abspath(os.path.expanduser(self.path))}"

    def documents(self) -> Iterator[str]:
        for file in self.files():
            yield from self._read(file)

    def _read(self, file: Path) -> Iterator[str]:
        suffix = file.suffix.lower()
        if suffix in (".jsonl", ".json"):
            with open(file, encoding="utf-8") as handle:
                for line_no, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise SourceError(f"{file}:{line_no}: not a JSON line ({err.msg})") from err
                    if self.text_field not in record:
                        raise SourceError(f"{file}:{line_no}: no {self.text_field!r} field (set text_field)")
                    yield record[self.text_field]
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(file, columns=[self.text_field])
            yield from table.column(self.text_field).to_pylist()
        else:
            text = file.read_text(encoding="utf-8", errors="replace")
            articles = _WIKIEXTRACTOR_DOC.findall(text) if text.startswith("<doc ") else []
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

    @property
    def candidates(self) -> list[str]:
        return [self.data_files] if isinstance(self.data_files, str) else list(self.data_files)

    def describe(self) -> str:
        return "hub:" + " | ".join(self.candidates)

    def documents(self) -> Iterator[str]:
        import datasets
        from fsspec.core import url_to_fs

        offline_hint = (
            "On a machine without internet, prepare the data on one with internet (python -m corpus data=...) "
            "and copy the prepared folder."
        )
        for pattern in self.candidates:
            try:
                filesystem, path = url_to_fs(pattern)
                matched = filesystem.glob(path)
            except FileNotFoundError:  # no such repository or revision: try the next alternative
                matched = []
            except Exception as err:  # the Hub raises many types; all mean "could not reach it"
                raise SourceError(f"could not list {pattern}: {err}. {offline_hint}") from err
            if not matched:
                continue
            try:
                dataset = datasets.load_dataset("parquet", data_files=pattern, split="train", num_proc=self.num_proc)
            except Exception as err:
                raise SourceError(f"could not load {pattern}: {err}. {offline_hint}") from err
            if self.text_field not in dataset.column_names:
                raise SourceError(f"{pattern} has no {self.text_field!r} column (columns: {dataset.column_names})")
            for record in dataset.select_columns([self.text_field]):
                yield record[self.text_field]
            return
        raise SourceError(f"no parquet files match any of {self.candidates}; check the repository's file list")


@dataclass
class PydocSource:
    """The English documentation topics that ship inside CPython: a corpus that needs no download."""

    def describe(self) -> str:
        return "pydoc_data.topics"

    def documents(self) -> Iterator[str]:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield topics[name]
