"""mean_sources.jsonl (normgeo.measure.mean_sources) against a direct float64 computation: on random
activations, on a real model's, merged over halves, with planted massive dimensions, and through the
pipeline's records."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity

from corpus.sources import LocalFilesSource
from corpus.tokenize import tiktoken_batch_encoder
from models.gpt import GPT, GPTConfig
from normgeo.measure import mean_sources
from normgeo.measure.energy import EnergyStatistics
from normgeo.measure.geometry import gpu_code_path
from normgeo.measure.mean_sources import (
    BUCKET_STARTS,
    DOC_START,
    SHARES,
    MeanSourcesMeasurement,
    MeanSourcesStatistics,
    bucket_names,
    empty_buckets,
    mean_sources_rows,
)
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import (
    document_starts,
    measure_records,
    probe_ids,
    run_probe,
    tiktoken_separator,
)
from normgeo.measure.probe import ProbeSite, input_sites, make_references, residual_norms
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.records import read_rows, record_problem, write_step
from normgeo.measure.run_records import read_run_records
from normgeo.measure.stats import QUANTILE_FIELDS, block_bootstrap_means
from normgeo.run_folder import MEAN_SOURCES_FILE
from tests.conftest import ROOT

KEYS = {"model": "m", "norm": "layer", "step": None, "tokens_seen": None}


def direct(windows: torch.Tensor) -> dict:
    """The measurement by hand in float64: phi, E[mu^2], per bucket the fractions along 1 and sum of mu^2."""
    x = windows.to(torch.float64)
    d = x.shape[-1]
    mu = x.mean(dim=-1)  # (rows, T)
    fraction = mu.square() / x.square().mean(dim=-1)  # (x.1)^2 / (d ||x||^2)
    buckets = []
    for b, start in enumerate(BUCKET_STARTS):
        end = BUCKET_STARTS[b + 1] if b + 1 < len(BUCKET_STARTS) else None
        buckets.append((fraction[:, start:end].reshape(-1), mu[:, start:end].square().sum()))
    return {
        "phi": (mu.unsqueeze(-1) * x / d).reshape(-1, d).mean(dim=0),
        "mean_sq": mu.square().mean(),
        "buckets": buckets,
        "max_abs": x.abs().reshape(-1, d).amax(dim=0),
    }


def random_windows(rows: int, length: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # A mean along 1 that varies by token and two dimensions that carry more of it.
    x = torch.randn(rows, length, d, generator=g, dtype=torch.float64)
    x += 0.5 * torch.randn(rows, length, 1, generator=g, dtype=torch.float64)
    x[..., 3] += 4.0
    x[..., 11] -= 2.0
    return x


def rows_of(stats: MeanSourcesStatistics, d: int) -> list[dict]:
    return mean_sources_rows([ProbeSite(0, "ln1.in", "layer", d)], stats, **KEYS)


def test_bucket_names() -> None:
    assert bucket_names() == ["0", "1-3", "4-15", "16-63", "64-255", "256+"]


def test_random_activations_match_a_direct_float64_computation() -> None:
    d = 48
    windows = random_windows(5, 300, d, seed=0)
    stats = MeanSourcesStatistics([d])
    for part in windows.split(2):  # several batches
        stats.update(0, part)
    truth = direct(windows)
    phi = stats.phi[0] / stats.count[0]
    mean_sq = stats.mean_sq[0] / stats.count[0]
    # The decomposition is exact: sum_i phi_i = E[mu^2], and each phi_i is the direct one.
    assert abs(float(phi.sum() - mean_sq)) <= 1e-10 * float(mean_sq)
    torch.testing.assert_close(phi, truth["phi"], rtol=1e-10, atol=1e-13)
    assert float(mean_sq) == pytest.approx(float(truth["mean_sq"]), rel=1e-12)
    torch.testing.assert_close(stats.max_abs[0], truth["max_abs"], rtol=1e-7, atol=0)  # |x| in float32

    rows = rows_of(stats, d)
    assert all(record_problem(row) is None for row in rows)
    dims, positions, doc = rows[0], rows[1:-1], rows[-1]
    assert dims["kind"] == "dimensions" and dims["count"] == 5 * 300
    # No document starts given: their row is there, empty.
    assert (doc["kind"], doc["bucket"], doc["first_position"], doc["last_position"]) == (
        "position", DOC_START, None, None)
    assert doc["count"] == 0 and doc["mean_sq_share"] is None
    assert all(doc[field] is None for field in ("mean", "std", "min", "max", *QUANTILE_FIELDS))
    order = torch.argsort(truth["phi"].abs(), descending=True)
    shares = truth["phi"][order] / truth["mean_sq"]
    assert dims["top_dims"][0] == 3 and dims["top_dims"] == order[:16].tolist()
    assert dims["top_shares"] == pytest.approx(shares[:16].tolist(), rel=1e-9)
    assert dims["top1_share"] == pytest.approx(float(shares[0]), rel=1e-9)
    assert dims["top8_share"] == pytest.approx(float(shares[:8].sum()), rel=1e-9)
    needed = int((shares.cumsum(0) >= 0.9).nonzero()[0, 0]) + 1
    assert dims["dims_for_90"] == needed
    # Each bucket's fraction along 1 is the per-token recomputation's, its mu^2 share the direct one.
    assert [row["bucket"] for row in positions] == bucket_names()
    total = float(truth["mean_sq"]) * 5 * 300
    for row, (fraction, mean_sq_in) in zip(positions, truth["buckets"], strict=True):
        assert row["count"] == fraction.numel()
        assert row["mean"] == pytest.approx(float(fraction.mean()), rel=1e-6)  # float32 sums over d
        assert row["min"] == pytest.approx(float(fraction.min()), rel=1e-5)
        assert row["max"] == pytest.approx(float(fraction.max()), rel=1e-5)
        assert row["p50"] == pytest.approx(float(fraction.median()), rel=0.03)  # 100 bins per decade
        assert row["mean_sq_share"] == pytest.approx(float(mean_sq_in) / total, rel=1e-9)
    assert sum(row["mean_sq_share"] for row in positions) == pytest.approx(1.0, rel=1e-9)


def test_the_merge_of_two_halves_equals_one_pass() -> None:
    d = 32
    windows = random_windows(6, 80, d, seed=1)
    starts = torch.rand(6, 80, generator=torch.Generator().manual_seed(1)) < 0.1  # the document starts too
    whole, first, second = (MeanSourcesStatistics([d, d]) for _ in range(3))
    for site in (0, 1):
        whole.update(site, windows * (site + 1), starts)
        first.update(site, windows[:3] * (site + 1), starts[:3])
        second.update(site, windows[3:] * (site + 1), starts[3:])
    first.merge(second)
    assert torch.equal(first.count, whole.count) and torch.equal(first.abs_hist, whole.abs_hist)
    assert torch.equal(first.buckets.hist, whole.buckets.hist)
    for a, b in ((first.mean_sq, whole.mean_sq), (first.bucket_mean_sq, whole.bucket_mean_sq),
                 (first.buckets.mean, whole.buckets.mean), *zip(first.phi, whole.phi, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert all(torch.equal(a, b) for a, b in zip(first.max_abs, whole.max_abs, strict=True))
    sites = [ProbeSite(0, "ln1.in", "layer", d), ProbeSite(0, "ln2.in", "layer", d)]
    merged, single = (mean_sources_rows(sites, s, **KEYS) for s in (first, whole))
    assert [r["count"] for r in single if r.get("bucket") == DOC_START] == [int(starts.sum())] * 2
    for a, b in zip(merged, single, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float) or (isinstance(value, list) and value
                                            and isinstance(value[0], float)):
                assert value == pytest.approx(b[key], rel=1e-9), key
            else:
                assert value == b[key], key


def test_the_massive_dimension_rule_finds_planted_outliers() -> None:
    d = 64
    windows = random_windows(4, 40, d, seed=2)
    windows[..., 3] -= 4.0  # plain Gaussian entries: median |x| ~ 0.67
    windows[..., 11] += 2.0
    windows[:, 0, 7] = 1000.0  # on position 0 of every window: ~1500x the median |x|
    windows[1, 5, 20] = -300.0  # once, anywhere: ~450x
    windows[2, 9, 30] = 30.0  # ~45x: not massive
    stats = MeanSourcesStatistics([d])
    stats.update(0, windows)
    dims, positions = rows_of(stats, d)[0], rows_of(stats, d)[1:]
    median = float(windows.abs().median())
    assert dims["median_abs"] == pytest.approx(median, rel=0.02)
    assert dims["massive_dims"] == [7, 20] and dims["massive_count"] == 2
    assert dims["massive_max_abs"] == [1000.0, 300.0]
    truth = direct(windows)
    share = float((truth["phi"][7] + truth["phi"][20]) / truth["mean_sq"])
    assert dims["massive_share"] == pytest.approx(share, rel=1e-9) and share > 0.9
    assert dims["top_dims"][0] == 7 and dims["top1_share"] > 0.9
    assert positions[0]["bucket"] == "0" and positions[0]["mean_sq_share"] > 0.9  # the mean lives at 0


def test_the_massive_cut_uses_the_exact_median_where_a_histogram_bin_would_flip_it() -> None:
    """Entries whose median |x| sits at the bottom of its 3% histogram bin (1.0001, in [1, 1.03125)): a
    dimension with max 101 is over 100x the exact median (100.01) but under 100x the bin's middle (101.56),
    so a histogram median drops it; one with max 99 is under either cut."""
    d = 64
    windows = random_windows(4, 40, d, seed=3).float()
    windows *= 1.0001 / windows.abs().median()
    windows[..., 5] = windows[..., 5].clamp(-1, 1)
    windows[..., 6] = windows[..., 6].clamp(-1, 1)
    windows[2, 3, 5], windows[1, 7, 6] = 101.0, -99.0
    median = float(windows.abs().median())  # torch's: the lower median, as the measurement's
    assert 1.0 <= median < 1.0002 and 100 * median < 101.0 < 100 * 1.015625
    stats = MeanSourcesStatistics([d])
    stats.update(0, windows[:2])  # the band comes from this first batch; the second adds to it
    stats.update(0, windows[2:])
    dims = rows_of(stats, d)[0]
    assert dims["median_abs"] == median and dims["median_exact"] is True
    assert 5 in dims["massive_dims"] and 6 not in dims["massive_dims"]


def test_a_median_that_leaves_the_first_batchs_band_falls_back_to_the_histogram(caplog) -> None:
    """A first batch far below the rest: the median's bin is outside the band it chose, so the median is the
    bin's middle (within 1.6%), said so in the record and once in the log."""
    d = 16
    small, large = random_windows(1, 8, d, seed=4), random_windows(6, 8, d, seed=5) * 100
    stats = MeanSourcesStatistics([d])
    stats.update(0, small)
    stats.update(0, large)
    with caplog.at_level(logging.WARNING):
        dims = rows_of(stats, d)[0]
    median = float(torch.cat([small, large]).float().abs().median())
    assert dims["median_exact"] is False and dims["median_abs"] == pytest.approx(median, rel=0.016)
    assert "not exact" in caplog.text


