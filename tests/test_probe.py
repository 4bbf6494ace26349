"""The angle probe on a real model: exact against captured tensors, distributed, crash-safe output."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models.gpt import GPT, GPTConfig
from normgeo.measure.angles import AngleMeasurement
from normgeo.measure.geometry import angle_deg
from normgeo.measure.mean_sources import DOC_START
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import probe_angles, run_probe
from normgeo.measure.probe import REFERENCE_NAMES, make_references, residual_norms
from normgeo.measure.records import FIELDS, read_rows, statistics_rows, write_step
from tests.ddp_probe_worker import DOCUMENT_STARTS, DOCUMENT_WINDOWS, probe_rows

ROOT = Path(__file__).resolve().parent.parent


def tiny_gpt(norm: str) -> GPT:
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, norm=norm), seed=0).eval()


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_probe_angles_match_a_direct_computation_on_captured_tensors(norm: str) -> None:
    model = tiny_gpt(norm)
    sequences = torch.randint(0, 50257, (10, 16), generator=torch.Generator().manual_seed(0))
    references = make_references(32)
    captured: dict[tuple, list[torch.Tensor]] = {}
    handles = []
    for site in find_norm_sites(model):
        def hook(module, inputs, output, site=site):
            captured.setdefault((site.layer, f"{site.role}.in"), []).append(inputs[0].detach().clone())
            captured.setdefault((site.layer, f"{site.role}.out"), []).append(output.detach().clone())
        handles.append(site.module.register_forward_hook(hook))
    sites, stats = probe_angles(model, sequences, references, batch_size=3, include_standardized=False)
    for handle in handles:
        handle.remove()
    rows = statistics_rows(sites, stats, model="tiny", norm=norm, step=0, tokens_seen=0)
    assert len(rows) == (3 * 4 + 2) * 3
    assert {r["site"] for r in rows} == {"ln1.in", "ln1.out", "ln2.in", "ln2.out", "final.in", "final.out"}
    for row in rows:
        vectors = torch.cat(captured[(row["layer"], row["site"])]).reshape(-1, 32).double()
        angles = angle_deg(vectors, torch.from_numpy(references[row["ref"]])).numpy()
        assert row["count"] == len(angles) == 160 and row["zero_count"] == 0
        assert row["mean_deg"] == pytest.approx(angles.mean(), abs=1e-4)
        assert row["std_deg"] == pytest.approx(angles.std(), abs=1e-4)
        assert row["min_deg"] == pytest.approx(angles.min(), abs=1e-3)
        assert row["max_deg"] == pytest.approx(angles.max(), abs=1e-3)
        # With few tokens a quantile is only defined up to the gap between neighbouring order statistics.
        ordered = np.sort(angles)
        assert ordered[79] - 0.025 <= row["p50"] <= ordered[80] + 0.025
        norms = vectors.norm(dim=1)
        assert row["norm_mean"] == pytest.approx(norms.mean().item(), rel=1e-5)
        assert row["rms_mean"] == pytest.approx(norms.mean().item() / math.sqrt(32), rel=1e-5)
    assert list(rows[0]) == list(FIELDS)


def test_layernorm_standardization_is_orthogonal_to_ones_but_rms_is_not() -> None:
    sequences = torch.randint(0, 50257, (4, 16), generator=torch.Generator().manual_seed(1))
    for norm in ("layer", "rms"):
        model = tiny_gpt(norm)
        # Give every residual vector a component along 1, so that only mean subtraction removes it.
        with torch.no_grad():
            model.wpe.weight += 0.5
        sites, stats = probe_angles(model, sequences, make_references(32), include_standardized=True)
        rows = statistics_rows(sites, stats, model="tiny", norm=norm, step=0, tokens_seen=0)
        std_rows = [r for r in rows if r["site"].endswith(".std") and r["ref"] == "ones"]
        if norm == "layer":
            assert all(abs(r["mean_deg"] - 90) < 1e-3 and abs(r["max_deg"] - 90) < 1e-2 for r in std_rows)
        else:
            assert any(abs(r["mean_deg"] - 90) > 1 for r in std_rows)


@pytest.mark.parametrize("windows", [1, 7, 19])
def test_padding_runs_forward_passes_but_measures_only_the_real_sequences(windows: int) -> None:
    """Rank 1 of 2, which holds fewer probe windows, makes as many forward passes as rank 0 (FSDP)."""
    model = tiny_gpt("layer")
    part = torch.randint(0, 50257, (windows, 16), generator=torch.Generator().manual_seed(1))
    real = part[1::2]  # rank 1's windows: 0, 3 and 9 of them
    norms = residual_norms(find_norm_sites(model))
    calls: list[int] = []
    forward = lambda batch: calls.append(len(batch)) or model(batch)  # noqa: E731
    angles = AngleMeasurement(norms, make_references(32), num_sequences=windows)
    run_probe(model, [part], [angles], norms=norms, batch_size=4, forward=forward, rank=1, world_size=2)
    padded = angles.stats
    share = -(-windows // 2)  # rank 0's
    assert calls == [min(4, share - start) for start in range(0, share, 4)]  # whatever rank 1 really holds
    measured = len(real)
    assert padded.count.eq(measured * 16).all() and padded.norm_count.eq(measured * 16).all()
    assert padded.null_count.eq(measured * 16).all() and padded.seq_count.sum(dim=1).eq(measured * 16).all()
    assert padded.seq_count[:, 1::2].sum() == padded.seq_count.sum()  # rank 1's global ids are the odd ones
    if measured:
        _, plain = probe_angles(model, real, make_references(32), batch_size=4)
        torch.testing.assert_close(padded.mean, plain.mean)
        assert torch.equal(padded.hist, plain.hist)


def test_the_progress_bar_shows_tokens_per_second_and_the_time_left(capsys) -> None:
    """analyze.py's bar (progress=true): forwards done of all the probe's (the intervention's counted), the
    time left, and the probe tokens measured per second."""
    model = tiny_gpt("layer")
    norms = residual_norms(find_norm_sites(model))
    part = torch.randint(0, 50257, (6, 16), generator=torch.Generator().manual_seed(2))
    angles = AngleMeasurement(norms, make_references(32), num_sequences=6)
    run_probe(model, [part], [angles], norms=norms, batch_size=2, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"3\.0/3\.0 forwards \[\d\d:\d\d<\d\d:\d\d, [\d,]+ tokens/s\]", bar), bar


def test_references_are_model_independent_and_have_the_promised_norms() -> None:
    refs = make_references(512, seed=1234)
    again = make_references(512, seed=1234)
    assert all(np.array_equal(refs[n], again[n]) for n in REFERENCE_NAMES)
    assert np.linalg.norm(refs["ones"]) == pytest.approx(math.sqrt(512))
    assert np.linalg.norm(refs["rand_a"]) == pytest.approx(math.sqrt(512))
    assert abs(np.linalg.norm(refs["rand_b"]) - math.sqrt(512)) > 10


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_two_process_ddp_probe_equals_one_process(tmp_path: Path) -> None:
    # One process: the worker's probe here (no process group); two: its gloo processes, written as JSON.
    outputs = {1: json.loads(json.dumps(probe_rows(0, 1)))}
    out = tmp_path / "rows2.json"
    subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_probe_worker.py"), "2", str(out), free_port()],
                   check=True, timeout=300, cwd=ROOT)
    outputs[2] = json.loads(out.read_text())
    assert len(outputs[1]["angles"]) == len(outputs[2]["angles"]) > 0
    for single, multi in zip(outputs[1]["angles"], outputs[2]["angles"], strict=True):
        assert (single["layer"], single["site"], single["ref"]) == (
            multi["layer"],
            multi["site"],
            multi["ref"],
        )
        assert single["count"] == multi["count"] == 24 * 16 + 7  # the tail window too (on rank 0)
        for field in ("mean_deg", "std_deg", "min_deg", "max_deg", "norm_mean", "norm_std"):
            assert multi[field] == pytest.approx(single[field], abs=1e-5), field
        for q in ("p01", "p05", "p25", "p50", "p75", "p95", "p99"):
            assert multi[q] == pytest.approx(single[q], abs=1e-5), q  # histograms are summed exactly
    # Null directions: moments merged with Chan's formula; the per-sequence sums (each sequence measured on
    # one rank) summed, so the same bootstrap seed gives the same intervals.
    assert len(outputs[1]["null"]) == len(outputs[2]["null"]) == 5 * 3  # in, std, out
    for single, multi in zip(outputs[1]["null"], outputs[2]["null"], strict=True):
        assert (single["layer"], single["site"], single["sequences"]) == (multi["layer"], multi["site"], 25)
        for field in ("null_means", "null_stds"):
            np.testing.assert_allclose(multi[field], single[field], atol=1e-6)
        for field in ("mean_deg", "null_mean_p50", "mean_rank_pct", "std_z", "mean_ci_low", "mean_ci_high",
                      "diff_ci_low", "diff_ci_high"):
            assert multi[field] == pytest.approx(single[field], abs=1e-6), field
    # The centering intervention: each rank runs every scope's forward on its share (padded batches too), the
    # per-sequence and per-bin sums are all-reduced, so the intervals are a single process's.
    # all, blocks 0-1, final
    assert len(outputs[1]["intervention"]) == len(outputs[2]["intervention"]) == 1 + 3
    for single, multi in zip(outputs[1]["intervention"], outputs[2]["intervention"], strict=True):
        assert (single["scope_name"], single["tokens"], single["sequences"]) == (
            multi["scope_name"], 24 * 15 + 6, 25)
        for field in (
            "delta_loss",
            "delta_loss_ci_low",
            "delta_loss_ci_high",
            "kl",
            "kl_ci_high",
            "top1_agreement",
        ):
            assert multi[field] == pytest.approx(single[field], abs=1e-6), field
        assert [b["tokens"] for b in multi["energy_bins"]] == [b["tokens"] for b in single["energy_bins"]]
    # By position: the per-sequence, per-bucket sums are all-reduced too (4 scopes x (6 buckets + the
    # document starts, on both ranks)).
    assert len(outputs[1]["intervention_positions"]) == len(outputs[2]["intervention_positions"]) == 4 * 7
    starts = [r for r in outputs[2]["intervention_positions"] if r["bucket"] == DOC_START]
    assert [(r["tokens"], r["sequences"]) for r in starts] == [(DOCUMENT_STARTS, DOCUMENT_WINDOWS)] * 4
    for single, multi in zip(outputs[1]["intervention_positions"], outputs[2]["intervention_positions"],
                             strict=True):
        assert (single["scope_name"], single["bucket"], single["tokens"], single["sequences"]) == (
            multi["scope_name"], multi["bucket"], multi["tokens"], multi["sequences"])
        for field in ("delta_loss", "delta_loss_ci_low", "delta_loss_ci_high", "kl", "delta_loss_share"):
            assert multi[field] == pytest.approx(single[field], abs=1e-6), field
    # Mean sources: sums, maxima and histograms of the ranks' tokens, so the rows are one process's.
    assert len(outputs[1]["mean_sources"]) == len(outputs[2]["mean_sources"]) == 5 * 8  # 5 norms, 1 + 6 + 1
    starts = [r for r in outputs[2]["mean_sources"] if r.get("bucket") == DOC_START]
    assert [r["count"] for r in starts] == [DOCUMENT_STARTS] * 5 and starts[0]["mean_sq_share"] > 0
    for single, multi in zip(outputs[1]["mean_sources"], outputs[2]["mean_sources"], strict=True):
        assert single.keys() == multi.keys()
        for field, value in single.items():
            if isinstance(value, float) or (isinstance(value, list) and value
                                            and isinstance(value[0], float)):
                assert multi[field] == pytest.approx(value, rel=1e-9, abs=1e-12), field
            else:
                assert multi[field] == value, field


WRITER = """
import sys
sys.path.insert(0, {root!r})
from normgeo.measure.records import write_step
step = 0
while True:
    rows = [{{"model": "m", "norm": "layer", "step": step, "layer": i, "pad": [0.5] * 300}}
            for i in range(200)]
    write_step({path!r}, rows)
    step += 1
"""


def test_kill_mid_write_leaves_only_whole_steps(tmp_path: Path) -> None:
    path = tmp_path / "angles.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), path=str(path))])
    try:
        deadline = time.time() + 60
        while (not path.exists() or path.stat().st_size < 2_000_000) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.137)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    rows = read_rows(path)  # every line parses
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(len(steps))) and len(steps) >= 5
    assert all(sum(r["step"] == s for r in rows) == 200 for s in steps)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["angles.jsonl"]


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "angles.jsonl"
    write_step(path, [{"model": "m", "norm": "rms", "step": s, "layer": i, "v": 1}
                      for i, s in enumerate((0, 0, 1000))])
    write_step(path, [{"model": "m", "norm": "rms", "step": 1000, "layer": 2, "v": 2}])
    rows = read_rows(path)
    assert [(r["step"], r["v"]) for r in rows] == [(0, 1), (0, 1), (1000, 2)]
