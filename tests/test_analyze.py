"""analyze.py on real weights: recorded angles equal a direct computation, LayerNorm's standardization is
exactly 90 degrees to 1, the CLI writes its outputs (Hugging Face model and our own checkpoint), and bad
inputs end with a clear message and exit code 2."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from corpus.sources import LocalFilesSource
from models.pretrained import hf_encoder, hf_forward, load_checkpoint
from normgeo.analysis import main as summary_main
from normgeo.figures.model_summary import pool
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import measure_records, probe_ids
from normgeo.measure.probe import make_references
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.records import null_rows, read_rows, statistics_rows
from tests.conftest import ROOT, entry_point_here, save_our_checkpoint

SEQ_LEN, BATCH = 32, 2
TOKENS = 3 * SEQ_LEN + 12  # two batches of windows and a shorter remainder sequence


@pytest.fixture(scope="module")
def smollm2(smollm2_model_and_tokenizer):
    return smollm2_model_and_tokenizer


@pytest.fixture(scope="module")
def minilm(minilm_model_and_tokenizer):
    return minilm_model_and_tokenizer


def _wiki(shared: Path) -> LocalFilesSource:
    return LocalFilesSource(str(shared / "corpora" / "wikipedia" / "wikitext-2-raw"))


def _probe(model, tokenizer, shared: Path) -> tuple[list[torch.Tensor], dict[tuple, dict]]:
    """The sequences analyze.py measures and its records, by (layer, site, ref) and, for null.jsonl's,
    by (layer, site, "null")."""
    encode, separator = hf_encoder(tokenizer)
    ids = probe_ids(_wiki(shared), encode, separator, ProbeConfig(tokens=TOKENS, sample=False))
    norms = find_norm_sites(model)
    references = make_references(norms[0].dim, 1234)
    records = measure_records(
        model,
        ids,
        SEQ_LEN,
        references,
        ProbeConfig(tokens=TOKENS, intervention=[]),
        batch_size=BATCH,
        model_name="m",
        step=None,
        tokens_per_step=None,
        with_null=False,
        forward=hf_forward(model),
        norms=norms,
    )
    sites, stats = records.sites, records.stats
    rows = statistics_rows(sites, stats, model="m", norm="x", step=None, tokens_seen=len(ids))
    null = null_rows(
        sites, stats, model="m", norm="x", step=None, tokens_seen=len(ids), replicates=400, seed=5
    )
    # The interval is a function of the per-sequence sums and the seed: the same seed, the same numbers.
    assert null == null_rows(
        sites, stats, model="m", norm="x", step=None, tokens_seen=len(ids), replicates=400, seed=5
    )
    other = null_rows(
        sites, stats, model="m", norm="x", step=None, tokens_seen=len(ids), replicates=400, seed=6
    )
    assert [r["mean_ci_low"] for r in other] != [r["mean_ci_low"] for r in null]
    assert {r["sequences"] for r in null} == {4}  # 3 windows and the shorter remainder
    tokens = torch.from_numpy(ids)
    sequences = [tokens[: 3 * SEQ_LEN].view(3, SEQ_LEN), tokens[3 * SEQ_LEN :].unsqueeze(0)]
    by_key = {(r["layer"], r["site"], r["ref"]): r for r in rows}
    by_key.update({(r["layer"], r["site"], "null"): r for r in null})
    return sequences, by_key


def _assert_angles(
    rows: dict[tuple, dict], layer, site: str, vectors: list[torch.Tensor], ref_name: str = "ones"
):
    """The record's count/mean/min/max against angles computed here in float64."""
    x = torch.cat([v.reshape(-1, v.shape[-1]) for v in vectors]).double()
    ref = torch.from_numpy(make_references(x.shape[-1], 1234)[ref_name])
    degrees = torch.rad2deg(torch.arccos((x @ ref) / (x.norm(dim=-1) * ref.norm()))).numpy()
    row = rows[(layer, site, ref_name)]
    assert row["count"] == len(degrees) == TOKENS
    assert row["mean_deg"] == pytest.approx(degrees.mean(), abs=1e-4)
    assert row["std_deg"] == pytest.approx(degrees.std(), abs=1e-4)
    assert row["min_deg"] == pytest.approx(degrees.min(), abs=1e-3)
    assert row["max_deg"] == pytest.approx(degrees.max(), abs=1e-3)
    if ref_name == "ones":
        _assert_null(rows[(layer, site, "null")], x, degrees)