def test_the_shares_intervals_are_a_bootstrap_over_documents() -> None:
    """Per-document sums against a direct float64 computation, and the intervals are the one bootstrap's
    (stats.block_bootstrap_means) over those sums: over documents, with a median over the inputs from the
    same resamples."""
    d, rows, length = 24, 6, 20
    windows = random_windows(rows, length, d, seed=7)
    windows[:, 0, 2] += 30.0  # position 0 carries most of the mean, unevenly over documents
    windows[3, 0, 2] += 60.0
    documents = torch.arange(rows * length).div(37, rounding_mode="floor").view(rows, length)  # 4 documents
    stats = MeanSourcesStatistics([d, d], documents=4)
    for site in (0, 1):
        stats.update(site, windows * (site + 1), documents=documents)
    sites = [ProbeSite(0, "ln1.in", "layer", d), ProbeSite(0, "ln2.in", "layer", d)]
    rows = mean_sources_rows(sites, stats, **KEYS, replicates=200, seed=3)
    dims = [r for r in rows if r["kind"] == "dimensions"]
    x = windows.to(torch.float64)
    mu = x.mean(dim=-1)
    doc = documents.reshape(-1)
    per_doc_sq = torch.zeros(4, dtype=torch.float64).index_add_(0, doc, mu.square().reshape(-1))
    first = torch.zeros(4, dtype=torch.float64).index_add_(0, documents[:, 0], mu[:, 0].square())
    phi = torch.zeros(4, d, dtype=torch.float64).index_add_(0, doc, (mu.unsqueeze(-1) * x / d).reshape(-1, d))
    boots = []
    for site, row in enumerate(dims):
        scale = (site + 1) ** 2
        torch.testing.assert_close(stats.unit_mean_sq[site], per_doc_sq * scale)
        torch.testing.assert_close(stats.unit_first_sq[site], first * scale)
        torch.testing.assert_close(stats.unit_phi[site], phi * scale)
        parts = np.stack([first.numpy(), phi[:, row["top_dims"][:8]].sum(dim=1).numpy(),
                          phi[:, row["massive_dims"]].sum(dim=1).numpy()], axis=1)
        expected = block_bootstrap_means(per_doc_sq.numpy(), parts, replicates=200, block=1, seed=3)
        assert row["documents"] == 4 and row["position0_share"] > 0.5
        for k, share in enumerate(SHARES):
            assert row[share] == pytest.approx(expected["mean"][k], rel=1e-9)
            assert [row[f"{share}_low"], row[f"{share}_high"]] == pytest.approx(
                [expected["low"][k], expected["high"][k]], rel=1e-9)
        assert row["position0_share_low"] < row["position0_share"] < row["position0_share_high"]
        boots.append(expected["replicates"])
    median = np.median(np.stack([b[:, 0] for b in boots], axis=1), axis=1)
    assert dims[0]["inputs_median_position0_share"] == pytest.approx(
        [float(np.median([r["position0_share"] for r in dims])), *np.quantile(median, [0.025, 0.975])])


