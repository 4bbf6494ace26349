"""The probe's options in one frozen object, written once.

What the angle probe, the energy and the centering intervention measure, and on which tokens. train.py's
probe callback, ``analyze.py`` and the export's parity check build one from their config
(:meth:`ProbeConfig.from_config`, conf/shared/probe/*.yaml) and hand it down unchanged to
:func:`normgeo.measure.pipeline.measure_records`; the schema's defaults for these keys
(``normgeo.config.schema.ProbeSchema``) are this class's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from normgeo.measure.intervention import DEFAULT_INTERVENTION_TOKENS, DEFAULT_SCOPES
from normgeo.measure.probe import DEFAULT_NULL_DIRECTIONS, DEFAULT_SEED, INCLUDE_STANDARDIZED


@dataclass(frozen=True)
class ProbeConfig:
    """One probe's options (the config keys ``probe.*``; ``bootstrap_*`` are ``probe.bootstrap.*``)."""

    tokens: int  # probe tokens per measurement
    batch_size: int = 8  # probe sequences per forward
    seed: int = DEFAULT_SEED  # reference vectors, null directions, document sampling and bootstrap
    include_standardized: bool = INCLUDE_STANDARDIZED  # the .std sites too
    null_directions: int = DEFAULT_NULL_DIRECTIONS  # random unit directions 1 is compared with
    sample: bool = True  # documents in a seeded order over the whole source
    min_doc_tokens: int = 0  # documents shorter than this are skipped
    max_doc_tokens: int | None = None  # longer ones are cut to their first this many tokens (None: whole)
    bootstrap_replicates: int = 1000  # for the 95% intervals
    bootstrap_block: int = 1  # consecutive probe sequences per resampled block
    intervention: tuple[str, ...] = DEFAULT_SCOPES  # the centering intervention's scopes; () turns it off
    # its token budget (None: every probe token)
    intervention_tokens: int | None = DEFAULT_INTERVENTION_TOKENS
    mean_sources: bool = True  # mean_sources.jsonl: where the component along 1 lives

    @classmethod
    def from_config(cls, probe: Mapping[str, Any], **overrides: Any) -> ProbeConfig:
        """From a composed ``probe`` node; ``overrides`` replace fields (analyze.py's ``batch_size`` is the
        model's). Keys the node lacks keep this class's defaults."""
        bootstrap = probe.get("bootstrap") or {}
        values = {
            "tokens": probe["tokens"],
            "batch_size": probe.get("batch_size"),
            "seed": probe.get("seed"),
            "include_standardized": probe.get("include_standardized"),
            "null_directions": probe.get("null_directions"),
            "sample": probe.get("sample"),
            "min_doc_tokens": probe.get("min_doc_tokens"),
            "max_doc_tokens": probe.get("max_doc_tokens"),
            "bootstrap_replicates": bootstrap.get("replicates"),
            "bootstrap_block": bootstrap.get("block"),
            "intervention": tuple(probe["intervention"]) if probe.get("intervention") is not None else None,
            "mean_sources": probe.get("mean_sources"),
        }
        config = cls(**{key: value for key, value in values.items() if value is not None})
        if "intervention_tokens" in probe:  # null is a value here: every probe token
            config = replace(config, intervention_tokens=probe["intervention_tokens"])
        return replace(config, **overrides)

    def size_refusal(self, seq_len: int, seq_len_key: str = "seq_len") -> str | None:
        """Why this probe, in sequences of ``seq_len`` (the config key ``seq_len_key``),
        cannot give intervals, or None: it needs at least 2 sequences, and at least 2
        whole bootstrap blocks (one block resamples to itself: zero-width intervals that
        look like certainty); and a ``max_doc_tokens`` under ``min_doc_tokens`` would keep no document.
        The one rule of train.py and analyze.py."""
        tokens, block = self.tokens, self.bootstrap_block
        if self.max_doc_tokens is not None and self.max_doc_tokens < max(self.min_doc_tokens, 1):
            return (f"probe.max_doc_tokens={self.max_doc_tokens}: below probe.min_doc_tokens="
                    f"{self.min_doc_tokens}, so every document would be skipped or cut to nothing; "
                    "expected max_doc_tokens >= min_doc_tokens (or null: no cap)")
        sequences = -(-tokens // seq_len)
        if tokens < 2 * seq_len:
            return (f"probe.tokens={tokens}: expected at least 2 sequences of {seq_len_key}={seq_len} "
                    f"({2 * seq_len} tokens); raise probe.tokens")
        if sequences // block < 2:
            return (
                f"probe.bootstrap.block={block}: the probe's {sequences} sequences (probe.tokens={tokens} / "
                f"{seq_len_key}={seq_len}) make fewer than 2 whole blocks, so the intervals would "
                "have (nearly) "
                f"zero width; expected a block <= {sequences // 2}"
            )
        return None
