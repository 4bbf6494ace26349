"""Inference-time geometry of a trained model (paper section 3.2, Table 1, Figures 3, 6-13): the library
behind ``analyze.py``, and the cross-model summary table ``python -m normgeo.analysis summary DIR [DIR ...]``.

The summary pools, per model, site kind (``in``: before the norm, ``std``: after its standardization,
``out``: after the norm) and reference vector, the angles of every token at every norm, exactly: the
rows' (count, mean, std) are merged with Chan's formula, not averaged. That pooled number counts each
token once per norm, and signed deviations from 90 deg at different norms cancel in it; so the summary
also gives the per-norm view: the mean over norms of |mean angle - 90| and the spread (std) of the
per-norm means, and, from ``null.jsonl``, 1's percentile among the K random directions.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import io
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from corpus.atomic import atomic_write_text
from corpus.sources import SourceError
from corpus.tokenize import EncodeBatch, first_tokens
from models.gpt import GPT, GPTConfig
from normgeo.norm_sites import NormSite
from normgeo.pretrained import ModelLoadError
from normgeo.probe import REFERENCE_NAMES, ProbeSite, residual_norms, run_probe
from normgeo.records import ANGLES_FILE, NULL_FILE, read_rows
from normgeo.stats import AngleStatistics

SITE_KINDS = ("in", "std", "out")
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
SUMMARY_FIELDS = (
    "model", "norm", "step", "site", "ref", "sites", "tokens", "vectors", "mean_deg", "std_deg", "min_deg",
    "max_deg", "norm_abs_dev_deg", "between_norm_std_deg", "norm_mean_min_deg", "norm_mean_max_deg",
    "null_k", "ones_pooled_rank_pct", "norms_in_null_band",
)


class AnalysisError(RuntimeError):
    """A user error in an analysis run (bad config, too small a corpus); the message says what to fix."""


def model_slug(name: str | None) -> str:
    """A folder name for a model name, Hub id or path, independent of the working directory.

    ``EleutherAI/pythia-1.4b`` -> ``EleutherAI--pythia-1.4b`` (the Hub cache's convention).
    """
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name or "").replace("/", "--"))
    return text.strip("-.") or "unnamed"


if not OmegaConf.has_resolver("model_slug"):
    OmegaConf.register_new_resolver("model_slug", model_slug)


# Models


# A Lightning checkpoint also pickles numpy's RNG state (see models.lit); allowing exactly these lets
# torch.load stay in weights_only mode, which cannot run code from a file someone hands us.
_numpy_core = np._core if hasattr(np, "_core") else np.core
_RNG_STATE_GLOBALS = [_numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path: str | Path) -> tuple[nn.Module, int | None, dict]:
    """(GPT in eval mode, its global step, its hyper-parameters) from a checkpoint written by train.py."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelLoadError(
            f"checkpoint not found: {file.resolve()} (give model.checkpoint=<run_dir>/checkpoints/step-XXXXXXX.ckpt "
            "or last.ckpt of a train.py run)"
        )
    try:
        with torch.serialization.safe_globals(_RNG_STATE_GLOBALS):
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises many types; all mean "not one of our checkpoints"
        raise ModelLoadError(f"could not read checkpoint {file}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(checkpoint, dict) or "gpt_config" not in checkpoint or "state_dict" not in checkpoint:
        raise ModelLoadError(
            f"{file} is not a normgeo training checkpoint (it lacks 'gpt_config' or 'state_dict'); for a "
            "Hugging Face model use model=hub model.path=..."
        )
    try:
        model = GPT(GPTConfig(**checkpoint["gpt_config"]))
        weights = {
            key.removeprefix("model."): value
            for key, value in checkpoint["state_dict"].items()
            if key.startswith("model.")
        }
        model.load_state_dict(weights)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"checkpoint {file} does not match models.gpt.GPT: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, checkpoint.get("global_step"), dict(checkpoint.get("hyper_parameters") or {})


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings allow (None: no limit known)."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "block_size"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def norm_kind(norms: Sequence[NormSite]) -> str:
    """The model's norm kind for the records: "layer" or "rms" ("layer+rms" should a model mix them)."""
    return "+".join(sorted({norm.kind for norm in residual_norms(norms)}))


def hf_forward(model: nn.Module) -> Callable[[torch.Tensor], object]:
    """Call a Hugging Face base model on token ids; no KV cache (a 7B model's would cost GBs per batch)."""
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return lambda batch: model(input_ids=batch, **kwargs)


def hf_encoder(tokenizer) -> tuple[EncodeBatch, int | None]:
    """(encode_batch, separator id) for a Hugging Face tokenizer: EOS between documents, else SEP (BERT)."""
    from transformers.utils import logging as hf_logging

    def encode_batch(texts: list[str]) -> list[list[int]]:
        # Whole documents are longer than the model's maximum; that is expected (they are cut into windows
        # afterwards), so the tokenizer's warning about it is silenced.
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
        finally:
            hf_logging.set_verbosity(level)

    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return encode_batch, separator


# Probe


def probe_token_ids(
    documents: Iterable[str],
    encode_batch: EncodeBatch,
    separator: int | None,
    tokens: int,
    source: str,
    min_tokens: int = 0,
) -> np.ndarray:
    """The first ``tokens`` token ids of the documents (those under ``min_tokens`` skipped); an
    :class:`AnalysisError` if there are fewer."""
    if tokens <= 0:
        raise AnalysisError(f"probe.tokens must be positive, not {tokens}")
    try:
        return first_tokens(documents, encode_batch, separator, tokens, min_tokens=min_tokens)
    except SourceError as exc:  # a ValueError too, but about reading the corpus, not its size
        raise AnalysisError(
            f"{exc} Or probe a local copy of the text: probe=local probe.path=<folder or file>"
        ) from exc
    except ValueError as exc:
        raise AnalysisError(f"{exc} ({source}): lower probe.tokens or give a larger corpus") from exc


def measure(
    model: nn.Module,
    ids: np.ndarray,
    seq_len: int,
    references: dict[str, np.ndarray],
    *,
    forward: Callable[[torch.Tensor], object],
    norms: Sequence[NormSite],
    batch_size: int,
    include_standardized: bool = True,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> tuple[list[ProbeSite], AngleStatistics]:
    """Angles at every norm for every token of ``ids``, cut into ``seq_len`` windows.

    The tokens that do not fill a last window go through as one shorter sequence, so exactly
    ``len(ids)`` tokens are measured (the paper's round 1M, not 976 windows of 1024).
    """
    tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    whole = len(tokens) // seq_len * seq_len
    parts = ([tokens[:whole].view(-1, seq_len)] if whole else []) + (
        [tokens[whole:].unsqueeze(0)] if whole < len(tokens) else []
    )
    num_sequences = sum(len(part) for part in parts)
    sites: list[ProbeSite] = []
    stats: AngleStatistics | None = None
    first = 0  # global index of the part's first sequence, for the per-sequence statistics
    for index, part in enumerate(parts):
        part_sites, part_stats = run_probe(
            model,
            part,
            references,
            forward=forward,
            norms=norms,
            batch_size=batch_size,
            include_standardized=include_standardized,
            device=device,
            progress=progress and index == 0,
            sequence_ids=torch.arange(first, first + len(part)),
            num_sequences=num_sequences,
        )
        first += len(part)
        if stats is None:
            sites, stats = part_sites, part_stats
        else:
            stats.merge(part_stats)
    if stats is None:
        raise AnalysisError("no probe tokens to measure")
    return sites, stats


# Summary


def _chan(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float, float]:
    """Merge (count, mean, M2) of two disjoint samples (Chan, Golub & LeVeque)."""
    count = a[0] + b[0]
    if count == 0:
        return a
    delta = b[1] - a[1]
    return count, a[1] + delta * b[0] / count, a[2] + b[2] + delta * delta * a[0] * b[0] / count


def pool(rows: Iterable[dict]) -> dict:
    """count, mean, (population) std, min, max of the union of the rows' samples."""
    moments = (0.0, 0.0, 0.0)
    low, high, sites, tokens = math.inf, -math.inf, 0, 0
    for row in rows:
        if not row["count"]:
            continue
        # M2 = n * std^2: statistics_rows writes the population std.
        moments = _chan(moments, (row["count"], row["mean_deg"], row["count"] * row["std_deg"] ** 2))
        low, high = min(low, row["min_deg"]), max(high, row["max_deg"])
        sites, tokens = sites + 1, max(tokens, row["count"] + row["zero_count"])
    count, mean, m2 = moments
    empty = count == 0
    return {
        "sites": sites,
        "tokens": tokens,
        "vectors": int(count),
        "mean_deg": math.nan if empty else mean,
        "std_deg": math.nan if empty else math.sqrt(m2 / count),
        "min_deg": math.nan if empty else low,
        "max_deg": math.nan if empty else high,
    }


def _rank(known: Sequence[str], value: str) -> tuple[int, str]:
    """Known values in their canonical order, then any others alphabetically."""
    return (known.index(value), "") if value in known else (len(known), value)


def per_norm(rows: Sequence[dict]) -> dict:
    """The per-norm view of rows of one (model, step, site kind, reference): each norm counts once.

    ``norm_abs_dev_deg``: mean over norms of |mean angle - 90|; ``between_norm_std_deg``: population std
    of the per-norm mean angles; their min and max.
    """
    means = np.array([row["mean_deg"] for row in rows if row["count"]], dtype=np.float64)
    if len(means) == 0:
        return dict.fromkeys(("norm_abs_dev_deg", "between_norm_std_deg", "norm_mean_min_deg",
                              "norm_mean_max_deg"), math.nan)
    return {
        "norm_abs_dev_deg": float(np.abs(means - 90.0).mean()),
        "between_norm_std_deg": float(means.std()),
        "norm_mean_min_deg": float(means.min()),
        "norm_mean_max_deg": float(means.max()),
    }


def null_pooled(null_rows: Sequence[dict]) -> dict:
    """1 among the K random directions, over the norms of one (model, step, site kind).

    ``ones_pooled_rank_pct``: percentile rank (as in ``null.jsonl``) of 1's token-pooled mean angle among
    the K null directions' token-pooled means; ``norms_in_null_band``: at how many norms 1's mean lies
    inside the null directions' 5-95% band.
    """
    counts = np.array([row["count"] for row in null_rows], dtype=np.float64)
    ones = float((counts * np.array([row["mean_deg"] for row in null_rows])).sum() / counts.sum())
    null = (counts[:, None] * np.array([row["null_means"] for row in null_rows], dtype=np.float64)).sum(0)
    null /= counts.sum()
    rank = 100.0 * ((null < ones).sum() + 0.5 * (null == ones).sum()) / len(null)
    return {
        "null_k": len(null),
        "ones_pooled_rank_pct": float(rank),
        "norms_in_null_band": sum(bool(row["in_null_band"]) for row in null_rows),
    }


def summarize(rows: Sequence[dict], null_rows: Sequence[dict] | None = None) -> list[dict]:
    """One pooled row per (model, norm, step, site kind, reference), models in the order they appear.

    With ``null_rows`` (``null.jsonl``), the ``ones`` rows also say where 1 stands among random directions.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        suffix = row["site"].rsplit(".", 1)[-1]
        groups.setdefault((row["model"], row["norm"], row["step"], suffix, row["ref"]), []).append(row)
    null_groups: dict[tuple, list[dict]] = {}
    for row in null_rows or ():
        suffix = row["site"].rsplit(".", 1)[-1]
        null_groups.setdefault((row["model"], row["norm"], row["step"], suffix, "ones"), []).append(row)
    empty_null = {"null_k": None, "ones_pooled_rank_pct": None, "norms_in_null_band": None}
    runs = {run: i for i, run in enumerate(dict.fromkeys(key[:3] for key in groups))}

    def order(key: tuple) -> tuple:
        return runs[key[:3]], _rank(SITE_KINDS, key[3]), _rank(REFERENCE_NAMES, key[4])

    return [
        {
            "model": key[0], "norm": key[1], "step": key[2], "site": key[3], "ref": key[4], **pool(groups[key]),
            **per_norm(groups[key]),
            **(null_pooled(null_groups[key]) if key in null_groups else empty_null),
        }
        for key in sorted(groups, key=order)
    ]


def _wide(summary: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the human-readable table: one row per (model, site kind), "mean ± std" per ref."""
    refs = list(dict.fromkeys(row["ref"] for row in summary))
    with_step = any(row["step"] is not None for row in summary)
    header = ["model", "norm", *(["step"] if with_step else []), "site", "norms", "tokens"]
    header += [f"∠ {ref} (deg)" for ref in refs]
    first_ref = len(header)
    short = " / ".join(REF_SHORT.get(ref, ref) for ref in refs)
    header += [f"per norm: mean abs(∠ − 90) ({short})", f"per norm: std of mean ∠ ({short})",
               "1: pct among random (pooled)", "norms with 1 in random 5–95%"]
    lines: dict[tuple, list[str]] = {}
    per_ref: dict[tuple, dict[str, dict]] = {}
    for row in summary:
        key = (row["model"], row["norm"], row["step"], row["site"])
        if key not in lines:
            step = [str(row["step"]) if row["step"] is not None else "-"] if with_step else []
            lines[key] = [row["model"], row["norm"], *step, row["site"], str(row["sites"]), f"{row['tokens']:,}"]
            lines[key] += ["-"] * (len(refs) + 4)
        lines[key][first_ref - len(refs) + refs.index(row["ref"])] = f"{row['mean_deg']:.2f} ± {row['std_deg']:.2f}"
        per_ref.setdefault(key, {})[row["ref"]] = row
    for key, by_ref in per_ref.items():
        line = lines[key]
        line[first_ref] = " / ".join(_deg(by_ref.get(ref, {}).get("norm_abs_dev_deg")) for ref in refs)
        line[first_ref + 1] = " / ".join(_deg(by_ref.get(ref, {}).get("between_norm_std_deg")) for ref in refs)
        ones = by_ref.get("ones", {})
        if ones.get("null_k"):
            line[first_ref + 2] = f"{ones['ones_pooled_rank_pct']:.0f}% (K={ones['null_k']})"
            line[first_ref + 3] = f"{ones['norms_in_null_band']}/{ones['sites']}"
    return header, list(lines.values())


REF_SHORT = {"ones": "1", "rand_a": "a", "rand_b": "b"}


def _deg(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def summary_markdown(summary: Sequence[dict]) -> str:
    header, rows = _wide(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    note = (
        "Angle with each reference vector, mean ± std over all tokens and all norms of the model (pooled "
        "exactly: each token counts once per norm, and deviations from 90° of opposite sign at different "
        "norms cancel); site in = before the norm, std = after its standardization (no gain/bias), out = "
        "after it. Per norm: the mean over norms of |mean angle − 90°| and the std of the per-norm mean "
        "angles (between-norm spread), for 1 / rand_a / rand_b. 1: pct among random = percentile rank of "
        "1's pooled mean angle among the K random directions' pooled means; norms with 1 in random 5–95% "
        "= norms where 1's mean angle lies inside the random directions' 5th-95th percentile band."
    )
    return note + "\n\n" + "\n".join(lines) + "\n"


def summary_csv(summary: Sequence[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=SUMMARY_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(summary)
    return buffer.getvalue()


def write_summary(out_dir: str | Path, summary: Sequence[dict]) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / SUMMARY_CSV, summary_csv(summary))
    atomic_write_text(out_dir / SUMMARY_MD, summary_markdown(summary))
    return out_dir / SUMMARY_CSV, out_dir / SUMMARY_MD


def print_summary(summary: Sequence[dict], title: str = "Angles before/after the norms") -> None:
    from rich.console import Console
    from rich.table import Table

    header, rows = _wide(summary)
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in ("model", "norm", "site") else "right")
    for row in rows:
        table.add_row(*row)
    # Piped output (logs, CI) gets rich's default 80 columns, which would wrap every cell.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m normgeo.analysis", description="Cross-model summary (Table 1) of analyze.py outputs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary_parser = commands.add_parser("summary", help="pool angles.jsonl of one or more output directories")
    summary_parser.add_argument("run_dirs", nargs="+", type=Path, help="directories holding angles.jsonl")
    summary_parser.add_argument("--out", type=Path, default=None, help="also write summary.csv/md here")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    null: list[dict] = []
    for run_dir in args.run_dirs:
        if not (run_dir / ANGLES_FILE).is_file():
            print(f"error: {run_dir / ANGLES_FILE} not found (is {run_dir} an analyze.py output directory?)",
                  file=sys.stderr)
            return 2
        rows += read_rows(run_dir / ANGLES_FILE)
        null += read_rows(run_dir / NULL_FILE)
    summary = summarize(rows, null)
    print_summary(summary)
    if args.out is not None:
        for path in write_summary(args.out, summary):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