def test_empty_and_short_probes_give_null_statistics() -> None:
    stats = MeanSourcesStatistics([8])
    dims, *positions = rows_of(stats, 8)
    assert dims["count"] == 0 and dims["mean_sq"] is None and dims["dims_for_90"] is None
    assert dims["massive_dims"] == [] and dims["massive_share"] is None and dims["median_abs"] is None
    assert all(row["count"] == 0 and row["mean"] is None and row["mean_sq_share"] is None
               for row in positions)
    stats.update(0, torch.randn(2, 10, 8))  # windows of 10 tokens: the buckets from 16 on stay empty
    positions = rows_of(stats, 8)[1:]
    assert [row["count"] for row in positions] == [2, 6, 12, 0, 0, 0, 0]  # and no document start
    assert positions[-1]["mean_sq_share"] is None  # unknown, not 0
    assert positions[3]["mean"] is None and positions[3]["mean_sq_share"] == 0.0


def test_the_bucket_fraction_is_the_energy_statistic() -> None:
    """One engine: a bucket's row is an EnergyStatistics site fed that bucket's tokens."""
    windows = random_windows(3, 20, 16, seed=3)
    stats, energy = MeanSourcesStatistics([16]), EnergyStatistics(1)
    stats.update(0, windows)
    energy.update(0, windows[:, 4:16])
    row = rows_of(stats, 16)[3]
    assert row["bucket"] == "4-15" and row["count"] == int(energy.count[0, 0])
    assert row["mean"] == pytest.approx(float(energy.mean[0, 0]), rel=1e-9)  # 10 digits in JSON
    assert row["p95"] == pytest.approx(float(energy.quantiles()[0, 0, 5]), rel=1e-9)


