"""Tokenize a document source into ``train.bin``/``val.bin`` uint16 memmaps plus ``meta.json``.

``meta.json`` is written last and atomically: its presence is what "prepared" means, so an interrupted
prepare never looks finished, and a finished one is never redone. A file lock serializes concurrent
preparers (two sweep jobs sharing a data folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from corpus.atomic import atomic_write_json
from corpus.tokenize import iter_document_tokens, tiktoken_batch_encoder

META_FILE = "meta.json"
SPLITS = ("train", "val")
TOKEN_DTYPE = np.uint16
FORMAT_VERSION = 1
_FINGERPRINT_BYTES = 1 << 20


class PreparedDataError(RuntimeError):
    """Prepared data is missing, truncated or foreign; the message says which command fixes it."""


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
    """sha256 of the size and the first and last MiB: catches truncation and foreign files in O(1)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            handle.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
            digest.update(handle.read())
    return digest.hexdigest()


def full_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _exclusive_lock(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_val_document(index: int, val_fraction: float) -> bool:
    """Every k-th document goes to validation: deterministic and spread over the whole source."""
    if val_fraction <= 0:
        return False
    return index % max(1, round(1 / val_fraction)) == 0


def prepare(
    source,
    directory: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.005,
    threads: int | None = None,
    progress: bool = True,
) -> PreparedData:
    """Prepare ``source`` into ``directory`` unless an identical prepare already finished there."""
    directory = Path(directory)
    with _exclusive_lock(directory):
        existing = _read_meta(directory)
        if existing is not None and existing.get("source") == source.describe():
            return load_prepared(directory, tokenizer=tokenizer)
        encode_batch, eot_id, vocab_size = tiktoken_batch_encoder(tokenizer, threads)
        if vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
            raise ValueError(f"tokenizer {tokenizer!r} has {vocab_size} ids: too many for uint16 files")
        (directory / META_FILE).unlink(missing_ok=True)  # from here on the folder is "not prepared"
        started = time.time()
        counts = {split: 0 for split in SPLITS}
        documents = {split: 0 for split in SPLITS}
        tmp_paths = {split: directory / f".{split}.bin.tmp" for split in SPLITS}
        with contextlib.ExitStack() as stack:
            handles = {split: stack.enter_context(open(tmp_paths[split], "wb")) for split in SPLITS}
            token_stream = iter_document_tokens(source.documents(), encode_batch, eot_id)
            bar = tqdm(token_stream, desc=f"tokenizing {source.describe()}", unit="doc", disable=not progress)
            for index, ids in enumerate(bar):
                split = "val" if is_val_document(index, val_fraction) else "train"
                ids.astype(TOKEN_DTYPE).tofile(handles[split])
                counts[split] += len(ids)
                documents[split] += 1
            for handle in handles.values():
                handle.flush()
                os.fsync(handle.fileno())
        if counts["train"] == 0:
            raise PreparedDataError(f"{source.describe()} produced no training tokens")
        splits = {}
        for split in SPLITS:
            final = directory / f"{split}.bin"
            os.replace(tmp_paths[split], final)
            splits[split] = {
                "tokens": counts[split],
                "documents": documents[split],
                "bytes": final.stat().st_size,
                "sha256": full_checksum(final),
                "fingerprint": fingerprint(final),
            }
        meta = {
            "format_version": FORMAT_VERSION,
            "source": source.describe(),
            "tokenizer": tokenizer,
            "vocab_size": vocab_size,
            "eot_token": eot_id,
            "dtype": np.dtype(TOKEN_DTYPE).name,
            "val_fraction": val_fraction,
            "splits": splits,
            "seconds": round(time.time() - started, 2),
        }
        atomic_write_json(directory / META_FILE, meta)
        return PreparedData(directory, meta)


def _read_meta(directory: Path) -> dict | None:
    try:
        return json.loads((directory / META_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def load_prepared(
    directory: str | os.PathLike, *, tokenizer: str = "gpt2", prepare_hint: str = "", verify: str = "fast"
) -> PreparedData:
    """Open prepared data after checking it is complete and ours; ``verify='full'`` re-hashes every byte."""
    directory = Path(directory)
    hint = f" Prepare it with: {prepare_hint}" if prepare_hint else ""
    meta = _read_meta(directory)
    if meta is None:
        raise PreparedDataError(f"no prepared data in {directory} ({META_FILE} missing or unreadable).{hint}")
    if meta.get("tokenizer") != tokenizer:
        raise PreparedDataError(
            f"{directory} was tokenized with {meta.get('tokenizer')!r}, not {tokenizer!r}.{hint}"
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
            raise PreparedDataError(f"{path} does not match its checksum in {META_FILE}: foreign file.{hint}")
    return PreparedData(directory, meta)