def _assert_null(row: dict, x: torch.Tensor, ones: np.ndarray) -> None:
    """null.jsonl's row against the K null directions' angles computed here in float64 (within 0.01 deg)."""
    null = torch.from_numpy(make_references(x.shape[-1], 1234)["null"])
    degrees = torch.rad2deg(
        torch.arccos((x @ null.T) / (x.norm(dim=-1, keepdim=True) * null.norm(dim=-1)))
    ).numpy()
    means, stds = degrees.mean(0), degrees.std(0)
    assert row["null_k"] == 64 and row["count"] == TOKENS
    np.testing.assert_allclose(row["null_means"], means, atol=1e-2)
    np.testing.assert_allclose(row["null_stds"], stds, atol=1e-2)
    low, mid, high = np.quantile(means, [0.05, 0.5, 0.95])
    assert (row["null_mean_p05"], row["null_mean_p50"], row["null_mean_p95"]) == pytest.approx(
        (low, mid, high), abs=1e-2
    )
    assert row["mean_deg"] == pytest.approx(ones.mean(), abs=1e-4)
    assert row["mean_rank_pct"] == pytest.approx(100 * np.mean(means < ones.mean()))
    assert row["mean_z"] == pytest.approx((ones.mean() - means.mean()) / means.std(ddof=1), abs=1e-3)
    assert row["in_null_band"] == bool(low <= ones.mean() <= high)
    assert row["diff_deg"] == pytest.approx(ones.mean() - mid, abs=1e-2)
    assert row["mean_ci_low"] < row["mean_deg"] < row["mean_ci_high"]
    assert row["diff_ci_low"] <= row["diff_deg"] <= row["diff_ci_high"]


@pytest.mark.slow
def test_smollm2_angles_match_hidden_states(smollm2, shared: Path) -> None:
    model, tokenizer = smollm2
    sequences, rows = _probe(model, tokenizer, shared)
    embeddings, first_norm, middle, final_in, final_out = [], [], [], [], []
    handle = model.norm.register_forward_hook(lambda module, inputs, output: final_in.append(inputs[0]))
    try:
        with torch.no_grad():
            for sequence in sequences:
                out = model(input_ids=sequence, output_hidden_states=True, use_cache=False)
                # hidden_states[i] is the input of block i, whose first op is input_layernorm (ln1).
                embeddings.append(out.hidden_states[0])
                first_norm.append(model.layers[0].input_layernorm(out.hidden_states[0]))
                middle.append(out.hidden_states[15])
                final_out.append(out.last_hidden_state)
    finally:
        handle.remove()
    for ref in ("ones", "rand_a", "rand_b"):
        _assert_angles(rows, 0, "ln1.in", embeddings, ref)
    _assert_angles(rows, 0, "ln1.out", first_norm)
    _assert_angles(rows, 15, "ln1.in", middle)
    _assert_angles(rows, "final", "final.in", final_in)
    _assert_angles(rows, "final", "final.out", final_out)
    # RMSNorm's standardization only rescales: its direction, hence its angles, are the input's.
    for layer, site in ((0, "ln1"), (15, "ln2"), ("final", "final")):
        assert rows[(layer, f"{site}.std", "ones")]["mean_deg"] == pytest.approx(
            rows[(layer, f"{site}.in", "ones")]["mean_deg"], abs=1e-4
        )