def tiny_gpt(norm: str) -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, norm=norm), seed=0).eval()


def captured_check(model: nn.Module, sequences: torch.Tensor, forward=None) -> None:
    """The measurement in the pipeline's forward equals the direct computation on the captured norm inputs."""
    norms = residual_norms(find_norm_sites(model))
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(norms))}
    handles = [norm.module.register_forward_hook(
        lambda module, inputs, output, i=i: captured[i].append(inputs[0].detach().clone()))
        for i, norm in enumerate(norms)]
    measurement = MeanSourcesMeasurement(norms)
    try:
        run_probe(model, [sequences], [measurement], norms=norms, forward=forward, batch_size=3)
    finally:
        for handle in handles:
            handle.remove()
    rows = measurement.records(KEYS)[MEAN_SOURCES_FILE]
    assert all(record_problem(row) is None for row in rows)
    per_site = 2 + len(BUCKET_STARTS)  # dimensions, the buckets, the document starts
    assert len(rows) == per_site * len(norms)
    for i, site in enumerate(input_sites(norms)):
        x = torch.cat(captured[i]).to(torch.float64)
        truth = direct(x)
        stats = measurement.stats
        phi, mean_sq = stats.phi[i] / stats.count[i], stats.mean_sq[i] / stats.count[i]
        assert abs(float(phi.sum() - mean_sq)) <= 1e-10 * float(mean_sq), site
        torch.testing.assert_close(phi, truth["phi"], rtol=1e-9, atol=1e-12 * float(truth["mean_sq"]))
        dims, positions = rows[i * per_site], rows[i * per_site + 1 : (i + 1) * per_site - 1]
        assert rows[(i + 1) * per_site - 1]["count"] == 0  # run_probe was given no document starts
        tokens = x.shape[0] * x.shape[1]
        assert (dims["layer"], dims["site"], dims["count"]) == (site.layer, site.site, tokens)
        total = float(truth["mean_sq"]) * tokens
        for row, (fraction, mean_sq_in) in zip(positions, truth["buckets"], strict=True):
            assert row["count"] == fraction.numel()
            if fraction.numel():
                assert row["mean"] == pytest.approx(float(fraction.mean()), rel=1e-5, abs=1e-12)
                assert row["mean_sq_share"] == pytest.approx(float(mean_sq_in) / total, rel=1e-9)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_models_norm_inputs_match_the_direct_computation(norm: str) -> None:
    sequences = torch.randint(0, 50257, (7, 32), generator=torch.Generator().manual_seed(0))
    captured_check(tiny_gpt(norm), sequences)


