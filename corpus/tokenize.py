"""Documents -> token ids, shared by data preparation and the angle probe."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache

import numpy as np
import tiktoken

from corpus.refusal import Refusal

EncodeBatch = Callable[[list[str]], list[list[int]]]


class TokenizerError(Refusal, RuntimeError):
    """The tokenizer's files cannot be loaded (offline without a cache); the message says what to set."""


def unknown_tokenizer(name: str, key: str = "data.tokenizer") -> str | None:
    """Why ``name`` is not a tiktoken encoding (one line naming ``key`` and the known ones), or None; asks
    tiktoken's registry, loads no BPE files."""
    names = tiktoken.list_encoding_names()
    if name in names:
        return None
    return f"{key}={name}: no such tiktoken encoding; choose one of {', '.join(names)}"


@lru_cache(maxsize=4)
def tiktoken_encoding(name: str = "gpt2"):
    """The tiktoken encoding; offline machines point TIKTOKEN_CACHE_DIR at a folder with its BPE files."""
    if refusal := unknown_tokenizer(name):  # not a download problem: no such encoding at all
        raise TokenizerError(refusal)
    try:
        return tiktoken.get_encoding(name)
    except Exception as err:  # network errors come in many types, and some span many lines
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        where = f"in TIKTOKEN_CACHE_DIR={cache}" if cache else "cached (TIKTOKEN_CACHE_DIR is unset)"
        raise TokenizerError(
            f"could not load the tiktoken encoding {name!r}: its BPE files are not {where} and downloading "
            f"them failed ({type(err).__name__}). Set TIKTOKEN_CACHE_DIR to a folder holding them (e.g. "
            "../shared/tiktoken), or run once with internet access"
        ) from err


def tiktoken_batch_encoder(name: str = "gpt2", threads: int | None = None) -> tuple[EncodeBatch, int, int]:
    """(encode_batch, eot_id, vocab_size) for a tiktoken encoding; ``encode_ordinary`` ignores special
    tokens."""
    encoding = tiktoken_encoding(name)
    num_threads = threads or max(1, os.cpu_count() or 1)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return encoding.encode_ordinary_batch(texts, num_threads=num_threads)

    return encode_batch, encoding.eot_token, encoding.n_vocab


def iter_document_tokens(documents: Iterable[str], encode_batch: EncodeBatch, eot_id: int | None,
                         batch_docs: int = 256) -> Iterator[np.ndarray]:
    """One int64 array per document, each followed by the end-of-text token (if the tokenizer has one)."""
    pending: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for ids in encode_batch(pending):
            if eot_id is not None:
                ids = [*ids, eot_id]
            yield np.asarray(ids, dtype=np.int64)
        pending.clear()

    for text in documents:
        if text and text.strip():
            pending.append(text)
        if len(pending) >= batch_docs:
            yield from flush()
    if pending:
        yield from flush()


def first_tokens(documents: Iterable[str], encode_batch: EncodeBatch, eot_id: int | None, count: int | None,
                 min_tokens: int = 0, max_tokens: int | None = None) -> np.ndarray:
    """The first ``count`` tokens of the concatenated documents (None: all of them); raises if the corpus
    is shorter.

    Documents with fewer than ``min_tokens`` tokens (separator not counted) are skipped: title-only
    stubs and headings are not the article text a probe means. The rest are cut to their first
    ``max_tokens`` tokens (None: whole), each still closed by its separator, so one long article cannot
    fill the probe and its statistics span at least ``count / max_tokens`` documents.
    """
    if max_tokens is not None and max_tokens < max(min_tokens, 1):
        raise ValueError(f"max_tokens={max_tokens} is below min_tokens={min_tokens} (or 1)")
    chunks: list[np.ndarray] = []
    total = 0
    separator = 0 if eot_id is None else 1
    for ids in iter_document_tokens(documents, encode_batch, eot_id):
        if len(ids) - separator < min_tokens:
            continue
        if max_tokens is not None and len(ids) - separator > max_tokens:
            ids = np.concatenate([ids[:max_tokens], ids[len(ids) - separator :]])  # cut, then its separator
        chunks.append(ids)
        total += len(ids)
        if count is not None and total >= count:
            break
    if count is not None and total < count:
        kept = f" in documents of at least {min_tokens} tokens" if min_tokens else ""
        raise ValueError(f"the probe corpus has only {total:,} tokens{kept} but {count:,} were asked for")
    if not chunks:
        raise ValueError("the probe corpus has no tokens" + (f" in documents of at least {min_tokens} tokens"
                                                            if min_tokens else ""))
    return np.concatenate(chunks)[:count]
