"""The probe's options, declared once: the config keys ``probe.*`` that train.py and analyze.py share, with
their ranges, defaults, ``--help`` lines and resume rules (normgeo.config.fields.doc). The validated config
is the runtime object: train.py's probe callback, ``analyze.py`` and the export's parity check hand it down
unchanged to :func:`normgeo.measure.pipeline.measure_records`; normgeo.config.schema puts it in the run's
config (train.py's probe adds the keys analyze.py would ignore)."""

from __future__ import annotations

from typing import Any

from omegaconf import MISSING

from normgeo.config.fields import SOURCE_BEFORE, Count, Natural, Seed, doc, schema
from normgeo.measure.intervention import DEFAULT_INTERVENTION_TOKENS, DEFAULT_SCOPES, SCOPE_KINDS
from normgeo.measure.probe import DEFAULT_NULL_DIRECTIONS, DEFAULT_SEED, INCLUDE_STANDARDIZED


@schema
class BootstrapConfig:
    replicates: Count = doc(1000, "bootstrap replicates for the 95% intervals of null.jsonl")
    block: Count = doc(1, "consecutive probe sequences per resampled block; "
                          "the probe needs >= 2 whole blocks")


@schema
class ProbeConfig:
    """What the probe measures and on which tokens (conf/shared/probe/ presets)."""

    # config_node: which node a local source's refusals name
    source: Any = doc(MISSING, "_target_ node of the probe text (corpus.sources)",
                      may_change=("config_node",), before=SOURCE_BEFORE)
    path: str | None = doc(None, "local files for probe=local")
    plain_text_extensions: list[str] = doc([], "probe=local: other extensions read as plain text, e.g. [.md]",
                                           before=[])
    encoding: str = doc("utf-8", "probe=local: the text files' encoding, e.g. latin-1 "
                                 "(bytes that do not decode are refused)", before="utf-8")
    tokens: Count = doc(MISSING, "probe tokens per measurement; at least 2 sequences of seq_len")
    seed: Seed = doc(DEFAULT_SEED, "reference vectors, null directions, document sampling and bootstrap")
    include_standardized: bool = doc(INCLUDE_STANDARDIZED,
                                     "also measure LayerNorm's standardization (.std sites)")
    null_directions: Natural = doc(DEFAULT_NULL_DIRECTIONS, "random unit directions that 1 is compared with; "
                                                            "0: none")
    sample: bool = doc(True, "documents in a seeded order over the whole source")
    min_doc_tokens: Natural = doc(0, "skip documents shorter than this (title-only stubs)")
    max_doc_tokens: Count | None = doc(None, "cut longer documents to their first this many tokens, so one "
                                       "long article cannot fill the probe; >= min_doc_tokens; null: no cap",
                                       before=None)  # before it: whole documents
    bootstrap: BootstrapConfig = doc(BootstrapConfig, "95% intervals over probe sequences")
    intervention: list[str] = doc(list(DEFAULT_SCOPES), "the centering intervention's scopes "
                                  f"(intervention.jsonl): {' | '.join(SCOPE_KINDS)}; [] turns it off")
    intervention_tokens: Count | None = doc(  # before: every probe token was intervened on
        DEFAULT_INTERVENTION_TOKENS, "the intervention runs on the first this many probe tokens "
        "(whole windows; the angles keep probe.tokens); null: all of them", before=None)
    # Its own file: the other records are the same with it or without, so a run from before it resumes.
    mean_sources: bool = doc(True, "mean_sources.jsonl: the energy along 1 by position "
                             "and the dimensions that carry the mean", may_change=True)

    def size_refusal(self, seq_len: int, seq_len_key: str = "seq_len") -> str | None:
        """Why this probe, in sequences of ``seq_len`` (the config key ``seq_len_key``),
        cannot give intervals, or None: it needs at least 2 sequences, and at least 2
        whole bootstrap blocks (one block resamples to itself: zero-width intervals that
        look like certainty); and a ``max_doc_tokens`` under ``min_doc_tokens`` would keep no document.
        The one rule of train.py and analyze.py."""
        tokens, block = self.tokens, self.bootstrap.block
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
