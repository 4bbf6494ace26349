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
    """A Hub dataset read from its parquet files (current ``datasets`` no longer runs dataset scripts)."""

    data_files: str
    text_field: str = "text"
    num_proc: int | None = None

    def describe(self) -> str:
        return f"hub:{self.data_files}"

    def documents(self) -> Iterator[str]:
        import datasets

        try:
            dataset = datasets.load_dataset(
                "parquet", data_files=self.data_files, split="train", num_proc=self.num_proc
            )
        except Exception as err:  # the Hub raises many types; all mean "could not fetch"
            raise SourceError(
                f"could not load {self.data_files}: {err}. On a machine without internet, prepare the "
                "data on one with internet (python -m corpus data=...) and copy the prepared folder."
            ) from err
        for record in dataset:
            yield record[self.text_field]


@dataclass
class PydocSource:
    """The English documentation topics that ship inside CPython: a corpus that needs no download."""

    def describe(self) -> str:
        return "pydoc_data.topics"

    def documents(self) -> Iterator[str]:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield topics[name]
