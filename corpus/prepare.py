"""Tokenize a document source into ``train.bin``/``val.bin`` uint16 memmaps plus ``meta.json``.

``meta.json`` is written last and atomically: its presence is what "prepared" means, so an interrupted
prepare never looks finished, and a finished one is never redone. A file lock serializes concurrent
preparers (two sweep jobs sharing a data folder). Files that do not match ``meta.json`` (truncated,
damaged, foreign, an older format) are prepared again: the prepare command is also the repair command.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from tqdm import tqdm

from corpus.atomic import atomic_write_json, remove_stale_temporaries, temporary_path
from corpus.refusal import Refusal
from corpus.tokenize import iter_document_tokens, tiktoken_batch_encoder

META_FILE = "meta.json"
SPLITS = ("train", "val")
TOKEN_DTYPE = np.uint16
FORMAT_VERSION = 2  # 2: the fingerprint samples blocks over the whole file (1: first and last MiB only)
_FINGERPRINT_BLOCKS = 17  # evenly spaced, first and last included: one sits on the middle of the file
_FINGERPRINT_BLOCK_BYTES = 1 << 16
log = logging.getLogger(__name__)


class PreparedDataError(Refusal, RuntimeError):
    """Prepared data is missing, truncated or foreign; the message says which command fixes it."""


class OutdatedPreparedData(PreparedDataError):
    """Prepared by another format version: prepared again automatically (nothing is damaged)."""


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    meta: dict

    def path(self, split: str) -> Path:
        return self.directory / f"{split}.bin"

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(self.path(split), dtype=TOKEN_DTYPE, mode="r")

    def num_tokens(self, split: str) -> int:
        return int(self.meta["splits"][split]["tokens"])


def fingerprint(path: Path) -> str:
    """sha256 of the size and 17 blocks of 64 KiB spread evenly over the file (~1 MiB read).

    Catches truncation, foreign files and damage anywhere in a sampled block at O(1) cost; a flipped
    byte between blocks needs the full checksum (``python -m corpus verify``).
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    last_start = max(0, size - _FINGERPRINT_BLOCK_BYTES)
    starts = sorted({last_start * i // (_FINGERPRINT_BLOCKS - 1) for i in range(_FINGERPRINT_BLOCKS)})
    with open(path, "rb") as handle:
        for start in starts:
            handle.seek(start)
            digest.update(handle.read(_FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()


def full_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def val_period(val_fraction: float) -> int:
    """Every k-th document goes to validation: deterministic and spread over the whole source (0: none)."""
    return max(1, round(1 / val_fraction)) if val_fraction > 0 else 0


def split_documents(documents: Iterable[np.ndarray], val_fraction: float) -> Iterator[tuple[str, np.ndarray]]:
    """(split, tokens) pieces: by documents when the source has at least one per validation period,
    else (a file or a few documents) the last ``val_fraction`` of the tokens, so training never starves.
    """
    period = val_period(val_fraction)
    stream = iter(documents)
    head: list[np.ndarray] = []
    for ids in stream:
        head.append(ids)
        if len(head) >= period:
            break
    if period and len(head) < period:  # too few documents for one validation period: split by tokens
        tokens = np.concatenate(head) if head else np.zeros(0, dtype=np.int64)
        n_val = min(max(1, round(len(tokens) * val_fraction)), len(tokens) - 1) if len(tokens) > 1 else 0
        yield "train", tokens[: len(tokens) - n_val]
        yield "val", tokens[len(tokens) - n_val :]
        return
    for index, ids in enumerate(itertools.chain(head, stream)):
        yield ("val" if period and index % period == 0 else "train"), ids


def prepare(source, directory: str | os.PathLike, *, tokenizer: str = "gpt2", val_fraction: float = 0.005,
            threads: int | None = None, progress: bool = True, verify: str = "fast", repair: bool = False,
            prepare_hint: str = "") -> PreparedData:
    """Prepare ``source`` into ``directory`` unless an identical prepare already finished there.

    Its files are checked against ``meta.json`` (``verify='full'`` re-hashes every byte); files that do
    not match are prepared again with ``repair`` (``python -m corpus``), else refused naming
    ``prepare_hint``: a training run never silently rewrites data that other runs may be reading.
    """
    directory = Path(directory)
    existing = _read_meta(directory)
    check = getattr(source, "check", None)
    # A source that cannot be read (a missing path, files of unsupported types) fails before any write; one
    # already prepared is not read again (an offline node may hold the prepared folder but not the source).
    if check is not None and (existing is None or existing.get("source") != source.describe()):
        check()
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # innermost first
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # /proc, a read-only mount, a file in the way: the user's path, said in one line
        raise PreparedDataError(f"cannot create the data folder {directory} ({err.strerror}): set data_root "
                                "(or data.directory) to a folder that can be written") from None
    lock = FileLock(directory / ".prepare.lock")
    try:
        with lock:
            return _prepare_locked(source, directory, tokenizer, val_fraction, threads, progress, verify,
                                   repair, prepare_hint)
    except BaseException:
        if created:  # a failed first prepare leaves no folder behind (nor the data_root it created)
            (directory / ".prepare.lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                for folder in created:
                    folder.rmdir()
        raise


def _prepare_locked(source, directory: Path, tokenizer, val_fraction, threads, progress, verify, repair,
                    prepare_hint) -> PreparedData:
    existing = _read_meta(directory)
    if existing is None and (directory / META_FILE).exists():  # damaged: its data may be read by other runs
        hint = f" Prepare (or repair) it with: {prepare_hint}" if prepare_hint else ""
        damaged = f"{directory / META_FILE} is damaged (not a JSON mapping)"
        if not repair:
            raise PreparedDataError(f"{damaged}: the folder's data is not used.{hint}")
        log.warning("preparing %s again: %s", directory, damaged)
    if existing is not None and existing.get("source") == source.describe():
        try:
            return load_prepared(directory, tokenizer=tokenizer, verify=verify, prepare_hint=prepare_hint,
                                 val_fraction=val_fraction)
        except OutdatedPreparedData as err:
            log.warning("preparing %s again: %s", directory, err)
        except PreparedDataError as err:
            if not repair:
                raise
            log.warning("preparing %s again: %s", directory, err)
    removed, size = remove_stale_temporaries(directory)  # a killed prepare's (we hold the lock)
    if removed:
        log.warning("removed %d stale temporary file(s) (%s bytes) from %s", removed, f"{size:,}", directory)
    encode_batch, eot_id, vocab_size = tiktoken_batch_encoder(tokenizer, threads)
    if vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"tokenizer {tokenizer!r} has {vocab_size} ids: too many for uint16 files")
    (directory / META_FILE).unlink(missing_ok=True)  # from here on the folder is "not prepared"
    started = time.time()
    counts = {split: 0 for split in SPLITS}
    documents = {split: 0 for split in SPLITS}
    tmp_paths = {split: temporary_path(directory / f"{split}.bin") for split in SPLITS}
    try:
        with contextlib.ExitStack() as stack:
            handles = {split: stack.enter_context(open(tmp_paths[split], "wb")) for split in SPLITS}
            token_stream = iter_document_tokens(source.documents(), encode_batch, eot_id)
            bar = tqdm(token_stream, desc=f"tokenizing {source.describe()}", unit="doc", disable=not progress)
            for split, ids in split_documents(bar, val_fraction):
                ids.astype(TOKEN_DTYPE).tofile(handles[split])
                counts[split] += len(ids)
                documents[split] += int((ids == eot_id).sum())  # every document ends with one EOT
            for handle in handles.values():
                handle.flush()
                os.fsync(handle.fileno())
        if counts["train"] == 0:
            raise PreparedDataError(
                f"{source.describe()} produced no training tokens ({counts['val']} in all): give more text"
            )
    except BaseException:
        for path in tmp_paths.values():
            path.unlink(missing_ok=True)
        raise
    splits = {}
    for split in SPLITS:
        final = directory / f"{split}.bin"
        os.replace(tmp_paths[split], final)
        splits[split] = {"tokens": counts[split], "documents": documents[split],
                         "bytes": final.stat().st_size, "sha256": full_checksum(final),
                         "fingerprint": fingerprint(final)}
    meta = {"format_version": FORMAT_VERSION, "source": source.describe(), "tokenizer": tokenizer,
            "vocab_size": vocab_size, "eot_token": eot_id, "dtype": np.dtype(TOKEN_DTYPE).name,
            "val_fraction": val_fraction, "splits": splits, "seconds": round(time.time() - started, 2)}
    atomic_write_json(directory / META_FILE, meta)
    return PreparedData(directory, meta)


def _read_meta(directory: Path) -> dict | None:
    """The folder's ``meta.json``, or None where it is absent or damaged (not JSON, not utf-8, not a mapping):
    the folder is then not prepared, and its files are checked or prepared again as such."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (FileNotFoundError, ValueError):  # a JSONDecodeError or a UnicodeDecodeError (bytes, not text)
        return None
    return meta if isinstance(meta, dict) else None


def load_prepared(directory: str | os.PathLike, *, tokenizer: str = "gpt2", prepare_hint: str = "",
                  verify: str = "fast", val_fraction: float | None = None) -> PreparedData:
    """Open prepared data after checking it is complete and ours; ``verify='full'`` re-hashes every byte;
    ``val_fraction``, where given, is the split the caller will record as its own."""
    directory = Path(directory)
    hint = f" Prepare (or repair) it with: {prepare_hint}" if prepare_hint else ""
    meta = _read_meta(directory)
    if meta is None:
        raise PreparedDataError(f"no prepared data in {directory} ({META_FILE} missing or unreadable).{hint}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise OutdatedPreparedData(
            f"{directory} was prepared by another version (format {meta.get('format_version')}, "
            f"this code reads {FORMAT_VERSION}).{hint}"
        )
    if meta.get("tokenizer") != tokenizer:
        raise PreparedDataError(
            f"{directory} was tokenized with {meta.get('tokenizer')!r}, not {tokenizer!r}.{hint}"
        )
    if val_fraction is not None and meta.get("val_fraction") != val_fraction:
        raise PreparedDataError(
            f"{directory} was split with data.val_fraction={meta.get('val_fraction')}, not {val_fraction}: "
            f"set data.val_fraction={meta.get('val_fraction')}, or prepare it again with "
            f"data.val_fraction={val_fraction}.{hint}"
        )
    for split in SPLITS:
        path = directory / f"{split}.bin"
        expected = meta["splits"][split]
        if not path.exists():
            raise PreparedDataError(f"{path} is missing.{hint}")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise PreparedDataError(
                f"{path} has {size:,} bytes but {META_FILE} records {expected['bytes']:,}: "
                f"the file is truncated or was replaced.{hint}"
            )
        if fingerprint(path) != expected["fingerprint"] or (
            verify == "full" and full_checksum(path) != expected["sha256"]
        ):
            raise PreparedDataError(
                f"{path} does not match its checksum in {META_FILE}: damaged or foreign file.{hint}"
            )
    return PreparedData(directory, meta)
