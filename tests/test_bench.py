"""The benchmark scripts run, list every norm arm, and compute their ratios against the right reference."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import math
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity

from models.gpt import GPT, GPTConfig
from models.norms import NORM_ARMS
from normgeo.measure.angles import AngleMeasurement
from normgeo.measure.energy import EnergyMeasurement
from normgeo.measure.geometry import gpu_code_path
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import run_probe
from normgeo.measure.probe import make_references, residual_norms
from tests.conftest import ROOT


def run_script(*args: str, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@functools.cache
def bench_module(name: str) -> types.ModuleType:
    """``bench/<name>.py`` imported by its path (bench/ is scripts, not a package), with bench/ on sys.path as
    ``python bench/<name>.py`` has it (a script imports its siblings: efficiency.py, norm_cost.py)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def refused_here(capsys, monkeypatch, name: str, *args: str) -> subprocess.CompletedProcess:
    """``python bench/<name>.py <args>`` through its main in this process, for an option it refuses before
    any work (a new interpreter would spend seconds importing torch and Lightning): exit code and output."""
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        bench_module(name).main()
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([name, *args], done.value.code, out, err)


def script_here(capsys, monkeypatch, name: str, *args: str) -> str:
    """``python bench/<name>.py <args>`` through its main in this process: its stdout. A new interpreter
    spent seconds importing torch and Lightning before these tiny runs' own seconds; norm_cost.py (it raises
    dynamo's recompile limit for the rest of its process) keeps a process of its own."""
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *args])
    capsys.readouterr()
    code = bench_module(name).main()
    out, err = capsys.readouterr()
    assert code in (None, 0), err[-3000:]
    return out