@pytest.mark.slow
def test_smollm2_activations_match_the_direct_computation(smollm2_model_and_tokenizer) -> None:
    """Real weights (the packaged SmolLM2-135M, RMSNorm): its first position holds massive activations."""
    model, tokenizer = smollm2_model_and_tokenizer
    text = " ".join(["Normalization layers keep the hidden vectors of a transformer on a sphere."] * 12)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0, :128]
    captured_check(model, ids.view(2, 64), forward=lambda batch: model(input_ids=batch))


def test_the_pipeline_writes_the_file_when_asked_and_the_reader_reads_it(tmp_path: Path) -> None:
    model = tiny_gpt("rms")
    ids = torch.randint(0, 50257, (5 * 32 + 9,), generator=torch.Generator().manual_seed(4))
    options = {"batch_size": 8, "model_name": "tiny", "step": 3, "tokens_per_step": 10}
    references = make_references(32)
    on = measure_records(model, ids, 32, references, ProbeConfig(tokens=len(ids), intervention=[]), **options)
    off = measure_records(model, ids, 32, references,
                          ProbeConfig(tokens=len(ids), intervention=[], mean_sources=False), **options)
    assert MEAN_SOURCES_FILE not in off.files
    assert {name: rows for name, rows in on.files.items() if name != MEAN_SOURCES_FILE} == off.files
    rows = on.files[MEAN_SOURCES_FILE]
    assert len(rows) == 5 * (2 + len(BUCKET_STARTS))  # ln1, ln2 of 2 blocks and the final norm
    assert {row["kind"] for row in rows} == {"dimensions", "position"}
    assert all(row["step"] == 3 and row["tokens_seen"] == 30 and row["norm"] == "rms" for row in rows)
    assert all(row["count"] == len(ids) for row in rows if row["kind"] == "dimensions")
    write_step(tmp_path / MEAN_SOURCES_FILE, rows)
    (tmp_path / "angles.jsonl").write_text("")
    write_step(tmp_path / "angles.jsonl", on.rows)
    assert read_rows(tmp_path / MEAN_SOURCES_FILE) == rows
    assert read_run_records(tmp_path)[MEAN_SOURCES_FILE] == rows