def test_minilm_angles_match_embeddings_and_std_is_orthogonal(minilm, shared: Path) -> None:
    model, tokenizer = minilm
    sequences, rows = _probe(model, tokenizer, shared)
    summed, normed, block_out = [], [], []
    emb = model.embeddings
    with torch.no_grad():
        for sequence in sequences:
            positions = torch.arange(sequence.shape[1]).expand_as(sequence)
            # The input of the embeddings LayerNorm, spelled out: word + position + segment 0.
            summed.append(
                emb.word_embeddings(sequence) + emb.position_embeddings(positions)
                + emb.token_type_embeddings(torch.zeros_like(sequence))
            )
            out = model(input_ids=sequence, output_hidden_states=True)
            normed.append(out.hidden_states[0])  # = the embeddings LayerNorm's output
            block_out.append(out.hidden_states[1])  # block 0 ends with its output LayerNorm (post-LN)
    _assert_angles(rows, "embed", "embed.in", summed)
    _assert_angles(rows, "embed", "embed.out", normed)
    _assert_angles(rows, 0, "mlp_out.out", block_out)
    eps = model.config.layer_norm_eps
    _assert_angles(rows, "embed", "embed.std", [F.layer_norm(s, s.shape[-1:], eps=eps) for s in summed])
    std_rows = [r for (_, site, ref), r in rows.items() if site.endswith(".std") and ref == "ones"]
    assert len(std_rows) == len(find_norm_sites(model)) == 13
    for row in std_rows:
        assert abs(row["mean_deg"] - 90) < 1e-3 and row["count"] == TOKENS
        assert abs(row["min_deg"] - 90) < 1e-2 and abs(row["max_deg"] - 90) < 1e-2


def test_pool_is_exact() -> None:
    rng = np.random.default_rng(0)
    samples = [rng.normal(90 + i, 1 + i, size=n) for i, n in enumerate((5, 300, 17, 1))]
    rows = [
        {"count": len(s), "zero_count": 0, "mean_deg": s.mean(), "std_deg": s.std(), "min_deg": s.min(),
         "max_deg": s.max()}
        for s in samples
    ]
    everything = np.concatenate(samples)
    pooled = pool(rows)
    assert pooled["vectors"] == len(everything) and pooled["sites"] == 4 and pooled["tokens"] == 300
    assert pooled["mean_deg"] == pytest.approx(everything.mean(), rel=1e-12)
    assert pooled["std_deg"] == pytest.approx(everything.std(), rel=1e-10)
    assert (pooled["min_deg"], pooled["max_deg"]) == (everything.min(), everything.max())
    # A mean of means would be pulled to the small groups; the pooled mean is not.
    assert abs(np.mean([r["mean_deg"] for r in rows]) - everything.mean()) > 0.3


# The command line


