"""The unigram baseline of a validation: the cross-entropy of its target tokens under the training split's
token frequencies (add-half smoothing over the tokenizer's vocabulary). A model that learned the frequencies
and nothing else reaches it; the study reports its losses against it (issue 32: a decision bought by learning
less does not count)."""

from __future__ import annotations

import numpy as np

from corpus.prepare import PreparedData

SMOOTHING = 0.5  # add-half: every id of the vocabulary, seen or not, gets half a count


def unigram_log_probs(train_tokens: np.ndarray, vocab_size: int, smoothing: float = SMOOTHING) -> np.ndarray:
    """log p(id) for every id of the vocabulary, from the counts in ``train_tokens`` plus ``smoothing``
    each."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    smoothed = counts.astype(np.float64) + smoothing
    return np.log(smoothed) - np.log(smoothed.sum())


def unigram_cross_entropy(prepared: PreparedData, targets: np.ndarray) -> float:
    """Mean −log p(target) in nats of ``targets`` (token ids, any shape) under ``prepared``'s train split."""
    log_probs = unigram_log_probs(prepared.tokens("train"), int(prepared.meta["vocab_size"]))
    return float(-log_probs[np.asarray(targets, dtype=np.int64)].mean())