def test_windows_too_short_for_a_bucket_get_one_warning_and_the_probe_goes_on(caplog) -> None:
    """A bucket no window reaches is said once, where the probe announces its cost (the first probe of a run,
    every analysis), and its rows hold count 0; windows that reach every bucket say nothing."""
    assert empty_buckets(32) == ["64-255", "256+"] and empty_buckets(256) == ["256+"]
    assert empty_buckets(257) == []
    model = tiny_gpt("rms")
    ids = torch.randint(0, 50257, (2 * 32,), generator=torch.Generator().manual_seed(5))
    probe = ProbeConfig(tokens=len(ids), intervention=[])
    with caplog.at_level(logging.WARNING, logger="normgeo.measure.pipeline"):
        records = measure_records(model, ids, 32, make_references(32), probe, batch_size=8, model_name="tiny",
                                  step=None, tokens_per_step=None, announce_cost=True)
        measure_records(model, ids, 32, make_references(32), probe, batch_size=8, model_name="tiny",
                        step=None, tokens_per_step=None)  # a later probe of the same run: not said again
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == ["probe windows of 32 tokens: mean_sources.jsonl's position bucket(s) 64-255, 256+ hold "
                    "no tokens (count 0); a longer seq_len (analyze.py: model.seq_len) reaches them"]
    rows = records.files[MEAN_SOURCES_FILE]
    empty = [r for r in rows if r["kind"] == "position" and r["bucket"] in ("64-255", "256+")]
    assert len(empty) == 2 * 5 and all(r["count"] == 0 for r in empty)


SEPARATOR = 50256  # GPT-2's end-of-text, the training probe's separator


def test_document_starts_are_the_streams_first_token_and_the_tokens_after_a_separator() -> None:
    ids = np.array([5, 6, SEPARATOR, 7, SEPARATOR, SEPARATOR, 8, 9, SEPARATOR])
    assert document_starts(ids, SEPARATOR).tolist() == [True, False, False, True, False, False, True, False,
                                                        False]  # a separator begins no document
    assert document_starts(np.array([SEPARATOR, 4, 5]), SEPARATOR).tolist() == [False, True, False]
    assert document_starts(ids, None) is None