def markdown_rows(output: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown table rows whose first cell is ``first_cell``."""
    return [
        [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith("|") and line.strip("|").split("|")[0].strip() == first_cell
    ]


NORM_COST_TINY = [
    "--dims",
    "32,64",
    "--tokens",
    "256",
    "--repeats",
    "1",
    "--copy-mib",
    "2",
    "--target-ms",
    "1",
    "--markdown",
]


def check_norm_cost(output: str, impls: list[str]) -> None:
    """Every (width, implementation) lists every arm against that implementation's rms, and its ratios."""
    assert re.search(r"copy bandwidth .*median [0-9.]+ GB/s", output), output
    assert re.search(rf"implementations: {', '.join(impls)}; 1 interleaved repeats, median shown", output), (
        output
    )
    for dim in ("32", "64"):
        rows = markdown_rows(output, dim)
        table = [row for row in rows if len(row) == 10]
        assert [(row[1], row[2]) for row in table] == [
            (impl, kind) for impl in impls for kind in NORM_ARMS
        ], output
        for _, impl, kind, median_ms, to_rms, floor_ms, to_floor, kernel_ms, floor_share, repeats in table:
            assert float(median_ms) > 0 and float(floor_ms) > 0 and float(to_floor) > 0
            # The kernels' own time (aten ops' self time on the CPU: a loaded machine can
            # stretch one op's, so no bound against the wall time); the compiled forward's
            # C++ kernels are no profiler events on the CPU, so none is claimed.
            if impl == "stock":
                assert float(kernel_ms) > 0 and floor_share.endswith("%"), output
            else:
                assert kernel_ms == "nan" and floor_share == "-", output
            assert len(repeats.split(",")) == 1  # one value per repeat
            if kind == "rms":
                assert float(to_rms) == 1.0
            else:
                assert math.isfinite(float(to_rms)) and float(to_rms) > 0
        # The LayerNorm/RMSNorm ratios per implementation: one row each, the inverse of rms's share.
        pairs = {row[1]: row[2:] for row in rows if len(row) == 6}
        assert list(pairs) == impls, output
        for impl, (layer_to_rms, layer_range, nobias_to_rms, nobias_range) in pairs.items():
            by_kind = {row[2]: float(row[3]) for row in table if row[1] == impl}
            assert float(layer_to_rms) == pytest.approx(by_kind["layer"] / by_kind["rms"], rel=0.05, abs=2e-3)
            assert float(nobias_to_rms) == pytest.approx(
                by_kind["layer_nobias"] / by_kind["rms"], rel=0.05, abs=2e-3
            )
            # One repeat: its ratio is the medians' ratio, so the range is that one value.
            assert layer_range == f"{float(layer_to_rms):.3f}-{float(layer_to_rms):.3f}", output
            assert nobias_range == f"{float(nobias_to_rms):.3f}-{float(nobias_to_rms):.3f}", output
    # The ratio divides by the rms of the same width and implementation: the plain lines carry the medians.
    line = r"d=(\d+)\s+(\S+)\s+(\S+)\s+median\s+([0-9.]+) ms\s+to rms\s+([0-9.]+)"
    found = re.findall(line, output)
    assert len(found) == 2 * len(impls) * len(NORM_ARMS), output
    medians = {(int(d), impl, kind): float(ms) for d, impl, kind, ms, _ in found}
    for d, impl, kind, _, ratio in found:
        expected = medians[int(d), impl, kind] / medians[int(d), impl, "rms"]
        assert float(ratio) == pytest.approx(expected, rel=0.05, abs=2e-3)  # both printed rounded


def test_kernel_shares_count_the_norms_own_ops_forward_and_backward() -> None:
    """bench/norm_cost.py's kernel accounting on the CPU's profiler: a LayerNorm's
    forward and backward are norm time; the sum after it and a matmul beside it are not;
    a model without norms has none. Only the classification is asserted: the op times
    of one profiled call on a busy machine are noise."""
    profile = bench_module("norm_cost")
    x = torch.randn(256, 64, requires_grad=True)
    norm, linear = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

    def shares(fn) -> tuple[dict, dict[str, float]]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        result = profile.kernel_shares([e for e in prof.events() if not e.is_async], cuda=False)
        return result, {t["name"]: t["us"] for t in result["top"]}

    def norm_ops_us(times: dict[str, float]) -> float:
        return times["aten::native_layer_norm"] + times["aten::native_layer_norm_backward"]

    alone, times = shares(lambda: norm(x).sum().backward())
    # The norm's own ops are norm time; the sum is not, so the share stays below one.
    assert alone["norm_us"] >= norm_ops_us(times) > 0, alone
    assert alone["total_us"] - alone["norm_us"] >= times["aten::sum"] > 0, alone
    mixed, times = shares(lambda: linear(norm(x)).sum().backward())
    matmul_us = times["aten::addmm"] + times["aten::mm"]
    assert mixed["norm_us"] >= norm_ops_us(times) > 0, mixed
    assert mixed["total_us"] - mixed["norm_us"] >= matmul_us > 0, mixed
    assert mixed["norm_share"] == pytest.approx(mixed["norm_us"] / mixed["total_us"])
    without, times = shares(lambda: linear(x).sum().backward())
    assert without["norm_us"] == 0 and without["total_us"] >= times["aten::addmm"] > 0


def test_efficiency_times_the_arms_interleaved_and_writes_its_page(tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    """bench/efficiency.py on the CPU stand-in, eager: every arm at two sizes with its ratio to rms, its
    interval over the repeats, the norms' share of the kernel time; then the page from the saved results."""
    results = tmp_path / "eff.json"
    script_here(capsys, monkeypatch, "efficiency", "--standin", "--device", "cpu", "--sizes", "70m,1b",
                "--modes", "eager", "--repeats", "3", "--steps", "1", "--warmup", "1", "--json", str(results))
    report = json.loads(results.read_text())
    assert [(r["size"], r["mode"]) for r in report["results"]] == [("70m", "eager"), ("1b", "eager")]
    for result in report["results"]:
        assert list(result["arms"]) == ["layer", "rms", "layer_nobias"]
        assert all(
            len(arm["seconds"]) == 3 and arm["profile"]["norm_share"] > 0 for arm in result["arms"].values()
        )
        for name, ratio in result["ratios"].items():
            seconds = result["arms"][name]["seconds"]
            expected = [a / b for a, b in zip(seconds, result["arms"]["rms"]["seconds"], strict=True)]
            assert ratio["ratios"] == pytest.approx(expected)
            assert ratio["low"] <= ratio["ratio"] <= ratio["high"]
    page_file = tmp_path / "efficiency.md"
    # The page from saved results needs no device: its main in this process (seconds of imports saved).
    assert bench_module("efficiency").main(["--page", str(page_file), str(results)]) == 0
    page = page_file.read_text()
    assert "- 70m, eager: RMSNorm" in page and "- 1b, eager: RMSNorm" in page and "CPU stand-in" in page
    assert str(tmp_path) not in page and "--json" not in page
    # A newer run of 1b eager replaces the older one's rows; the older one is named below the runs.
    newer = {**report, "stamp": "2099-01-01 00:00 UTC",
             "results": [{**report["results"][1], "command": "python bench/efficiency.py --sizes 1b"}]}
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    newer_page = ["--page", str(page_file), str(results), str(tmp_path / "newer.json")]
    assert bench_module("efficiency").main(newer_page) == 0
    page = page_file.read_text()
    runs, replaced = page.split("## Runs")[1].split("Replaced by a newer run")
    assert "1b eager" in runs and "2099-01-01 00:00 UTC; `python bench/efficiency.py --sizes 1b`" in runs
    named = [line for line in replaced.splitlines() if line.startswith("- ")]
    assert len(named) == 1 and named[0].startswith(f"- 1b eager, {report['stamp']}:"), named
    assert page.count("- 1b, eager: RMSNorm") == 1


def test_norm_cost_lists_every_arm_per_width_with_rms_as_the_reference() -> None:
    check_norm_cost(
        run_script(str(ROOT / "bench" / "norm_cost.py"), *NORM_COST_TINY, "--impls", "stock"), ["stock"]
    )


@pytest.mark.slow
def test_norm_cost_times_every_arm_stock_and_compiled() -> None:
    """The default implementations on CPU: stock and compiled rows, each with its LayerNorm/RMSNorm ratio."""
    check_norm_cost(run_script(str(ROOT / "bench" / "norm_cost.py"), *NORM_COST_TINY), ["stock", "compiled"])


def test_norm_cost_refuses_an_unknown_implementation(capsys, monkeypatch) -> None:
    done = refused_here(capsys, monkeypatch, "norm_cost", "--impls", "stock,fast")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line, naming the option and the choices
    assert line.startswith(
        "bench/norm_cost.py: --impls fast: not available here; choose from stock, compiled"
    ), line


TINY = [
    "size=tiny",
    "size.n_embd=32",
    "seq_len=64",
    "global_batch=8",
    "micro_batch=4",
    "--steps",
    "2",
    "--skip",
    "1",
    "--repeats",
    "1",
    "--markdown",
]


@pytest.mark.slow
def test_train_throughput_reports_harness_plain_and_minimal(capsys, monkeypatch) -> None:
    output = script_here(capsys, monkeypatch, "train_throughput", *TINY)
    for name in ("harness", "plain", "minimal"):
        assert re.search(
            rf"^{name}\s+tokens/s: median\s+[0-9.]+\s+best\s+[0-9.]+\s+all [0-9.]+$", output, re.M
        ), output
    assert re.search(r"harness / plain: median / median [0-9.]+\s+best / best [0-9.]+", output), output
    assert re.search(r"plain / minimal: median / median [0-9.]+\s+best / best [0-9.]+", output), output
    assert float(markdown_rows(output, "plain")[0][4]) == 1.0


@pytest.mark.slow
def test_train_throughput_per_arm_rows_with_rms_as_the_reference(capsys, monkeypatch) -> None:
    output = script_here(capsys, monkeypatch, "train_throughput", *TINY, "--arms", "layer,rms")
    assert re.search(r"^layer\s+tokens/s: median", output, re.M) and re.search(
        r"^rms\s+tokens/s: median", output, re.M
    )
    assert "rms / rms: median / median 1.000   best / best 1.000" in output, output
    assert [row[0] for row in markdown_rows(output, "layer") + markdown_rows(output, "rms")] == [
        "layer",
        "rms",
    ]
    assert float(markdown_rows(output, "rms")[0][4]) == 1.0


def test_train_throughput_refuses_an_unknown_arm(capsys, monkeypatch) -> None:
    done = refused_here(capsys, monkeypatch, "train_throughput", "--arms", "nope")
    assert done.returncode == 2 and "unknown arm(s) nope" in done.stderr


@pytest.mark.slow
def test_probe_cost_reports_the_default_probe_and_the_resumed_scopes(capsys, monkeypatch) -> None:
    """bench/probe_cost.py on the tiny model: every variant timed, the default probe's ratio and the scopes'
    cost resumed and re-run printed (the peak memory is measured in a child process of its own)."""
    out = script_here(capsys, monkeypatch, "probe_cost", "--size", "tiny", "--tokens", "1024",
                      "--budget-tokens", "256", "--repeats", "1", "--memory-tokens", "512")
    for variant in (
        "plain forward",
        "angle probe K=0",
        "angle probe K=64 +energy",
        "default probe (+intervention on the first 1024)",
        "resumed mid-stack",
        "re-run from the embeddings",
    ):
        assert variant in out, variant
    assert re.search(r"DEFAULT PROBE / PLAIN FORWARD at 1024 probe tokens: \d+\.\d{3}", out)
    costs = re.findall(
        r"intervention all,layers (resumed mid-stack|re-run from the embeddings): the (\d+) scope\(s\) "
        r"cost (-?[\d.]+) plain forwards",
        out,
    )
    assert [(how, scopes) for how, scopes, _ in costs] == [
        ("resumed mid-stack", "4"),
        ("re-run from the embeddings", "4"),
    ]
    assert "default probe (+intervention on the first 1024) +layers" in out
    assert "peak RSS of the default probe with probe.tokens=    512" in out


@pytest.mark.slow  # imports transformers and builds two 13M-parameter models: seconds
def test_norm_cost_convert_times_the_layernorm_model_against_its_rms_conversion() -> None:
    output = run_script(
        str(ROOT / "bench" / "norm_cost.py"),
        "--convert",
        "tiny",
        "--seq",
        "32",
        "--repeats",
        "2",
        "--impls",
        "stock",
    )
    (row,) = markdown_rows(output, "stock")
    original, converted = (float(cell.removesuffix(" ms")) for cell in row[1:3])
    assert original > 0 and converted > 0
    # the ratio of the medians
    assert float(row[3]) == pytest.approx(converted / original, rel=0.01, abs=0.002)
    low, high = (float(value) for value in row[4].split("-"))
    assert 0 < low <= high


def test_the_probe_waits_on_the_device_no_more_with_more_norms() -> None:
    """The probe's batches (angles with the null directions, the energy) read no tensor's value back per norm:
    the host-sync ops bench/probe_cost.py counts on the CPU's profiler (on a GPU each waits for every queued
    kernel) are as many with 2 blocks as with 1, and few, while the aten ops grow with the norms."""
    spec = importlib.util.spec_from_file_location("probe_cost", ROOT / "bench" / "probe_cost.py")
    probe_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_cost)

    def counts(layers: int) -> dict[str, int]:
        config = GPTConfig(n_layer=layers, n_head=2, n_embd=32, block_size=16, norm="layer")
        model = GPT(config, seed=0).eval()
        norms = residual_norms(find_norm_sites(model))
        tokens = torch.randint(0, 50257, (4, 16), generator=torch.Generator().manual_seed(0))
        measurements = [
            AngleMeasurement(norms, make_references(32), num_sequences=4), EnergyMeasurement(norms)
        ]
        with gpu_code_path(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            run_probe(model, [tokens], measurements, norms=norms, batch_size=2)
        return probe_cost.op_counts(prof.events())

    one, two = counts(1), counts(2)
    assert one["syncs"] == two["syncs"] <= 3, (one, two)
    assert two["aten_outermost"] > one["aten_outermost"] > 0


@pytest.mark.slow  # compiles two norms: seconds
def test_gpu_profile_writes_where_the_time_goes(tmp_path, capsys, monkeypatch) -> None:
    """bench/gpu_profile.py on the CPU: a section per profiled call with its wall time and top operators; the
    probe's section counts the host reads of tensor values (``aten::item``) that would each wait on a GPU."""
    page = tmp_path / "profile.md"
    output = script_here(
        capsys,
        monkeypatch,
        "gpu_profile",
        "--device",
        "cpu",
        "--size",
        "tiny",
        "--tokens",
        "512",
        "--batch-size",
        "4",
        "--dim",
        "64",
        "--norm-tokens",
        "256",
        "--rows",
        "3",
        "--out",
        str(page),
    )
    text = page.read_text()
    assert text in output and text.startswith(
        "# Where the GPU time goes\n\nGenerated by `python bench/gpu_profile.py "
    )
    # outside the tables' code blocks (an operator may be named "## Call ...")
    prose = "".join(text.split("```")[::2])
    sections = re.findall(r"^## (.+)$", prose, flags=re.M)
    assert sections == ["plain forward, tiny, 512 tokens", "angle probe K=0, tiny, 512 tokens"] + [
        f"{impl} {kind} forward + backward, 256 × 64"
        for impl in ("stock", "compiled")
        for kind in ("layer", "rms")
    ]
    assert len(re.findall(r"^- wall [0-9.]+ ms \(profiled\)", text, flags=re.M)) == len(sections)
    probe = text.split("## angle probe")[1].split("## stock")[0]
    assert re.search(r"aten::item ×\d+", probe) and "By self CPU time:" in probe
    # The records read the statistics back; the batches themselves nothing.
    assert re.search(r"in the probe's batches .*; host-sync aten ops: 0\n", probe)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_probe_cost_times_the_mean_sources_interleaved(capsys, monkeypatch) -> None:
    """bench/probe_cost.py --mean-sources-cost: the default probe with and without mean_sources.jsonl, and
    their ratio (issue 53's cost target)."""
    out = script_here(capsys, monkeypatch, "probe_cost", "--size", "tiny", "--tokens", "512", "--repeats",
                      "2", "--mean-sources-cost")
    timed = re.findall(r"^  (.+?) +best +[\d.]+ s +median +[\d.]+ s +all (.+)$", out, flags=re.MULTILINE)
    default = "default probe (+intervention on the first 512)"
    assert [name for name, _ in timed] == ["plain forward", f"{default} without mean sources", default]
    assert all(len(values.split(", ")) == 2 for _, values in timed)
    assert re.search(r"MEAN SOURCES COST \(default probe with / without, best\): \d+\.\d{3}", out), out


# The GPT size interleaves two repeats; the preset, whose repeats run the same loop, one (its 6 variants of
# SmolLM2-135M over 512 tokens took 29 s a repeat in the full suite).
@pytest.mark.slow  # five variants of the tiny model, then SmolLM2-135M loaded (~14 s) and probed
@pytest.mark.parametrize(("subject", "repeats"), [(("--size", "tiny"), 2), (("--model", "smollm2-135m"), 1)],
                         ids=["gpt", "preset"])
def test_probe_cost_table_gives_issue_73s_variants(capsys, monkeypatch, subject: tuple[str, str],
                                                   repeats: int) -> None:
    """bench/probe_cost.py --table, for a GPT size and an analyze.py preset: every variant of issue 73 as a
    markdown row, its median and its ratio to the plain forward (the ratio of the medians), with the load."""
    out = script_here(capsys, monkeypatch, "probe_cost", *subject, "--table", "--tokens", "512",
                      "--batch-size", "2", "--repeats", str(repeats))
    assert re.search(rf"512 probe tokens, batches of 2 x \d+, {repeats} interleaved repeat\(s\), "
                     r"load average before [\d.]+, after [\d.]+", out), out
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and not line.startswith(("| variant", "| ---"))]
    rows = {row[0]: row[1:] for row in cells}
    assert list(rows) == ["plain forward", *(name for name, _ in bench_module("probe_cost").TABLE)]
    plain = float(rows["plain forward"][0].removesuffix(" s"))
    for name, (median, ratio, values) in rows.items():
        seconds = [float(v) for v in values.split(", ")]
        median_s = float(median.removesuffix(" s"))
        assert len(seconds) == repeats, name
        assert median_s == pytest.approx(statistics.median(seconds), abs=0.01), name
        # The seconds are printed to 0.01 s, the ratio of the unrounded medians to 0.01.
        low, high = (median_s - 0.005) / (plain + 0.005), (median_s + 0.005) / max(plain - 0.005, 1e-9)
        assert low - 0.005 <= float(ratio) <= high + 0.005, name


def test_probe_cost_analyze_times_analyze_pys_default_probe(capsys, monkeypatch) -> None:
    """bench/probe_cost.py --analyze: the plain forward and analyze.py's default probe (the intervention on
    its budget only), one row each."""
    out = script_here(capsys, monkeypatch, "probe_cost", "--size", "tiny", "--analyze", "--tokens", "512",
                      "--batch-size", "2", "--repeats", "1")
    rows = [line.strip("|").split("|")[0].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith(("| variant", "| ---"))]
    assert rows == ["plain forward", *(name for name, _ in bench_module("probe_cost").ANALYZE)], out
    assert "intervention on the first 8,192 tokens" in rows[1]


def test_probe_cost_refuses_cuda_without_a_gpu(capsys, monkeypatch) -> None:
    done = refused_here(capsys, monkeypatch, "probe_cost", "--device", "cuda")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert (
        line.startswith("bench/probe_cost.py: --device=cuda: no CUDA GPU on this machine")
        and "--device cpu" in line
    )


@pytest.fixture(scope="module")
def harness_overhead() -> str:
    """bench/harness_overhead.py at its smallest: 6 profiled steps logging every 3, one alternated repeat,
    through its main in this process (its torch thread count put back after)."""
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = bench_module("harness_overhead").main(
                ["--sync-steps", "6", "--log-every", "3", "--steps", "2", "--warmup", "1", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return out.getvalue()


@pytest.mark.slow  # trains three times: seconds
def test_harness_overhead_prints_syncs_and_host_times_against_the_bare_step(harness_overhead: str) -> None:
    logging, other = (re.search(rf"^  {name}: (.*)$", harness_overhead, re.M).group(1)
                      for name in ("logging steps", "other steps"))
    assert [int(s) for s in re.findall(r"step (\d+):", logging)] == [1, 3, 6]  # reports: first, every 3, last
    assert [int(s) for s in re.findall(r"step (\d+):", other)] == [2, 4, 5]
    for name in ("harness", "bare"):
        for clock in ("wall", "cpu"):
            median, values = re.search(rf"^  {name}\s+{clock}\s+median\s+([0-9.]+)  all ([0-9.]+)$",
                                       harness_overhead, re.M).groups()
            assert float(median) == float(values) > 0
    ratios = re.search(r"^HARNESS / BARE \(medians\): wall ([0-9.]+) \(([-+][0-9.]+) ms a step\), "
                       r"cpu ([0-9.]+) \(([-+][0-9.]+) ms a step\);", harness_overhead, re.M).groups()
    assert float(ratios[0]) > 0 and float(ratios[2]) > 0


@pytest.mark.slow  # trains: seconds
def test_a_training_run_waits_for_the_device_at_its_logging_steps_only(harness_overhead: str) -> None:
    """Over a real train() run the host-sync ops bench/probe_cost.py counts (each a wait for every queued
    kernel on a GPU) come at the steps that log (the loss and rates read back, the final checkpoint's
    finiteness check), none at the others: the host can queue the next steps' kernels ahead of the GPU."""
    logging = re.search(r"^  logging steps: (.*)$", harness_overhead, re.M).group(1)
    assert sum(int(n) for n in re.findall(r"step \d+: (\d+)", logging)) > 0  # the counter sees the reads
    outside = re.search(r"^SYNCS OUTSIDE LOGGING STEPS: (\d+) in (\d+) steps", harness_overhead, re.M)
    assert outside.groups() == ("0", "3"), harness_overhead