def _analyze(*overrides: str) -> subprocess.CompletedProcess:
    """``python analyze.py progress=false <overrides>``, through its main in this process."""
    return entry_point_here("analyze", ["progress=false", *overrides])


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"analyze.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.fixture(scope="module")
def our_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_our_checkpoint(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, shared: Path, our_checkpoint: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    _ok(
        _analyze(
            "model=minilm",
            "probe=local",
            f"probe.path={shared / 'corpora' / 'wikipedia'}",
            "probe.tokens=4096",
            "model.seq_len=4096",
            "probe.intervention=[all,layers]",
            f"output_root={root}",
        )
    )
    _ok(_analyze("model=checkpoint", f"model.checkpoint={our_checkpoint}", "model.name=ours-rms",
                 "probe=pydoc", "probe.tokens=300", "probe.intervention=[all,layers]", f"output_root={root}"))
    return {"minilm": root / "analyze" / "minilm", "ours": root / "analyze" / "ours-rms"}


def _summary(path: Path) -> dict[tuple, dict]:
    with open(path) as handle:
        return {(r["model"], r["site"], r["ref"]): r for r in csv.DictReader(handle)}


@pytest.mark.slow
def test_the_mean_sources_page_says_what_the_records_hold(outputs: dict[str, Path]) -> None:
    """docs/mean_sources_page.py over an encoder (MiniLM, LayerNorm) and a language model (ours, RMSNorm): a
    section per model, the finding's numbers as the records give them, paths relative to the repository."""
    script = ROOT / "docs" / "mean_sources_page.py"
    done = subprocess.run([sys.executable, str(script), str(outputs["minilm"]), str(outputs["ours"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    page = done.stdout
    assert "## minilm (layer;" in page and "## ours-rms (rms;" in page
    assert f"`{os.path.relpath(outputs['ours'], ROOT)}`" in page  # the sources, relative to the repository
    for name, folder in outputs.items():
        rows = read_rows(folder / "mean_sources.jsonl")
        dims = [r for r in rows if r["kind"] == "dimensions"]
        first = [r["mean_sq_share"] for r in rows if r["kind"] == "position" and r["bucket"] == "0"]
        finding = next(line for line in page.splitlines() if line.startswith(f"- **{rows[0]['model']}**"))
        assert f"over its {len(dims)} norm inputs" in finding, finding
        # The median over the inputs, its 95% interval over the probe's documents (from the records), range.
        low, high = dims[0]["inputs_median_position0_share"][1:]
        median = (f"a median {100 * float(np.median(first)):.1f}% [{100 * low:.1f}%, {100 * high:.1f}%] "
                  f"(range {100 * min(first):.1f}%")
        assert median in finding, (name, finding)
        assert f"a bootstrap over the probe's {dims[0]['documents']:,} documents" in finding, finding
        # analyze.py knows the tokenizer's separator (MiniLM's SEP, our end-of-text): the document starts.
        starts = [r for r in rows if r["kind"] == "position" and r["bucket"] == "doc_start"]
        assert len(starts) == len(dims) and all(r["count"] > 0 for r in starts)
        assert f"The first tokens of the probe's documents ({starts[0]['count']}) are" in finding, finding
    positions = read_rows(outputs["ours"] / "intervention_positions.jsonl")
    share = next(r["delta_loss_share"] for r in positions if r["scope"] == "all" and r["bucket"] == "0")
    finding = next(line for line in page.splitlines() if line.startswith("- **ours-rms**"))
    assert f"position 0 make {100 * share:.1f}% of that change" in finding, finding
    doc = next(r for r in positions if r["scope"] == "all" and r["bucket"] == "doc_start")
    assert f"those at the documents' first tokens {100 * doc['delta_loss_share']:.1f}%" in finding, finding
    assert "| document starts (any position) |" in page
    minilm = next(line for line in page.splitlines() if line.startswith("- **minilm**"))
    assert "leaves a mean cosine of" in minilm, minilm


@pytest.mark.slow
def test_cli_minilm_writes_everything(outputs: dict[str, Path]) -> None:
    out = outputs["minilm"]
    rows = read_rows(out / "angles.jsonl")
    assert len(rows) == 13 * 3 * 3  # norms x (in, std, out) x references
    # A released model: no training step, and its training tokens are unknown (the probe's are `count`).
    assert {(r["model"], r["norm"], r["step"], r["tokens_seen"], r["count"]) for r in rows} == {
        ("minilm", "layer", None, None, 4096)
    }
    assert (out / "probe_references.npz").is_file()
    info = json.loads((out / "run_info.json").read_text())
    assert info["seq_len"] == 512 and info["tokens"] == 4096  # capped at MiniLM's 512 positions
    assert sorted(p.name for p in (out / "figures").glob("*.png")) == [
        "intervention_minilm_layer_pretrained.png", "layers_minilm_layer_pretrained.png",
        "mean_sources_minilm_layer_pretrained.png", "null_layers_minilm_layer_pretrained.png",
    ]
    null = read_rows(out / "null.jsonl")
    assert len(null) == 13 * 3 and {(r["null_k"], r["sequences"], r["count"]) for r in null} == {
        (64, 8, 4096)
    }
    assert len(np.load(out / "probe_references.npz")["null"]) == 64
    # LayerNorm's standardization puts every token at exactly 90 deg from 1: no random direction has so
    # small a spread over tokens.
    std_sites = [r for r in null if r["site"].endswith(".std")]
    assert all(r["std_deg"] < 1e-3 and r["std_rank_pct"] == 0 and r["null_std_p05"] > 1 for r in std_sites)
    summary = _summary(out / "summary.csv")
    assert len(summary) == 9
    std = summary[("minilm", "std", "ones")]
    assert int(std["sites"]) == 13 and int(std["vectors"]) == 13 * 4096
    assert abs(float(std["mean_deg"]) - 90) < 1e-3 and float(std["std_deg"]) < 1e-3
    pooled = pool(r for r in rows if r["site"].endswith(".in") and r["ref"] == "ones")
    assert float(summary[("minilm", "in", "ones")]["mean_deg"]) == pytest.approx(pooled["mean_deg"])
    markdown = (out / "summary.md").read_text()
    assert "| minilm | layer | std | 13 | 4,096 | 90.00 ± 0.00 |" in markdown
    # The per-norm view: mean |angle - 90| and the spread of the per-norm means, from the rows.
    means = np.array([r["mean_deg"] for r in rows if r["site"].endswith(".out") and r["ref"] == "ones"])
    out_ones = summary[("minilm", "out", "ones")]
    assert float(out_ones["norm_abs_dev_deg"]) == pytest.approx(np.abs(means - 90).mean())
    assert float(out_ones["between_norm_std_deg"]) == pytest.approx(means.std())
    assert int(out_ones["null_k"]) == 64 and int(out_ones["norms_in_null_band"]) == sum(
        r["in_null_band"] for r in null if r["site"].endswith(".out")
    )
    assert summary[("minilm", "out", "rand_a")]["null_k"] == ""


@pytest.mark.slow
def test_cli_minilm_intervention_reports_the_change_of_its_output_vectors(outputs: dict[str, Path]) -> None:
    """An encoder has no next token to predict: the centering intervention reports the cosine between its
    intact and intervened output vectors (with the block-bootstrap interval), and says so."""
    rows = read_rows(outputs["minilm"] / "intervention.jsonl")
    # all 13 norms, then each block's, as asked (the embedding
    # norm is its own "layer", run in full; the blocks resumed).
    assert [r["scope_name"] for r in rows] == ["all", "layer embed", *(f"layer {i}" for i in range(6))]
    for row in rows:
        assert row["output"] == "embedding" and row["action"] == "remove" and row["tokens"] == 4096
        assert row["delta_loss"] is None and row["kl"] is None
        assert -1 <= row["cosine_ci_low"] <= row["cosine"] <= row["cosine_ci_high"] <= 1
    assert len(rows[0]["sites"]) == 13 and rows[0]["cosine"] < 1  # MiniLM's inputs are not orthogonal to 1


@pytest.mark.slow
def test_cli_our_checkpoint(outputs: dict[str, Path], our_checkpoint: Path) -> None:
    rows = read_rows(outputs["ours"] / "angles.jsonl")
    assert len(rows) == 5 * 3 * 3  # 2 blocks x (ln1, ln2) + ln_f
    # The checkpoint's step; training tokens = step x global_batch x block_size, as the training probe.
    assert {(r["norm"], r["step"], r["tokens_seen"], r["count"]) for r in rows} == {
        ("rms", 7, 7 * 4 * 64, 300)
    }
    model, step, _ = load_checkpoint(our_checkpoint)
    assert step == 7 and model.config.norm == "rms" and model.config.block_size == 64
    assert list((outputs["ours"] / "figures").glob("layers_ours-rms_rms_step0000007.png"))
    # Our checkpoints always have their head: the intervention (centering added to RMSNorm) is next-token.
    changes = read_rows(outputs["ours"] / "intervention.jsonl")
    assert [(r["scope_name"], r["action"], r["output"], r["step"]) for r in changes] == [
        (name, "add", "next_token", 7) for name in ("all", "layer 0", "layer 1", "layer final")
    ]


def test_cross_model_summary(outputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        summary_main(["summary", str(outputs["minilm"]), str(outputs["ours"]), "--out", str(tmp_path)]) == 0
    )
    combined = _summary(tmp_path / "summary.csv")
    assert combined == {
        **_summary(outputs["minilm"] / "summary.csv"),
        **_summary(outputs["ours"] / "summary.csv"),
    }
    assert "ours-rms" in capsys.readouterr().out
    assert summary_main(["summary", str(tmp_path / "nothing")]) == 2


@pytest.mark.slow
def test_too_few_probe_tokens(minilm, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The uniform vector is orthogonal to almost everything.")
    (corpus / "b.txt").write_text("LayerNorm removes it anyway.")
    encode, separator = hf_encoder(minilm[1])
    available = sum(len(ids) + 1 for ids in encode([p.read_text() for p in sorted(corpus.iterdir())]))
    assert separator == minilm[1].sep_token_id
    result = _analyze("model=minilm", "probe=local", f"probe.path={corpus}", "probe.tokens=5000",
                      "probe.min_doc_tokens=0", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 2, result.stderr
    assert f"only {available} tokens but 5,000 were asked for" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # a failed start leaves no folder behind


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model=hub", "model.path=/no/such/model-dir"],
            "model not found: tried the local directory /no/such/model-dir",
        ),
        (["model=hub"], "model.path is required"),
        (
            ["model=checkpoint", "model.checkpoint=/no/such/last.ckpt"],
            "checkpoint not found: /no/such/last.ckpt",
        ),
    ],
)
def test_bad_model_exits_2(overrides: list[str], expected: str, tmp_path: Path) -> None:
    result = _analyze(*overrides, "probe=pydoc", f"output_root={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one line: the cause and the fix
    assert not list(tmp_path.iterdir())  # no output folder, not even an empty one


def test_failed_start_leaves_an_earlier_analysis_as_it_was(outputs: dict[str, Path]) -> None:
    out = outputs["ours"]
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "analyze.log").is_file()
    assert not list(out.glob("*.partial"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = _analyze("model=checkpoint", "model.checkpoint=/no/such/last.ckpt", "model.name=ours-rms",
                      "probe=pydoc", f"output_root={out.parent.parent}")
    assert result.returncode == 2 and "checkpoint not found" in result.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_sweep_runs_its_other_jobs_and_lists_the_refused_one(our_checkpoint: Path, tmp_path: Path) -> None:
    """analyze.py -m as train.py -m: a refused job no longer ends the sweep; it is listed at the end (exit
    2)."""
    result = entry_point_here(
        "analyze",
        [
            "-m",
            "progress=false",
            "model=checkpoint",
            "model.name=ours",
            f"model.checkpoint=/no/such/last.ckpt,{our_checkpoint}",
            "probe=pydoc",
            "probe.tokens=300",
            "probe.intervention=[]",
            f"output_root={tmp_path}",
        ],
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-2] == "1 job(s) of the sweep were refused (the others ran):", lines[-4:]
    assert lines[-1].startswith(
        f"  {tmp_path / 'analyze' / 'ours'}: checkpoint not found: /no/such/last.ckpt ("
    )
    assert (tmp_path / "analyze" / "ours" / "angles.jsonl").is_file()  # the job after the refused one ran


@pytest.mark.slow
def test_an_analysis_without_the_intervention_removes_the_earlier_ones_records_and_figures(
    our_checkpoint: Path, tmp_path: Path
) -> None:
    """Issue 34: the same command with probe.intervention=[] after one with the scopes kept the first run's
    intervention.jsonl and redrew its figures as if this run had measured them."""
    args = ("model=checkpoint", f"model.checkpoint={our_checkpoint}", "model.name=ours-rms", "probe=pydoc",
            "probe.tokens=300", f"output_root={tmp_path}")
    _ok(_analyze(*args))  # the default scopes
    out = tmp_path / "analyze" / "ours-rms"
    assert (out / "intervention.jsonl").is_file() and list((out / "figures").glob("intervention_*"))
    again = _analyze(*args, "probe.intervention=[]")
    _ok(again)
    assert not (out / "intervention.jsonl").exists() and not list((out / "figures").glob("intervention_*"))
    assert (
        "removed intervention.jsonl and its figures from an earlier analysis" in again.stdout + again.stderr
    )
    assert list((out / "figures").glob("layers_*"))  # this run's own figures


@pytest.mark.slow
def test_an_analysis_without_mean_sources_removes_the_earlier_ones_records_and_figure(
    our_checkpoint: Path, tmp_path: Path
) -> None:
    """As for the intervention: probe.mean_sources=false after an analysis with it leaves no
    mean_sources.jsonl or figure of the earlier one to read as this one's."""
    args = ("model=checkpoint", f"model.checkpoint={our_checkpoint}", "model.name=ours-rms", "probe=pydoc",
            "probe.tokens=300", "probe.intervention=[]", f"output_root={tmp_path}")
    _ok(_analyze(*args))  # mean sources on by default
    out = tmp_path / "analyze" / "ours-rms"
    rows = read_rows(out / "mean_sources.jsonl")
    assert {r["kind"] for r in rows} == {"dimensions", "position"}
    assert list((out / "figures").glob("mean_sources_*"))
    assert {r["count"] for r in rows if r["kind"] == "dimensions"} == {300}
    again = _analyze(*args, "probe.mean_sources=false")
    _ok(again)
    assert not (out / "mean_sources.jsonl").exists() and not list((out / "figures").glob("mean_sources_*"))
    said = again.stdout + again.stderr
    assert "removed mean_sources.jsonl and its figures from an earlier analysis" in said
    assert list((out / "figures").glob("layers_*"))