def test_probe_ids_open_with_a_document_and_close_each_with_the_separator(tmp_path: Path) -> None:
    """What document_starts assumes of probe_ids: the stream's first token is its first document's, and
    each document's first token follows the previous document's separator."""
    texts = ["The first document.", "A second one, a little longer than the first.", "Third."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    encode, eot, _ = tiktoken_batch_encoder("gpt2")
    lengths = [len(ids) for ids in encode(texts)]
    total = sum(lengths) + len(texts)
    ids = probe_ids(LocalFilesSource(str(tmp_path)), encode, eot, ProbeConfig(tokens=total, sample=False))
    assert eot == tiktoken_separator() == SEPARATOR and ids[-1] == eot and ids[0] != eot
    expected = np.zeros(total, dtype=bool)
    expected[np.cumsum([0, *(n + 1 for n in lengths[:-1])])] = True
    assert document_starts(ids, eot).tolist() == expected.tolist()


def test_a_long_document_cannot_fill_the_probe_past_max_doc_tokens(tmp_path: Path) -> None:
    """One very long article and several short ones (real tiktoken, the real probe_ids): without a cap the
    long one fills the probe; with probe.max_doc_tokens each document gives at most that many tokens (then
    its separator), so the probe spans several documents, and a short one under min_doc_tokens is still
    skipped."""
    long_text = " ".join(f"The long article's sentence number {i} goes on." for i in range(400))
    short = [f"Short article {i}: a few words about topic {i}, enough to pass the minimum." for i in range(6)]
    texts = [long_text, "Stub.", *short]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    encode, eot, _ = tiktoken_batch_encoder("gpt2")
    lengths = [len(ids) for ids in encode(texts)]
    cap = 64
    tokens = cap + 1 + sum(n + 1 for n in lengths[2:])  # the cut article and every short one, separators too
    assert lengths[0] > 10 * tokens and lengths[1] < 8 <= min(lengths[2:]) and max(lengths[2:]) < cap
    source = LocalFilesSource(str(tmp_path))
    uncapped = probe_ids(source, encode, eot, ProbeConfig(tokens=tokens, sample=False, min_doc_tokens=8))
    assert document_starts(uncapped, eot).sum() == 1  # the long article is the whole probe
    capped = ProbeConfig(tokens=tokens, sample=False, min_doc_tokens=8, max_doc_tokens=cap)
    ids = probe_ids(source, encode, eot, capped)
    starts = np.flatnonzero(document_starts(ids, eot))
    assert len(starts) == 1 + len(short)  # the long one cut, the stub skipped, every short one whole
    assert ids[:cap].tolist() == encode([long_text])[0][:cap] and ids[cap] == eot
    assert ids[cap + 1 : cap + 1 + lengths[2]].tolist() == encode([short[0]])[0]
    assert ProbeConfig(tokens=tokens, min_doc_tokens=8, max_doc_tokens=7).size_refusal(16).startswith(
        "probe.max_doc_tokens=7: below probe.min_doc_tokens=8")
    assert ProbeConfig(tokens=tokens, min_doc_tokens=8, max_doc_tokens=8).size_refusal(16) is None


def test_the_document_start_row_is_a_direct_recomputation_over_the_tokens_after_a_separator() -> None:
    """Documents that cross the probe windows (16 tokens; 3 windows and a 5-token tail): the stream's first
    document at window 0's position 0, one mid-window, one whose separator is window 0's last token (so it
    starts at window 1's position 0), one mid window 2 and one at the tail window's position 0. The
    doc_start row equals the float64 recomputation over those tokens of the captured norm inputs; without a
    separator it is empty and nothing else changes."""
    model, length = tiny_gpt("layer"), 16
    ids = torch.randint(0, 50000, (3 * length + 5,), generator=torch.Generator().manual_seed(6))
    separators = [6, length - 1, 2 * length + 4, 3 * length - 1]
    ids[separators] = SEPARATOR
    starts = torch.zeros(len(ids), dtype=torch.bool)
    starts[[0, *(index + 1 for index in separators)]] = True  # stream positions 0, 7, 16, 37, 48
    norms = residual_norms(find_norm_sites(model))
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(norms))}
    handles = [norm.module.register_forward_hook(
        lambda module, inputs, output, i=i: captured[i].append(inputs[0].detach().clone()))
        for i, norm in enumerate(norms)]
    probe = ProbeConfig(tokens=len(ids), intervention=[])
    options = {"batch_size": 2, "model_name": "tiny", "step": None, "tokens_per_step": None}
    try:
        files = measure_records(model, ids, length, make_references(32), probe, separator=SEPARATOR,
                                **options).files
    finally:
        for handle in handles:
            handle.remove()
    rows = files[MEAN_SOURCES_FILE]
    assert all(record_problem(row) is None for row in rows)
    doc_rows = [r for r in rows if r.get("bucket") == DOC_START]
    assert len(doc_rows) == len(norms)
    for i, row in enumerate(doc_rows):
        # The batches in order are the stream in order: windows are its consecutive slices.
        x = torch.cat([part.reshape(-1, part.shape[-1]) for part in captured[i]]).to(torch.float64)
        assert len(x) == len(ids)
        mu = x.mean(dim=-1)
        fraction = (mu.square() / x.square().mean(dim=-1))[starts]
        assert (row["first_position"], row["last_position"], row["count"]) == (None, None, 5)
        assert row["mean"] == pytest.approx(float(fraction.mean()), rel=1e-5)  # float32 sums over d
        assert row["std"] == pytest.approx(float(fraction.std(unbiased=False)), rel=1e-4)
        assert row["min"] == pytest.approx(float(fraction.min()), rel=1e-5)
        assert row["max"] == pytest.approx(float(fraction.max()), rel=1e-5)
        assert row["p50"] == pytest.approx(float(fraction.median()), rel=0.03)  # 100 bins per decade
        share = mu[starts].square().sum() / mu.square().sum()
        assert row["mean_sq_share"] == pytest.approx(float(share), rel=1e-9)
    # It overlaps the window positions' buckets: theirs alone partition the tokens.
    window_rows = [r for r in rows if r["kind"] == "position" and r["bucket"] != DOC_START]
    assert sum(r["count"] for r in window_rows) == len(ids) * len(norms)
    assert sum(r["mean_sq_share"] for r in window_rows) == pytest.approx(len(norms), rel=1e-9)

    unknown = measure_records(model, ids, length, make_references(32), probe, **options).files
    assert {name: rows for name, rows in unknown.items() if name != MEAN_SOURCES_FILE} == {
        name: rows for name, rows in files.items() if name != MEAN_SOURCES_FILE}
    without = unknown[MEAN_SOURCES_FILE]
    # Without a separator the documents are unknown too: the shares keep their values, not their intervals.
    by_documents = {"documents", *(f"{share}_{end}" for share in SHARES for end in ("low", "high")),
                    *(f"inputs_median_{share}" for share in SHARES)}
    kept = [{k: v for k, v in r.items() if k not in by_documents}
            for r in rows if r.get("bucket") != DOC_START]
    assert [{k: v for k, v in r.items() if k not in by_documents}
            for r in without if r.get("bucket") != DOC_START] == kept
    assert all(r[field] is None for r in without if r["kind"] == "dimensions" for field in by_documents)
    assert all(r["documents"] == 5 for r in rows if r["kind"] == "dimensions")
    empty = [r for r in without if r.get("bucket") == DOC_START]
    assert len(empty) == len(norms) and all(r["count"] == 0 and r["mean_sq_share"] is None for r in empty)
    assert all(r[field] is None for r in empty for field in ("mean", "std", "min", "max", *QUANTILE_FIELDS))


def test_the_document_starts_add_no_host_sync() -> None:
    """The masks go to the device once per probe and are masked in, never selected: the probe's batches
    make no host sync (bench/probe_cost.py counts them on the CPU's profiler) with them, as without."""
    spec = importlib.util.spec_from_file_location("probe_cost", ROOT / "bench" / "probe_cost.py")
    probe_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_cost)
    model = tiny_gpt("rms")
    norms = residual_norms(find_norm_sites(model))
    tokens = torch.randint(0, 50257, (4, 32), generator=torch.Generator().manual_seed(7))
    starts = torch.rand(4, 32, generator=torch.Generator().manual_seed(7)) < 0.2

    def syncs(document_starts: list[torch.Tensor] | None) -> tuple[int, int]:
        measurement = MeanSourcesMeasurement(norms)
        with gpu_code_path(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            run_probe(model, [tokens], [measurement], norms=norms, batch_size=2,
                      document_starts=document_starts)
        doc = measurement.records(KEYS)[MEAN_SOURCES_FILE][-1]
        return probe_cost.op_counts(prof.events())["syncs"], doc["count"]

    assert syncs(None)[0] == 0 and syncs([starts]) == (0, int(starts.sum()))


def test_record_problem_accepts_the_rows_and_refuses_a_numeric_bucket() -> None:
    row = rows_of(MeanSourcesStatistics([4]), 4)[1]
    assert record_problem(row) is None
    assert "expected text" in record_problem({**row, "bucket": 0})
    assert not math.isnan(row["first_position"])


def test_the_passes_in_chunks_give_the_whole_batch_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's chunks of tokens (mean_sources.CHUNK_TOKENS, uneven here) give the state of one pass over the
    batch: the same |x| histogram, median band and maxima, the same sums to float64 rounding, over two batches
    (the band is chosen from the first batch's whole histogram, not from its first chunk)."""
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randn(3, 40, 24, generator=generator) * torch.rand(24, generator=generator) * 4
               for _ in range(2)]
    batches[0][:, :5] *= 50  # the first tokens far from the rest: a first chunk's median is not the batch's
    starts = torch.rand(3, 40, generator=generator) < 0.1
    documents = torch.arange(120).view(3, 40) // 13

    def state(chunk: int) -> MeanSourcesStatistics:
        monkeypatch.setattr(mean_sources, "CHUNK_TOKENS", chunk)
        stats = MeanSourcesStatistics([24], documents=10)
        for x in batches:
            stats.update(0, x, starts, documents)
        return stats

    whole, chunked = state(10**6), state(7)
    for field in ("abs_hist", "band_hist", "band_start", "count"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field)), field
    assert torch.equal(chunked.max_abs[0], whole.max_abs[0])
    for field in ("mean_sq", "bucket_mean_sq", "unit_mean_sq", "unit_first_sq"):
        torch.testing.assert_close(getattr(chunked, field), getattr(whole, field), rtol=1e-12, atol=0)
    torch.testing.assert_close(chunked.phi[0], whole.phi[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(chunked.unit_phi[0], whole.unit_phi[0], rtol=1e-12, atol=1e-15)
