"""``python -m normgeo.export`` and ``python -m normgeo.evaluate`` on real train.py runs; the verdict reads
eval.json."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import normgeo.export as export
from corpus.atomic import usual_file_mode
from corpus.next_sentence import CHOICES, TASK_NAME, build_examples, sentences
from corpus.sources import LocalFilesSource
from corpus.tokenize import tiktoken_encoding
from models.export.hf import load_hf
from models.export.tokenizer import gpt2_tokenizer
from models.gpt import GPT, GPTConfig
from models.pretrained import load_checkpoint
from normgeo.compare import main as compare_main
from normgeo.evaluate import main as evaluate_main
from normgeo.export import check_conversion
from normgeo.export import main as export_main
from normgeo.figures.sweep import load
from normgeo.runs.session import DIVERGED
from normgeo.verdict.declared import load_verdict_config
from normgeo.verdict.families import downstream_mismatches, paired_estimates
from normgeo.verdict.measures import run_measures
from normgeo.verdict.words import sentence, verdict_markdown
from tests.conftest import ROOT, entry_point_here, module_main, run_sweep
from tests.test_export_convert import FLOAT32_MAX_ABS, FLOAT64_RELATIVE
from tests.test_verdict import independent_interval, make_run

WIKIPEDIA = "corpora/wikipedia/enwiki-wikiextractor"
SETTINGS = ("max_steps=3", "checkpoint.steps=[2]", "checkpoint.last_every=0")


def hand_checkpoint(path: Path, norm: str, placement: str = "pre", step: int = 5) -> Path:
    """A checkpoint in the layout train.py saves (gpt_config, model.* state_dict, step, hyper-parameters)."""
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, norm=norm, placement=placement))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "gpt_config": gpt.config.to_dict(),
            "global_step": step,
            "hyper_parameters": {"global_batch": 4},
            "state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()},
        },
        path,
    )
    return path


# --- bad input, the tokenizer, the task, the verdict ---------------------------------------------------


def refused(capsys, tmp_path: Path, *args: str) -> str:
    """Run the export in-process on bad input: exit 2, one line, nothing written beside --out."""
    before = sorted(tmp_path.rglob("*"))
    assert export_main([*map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert sorted(tmp_path.rglob("*")) == before
    return err


def test_bad_input_is_refused_with_one_line_and_nothing_written(capsys, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    assert "has no checkpoints" in refused(capsys, tmp_path, empty_run, "--to", "hf", "--out", out)
    assert "does not exist" in refused(capsys, tmp_path, tmp_path / "nope", "--to", "hf", "--out", out)
    run = tmp_path / "dyt-post"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "dyt", "post")
    assert "saved steps: 5" in refused(capsys, tmp_path, run, "--step", "4", "--to", "hf", "--out", out)
    assert "pre-norm blocks only" in refused(capsys, tmp_path, run, "--to", "transformer-lens", "--out", out)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert "exists and is not empty" in refused(
        capsys, tmp_path, run, "--to", "hf", "--out", tmp_path / "taken"
    )
    # Into a run directory (where resume, status and the sweep readers look): refused, the fix beside it.
    (run / "run_config.yaml").write_text("seed: 0\n")
    for inside in (run / "exported", run / "checkpoints" / "hf"):
        message = refused(capsys, tmp_path, run, "--to", "hf", "--out", inside)
        assert f"is inside {run.resolve()}, which holds a training run (train.py)" in message
        assert message.endswith(f"--out={run.resolve().parent / 'dyt-post-hf'}")
    # A checkpoint of another run would get this run's model card: refused, naming its run.
    other = tmp_path / "other-run"
    foreign = hand_checkpoint(other / "checkpoints" / "step-0000003.ckpt", "rms")
    (other / "run_config.yaml").write_text("seed: 1\n")
    message = refused(capsys, tmp_path, run, "--checkpoint", foreign, "--to", "hf", "--out", out)
    assert message.endswith(
        f"belongs to the run {other.resolve()}, not {run}: give {other.resolve()} as the run directory"
    )


def test_a_diverged_run_exports_with_a_warning(capsys, tmp_path: Path) -> None:
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "rms")
    (run / "summary.json").write_text(json.dumps({DIVERGED: {"step": 7, "loss": float("nan"), "lr": 0.1}}))
    assert export_main([str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after transformers' "Writing model shards" bar)
    assert err == (
        f"warning: {run} diverged at step 7 (its summary.json): the export holds its checkpoint of "
        "step 5, saved before the divergence"
    )


def test_evaluate_checks_every_option_before_the_evaluation(capsys, tmp_path: Path) -> None:
    """Issue 34: options that used to fail after minutes of work (or in lm-eval's traceback) are one line,
    exit 2."""
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "rms")

    def evaluate_refuses(*args: str) -> str:
        assert evaluate_main([str(run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
        return err

    assert "no task name in it" in evaluate_refuses("--tasks", ",")
    assert "give at least 1 example per task" in evaluate_refuses("--limit", "0")
    assert "give at least 1 example per task" in evaluate_refuses("--limit", "-3")
    assert "--batch-size 0: give at least 1" in evaluate_refuses("--batch-size", "0")
    if not torch.cuda.is_available():
        assert "no CUDA GPU on this machine" in evaluate_refuses("--device", "cuda")
    # A truncated checkpoint: found when it is loaded, one line naming the run.
    checkpoint = run / "checkpoints" / "step-0000005.ckpt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    assert evaluate_refuses("--tasks", "lambada_openai").startswith(f"error: {run}: ")


@pytest.mark.parametrize(("norm", "placement", "reason"), [("dyt", "pre", "no tanh norm"),
                                                           ("rms_bias", "pre", "has no bias")])
def test_transformer_lens_refuses_an_arm_it_cannot_hold(
    capsys, tmp_path: Path, norm, placement, reason
) -> None:
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", norm, placement)
    assert reason in refused(capsys, tmp_path, run, "--to", "transformer-lens", "--out", tmp_path / "tl")


@pytest.mark.parametrize(
    ("norm", "placement", "to", "reason"),
    [
        ("layer", "post", "hf", "only Pre-LN arms convert"),
        ("dyt", "pre", "hf", "no mean subtraction to take out"),
        ("rms", "pre", "nnsight", "RMSNorm model already"),
        ("layer", "pre", "transformer-lens", "use it with --to hf"),
    ],
)
def test_convert_refuses_what_it_cannot_convert_with_one_line(
    capsys, tmp_path: Path, norm: str, placement: str, to: str, reason: str
) -> None:
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", norm, placement)
    err = refused(capsys, tmp_path, run, "--to", to, "--as", "rms", "--out", tmp_path / "converted")
    assert err.startswith("error: --as rms") and reason in err


@pytest.mark.slow  # builds the BPE merges / reads the whole corpus: seconds on a busy machine
def test_the_tokenizer_round_trips_the_probe_text(shared: Path) -> None:
    """The exported tokenizer gives tiktoken's ids on the probe text (Wikipedia articles) and decodes it
    back."""
    documents = LocalFilesSource(path=str(shared / WIKIPEDIA)).documents()
    text = "\n\n".join(next(documents) for _ in range(150))
    tokenizer = gpt2_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tiktoken_encoding("gpt2").encode_ordinary(text) and len(ids) > 5000
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tiktoken_encoding("gpt2").eot_token


@pytest.mark.slow  # builds the BPE merges / reads the whole corpus: seconds on a busy machine
def test_the_local_task_asks_for_the_sentence_that_follows(shared: Path) -> None:
    corpus = shared / WIKIPEDIA
    examples = build_examples(corpus, 20, seed=3)
    assert examples == build_examples(corpus, 20, seed=3)  # seeded
    paragraphs = [p for doc in LocalFilesSource(path=str(corpus)).documents() for p in doc.split("\n")]
    for example in examples:
        assert len(example["choices"]) == CHOICES == len(set(example["choices"]))
        answer = example["choices"][example["label"]]
        # The labelled choice is the sentence right after the context in some paragraph of the corpus.
        assert any(f"{example['context']} {answer}" in " ".join(sentences(p)) for p in paragraphs)
    assert len({e["label"] for e in examples}) > 1


def test_downstream_scores_reach_the_verdict_as_paired_contrasts(tmp_path: Path) -> None:
    accuracy = {"layer": [0.40, 0.42, 0.38], "rms": [0.30, 0.31, 0.33]}
    for norm, values in accuracy.items():
        for seed, acc in enumerate(values):
            run_dir = make_run(tmp_path, norm, seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
            (run_dir / "eval.json").write_text(json.dumps({"step": 10, "tasks": {TASK_NAME: {"acc": acc}}}))
    comparison = load(sorted(p for p in tmp_path.iterdir() if p.is_dir()))
    estimates, _ = paired_estimates(run_measures(comparison))
    est = {(e.arm, e.other, e.metric): e for e in estimates}[("layer", "rms", f"downstream/{TASK_NAME}/acc")]
    differences = [a - b for a, b in zip(accuracy["layer"], accuracy["rms"], strict=True)]
    assert est.values == pytest.approx(differences)
    assert (est.mean, est.low, est.high) == pytest.approx(independent_interval(differences), rel=1e-9)
    # Raw, the accuracy difference is significant; undeclared,
    # the row is described: its interval, no test words.
    assert est.test.p_diff < 0.05 and est.family == "described" and est.p_diff_holm is None
    assert sentence(est).endswith("described, not tested).") and "different" not in sentence(est)


def test_downstream_scores_measured_at_different_limits_are_not_paired(tmp_path: Path) -> None:
    """Issue 34: seed 1's RMSNorm run was evaluated on 8 examples, its LayerNorm partner on all: that seed is
    left out of the contrast, and verdict.md says which runs and how to make them comparable."""
    for norm in ("layer", "rms"):
        for seed in (0, 1, 2):
            run_dir = make_run(tmp_path, norm, seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
            limit = 8 if (norm, seed) == ("rms", 1) else None
            (run_dir / "eval.json").write_text(json.dumps(
                {"step": 10, "tasks": {TASK_NAME: {"acc": 0.3 + 0.01 * seed, "step": 10, "limit": limit}}}))
    measures = run_measures(load(sorted(p for p in tmp_path.iterdir() if p.is_dir())))
    estimates, unpaired = paired_estimates(measures)
    est = {(e.arm, e.other, e.metric): e for e in estimates}[("layer", "rms", f"downstream/{TASK_NAME}/acc")]
    assert est.seeds == (0, 2)
    lines = downstream_mismatches(measures)
    assert lines == [
        f"{TASK_NAME}, seed 1: layer-s1 was evaluated at step 10, limit none, rms-s1 at step 10, "
        "limit 8; not paired (evaluate both with the same --step and --limit)"
    ]
    assert f"- {lines[0]}" in verdict_markdown(estimates, measures, unpaired, not_paired=lines)


def test_a_declared_arm_no_run_has_is_named(tmp_path: Path) -> None:
    for norm in ("layer", "rms"):
        for seed in (0, 1):
            make_run(tmp_path, norm, seed, val_loss=5.0 + 0.01 * seed, tokens_per_s=1000.0, dev=1.0)
    measures = run_measures(load(sorted(p for p in tmp_path.iterdir() if p.is_dir())))
    config = load_verdict_config()
    config = dataclasses.replace(config, primary=dataclasses.replace(config.primary, arm="layer_nobias"))
    estimates, unpaired = paired_estimates(measures, config)
    page = verdict_markdown(estimates, measures, unpaired, config)
    primary = page.split("## The primary question")[1].split("##")[0]
    assert "None: no run of the declared arm(s) `layer_nobias` in these runs" in primary


# --- slow: real runs
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """LayerNorm and RMSNorm, seeds 0 and 1, 3 steps each (checkpoints at steps 2 and 3), one sweep."""
    root = tmp_path_factory.mktemp("export") / "outputs"
    result = run_sweep(root, *SETTINGS, "norm=layer,rms", "seed=0,1")
    assert result.returncode == 0, result.stderr[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_the_exported_directory_reproduces_the_checkpoint(trained: Path, tmp_path: Path, norm: str,
                                                         capfd) -> None:
    run = next(trained.glob(f"*-{norm}-s0"))
    out = tmp_path / "hf"
    result = module_main(capfd, "export", run, "--step", "2", "--to", "hf", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    gpt, step, _ = load_checkpoint(run / "checkpoints" / "step-0000002.ckpt")
    model = load_hf(out)
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - gpt(ids)).abs().max().item() <= 1e-5
    card = (out / "README.md").read_text()
    assert (
        f"| step | {step} |" in card
        and "| tokens seen | 1,024 |" in card
        and f"norm:\n  name: {norm}" in card
    )
    assert json.loads((out / "normgeo_export.json").read_text())["step"] == 2
    assert not list(tmp_path.glob(".*partial*"))
    # Every file with the user's usual mode (safetensors writes 0600 files by itself).
    assert {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()} == {
        path.name: usual_file_mode() for path in out.iterdir()}


@pytest.mark.slow
def test_a_trained_layer_run_converts_to_rms_with_the_same_logits(trained: Path, tmp_path: Path,
                                                                  capfd) -> None:
    """``--to hf --as rms`` on a trained LayerNorm run: AutoModelForCausalLM loads an RMSNorm model with the
    checkpoint's logits (float32 from the directory, float64 in memory), a mean-zero residual stream and an
    "add centering" intervention that changes nothing."""
    run = next(trained.glob("*-layer-s0"))
    out = tmp_path / "rms"
    result = module_main(capfd, "export", run, "--to", "hf", "--as", "rms", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converted to RMSNorm: logit parity" in result.stdout
    gpt, step, _ = load_checkpoint(run / "checkpoints" / "step-0000003.ckpt")
    model = load_hf(out)
    assert type(model).__name__ == "NormGeoForCausalLM" and model.config.norm == "rms"
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - gpt(ids)).abs().max().item() <= FLOAT32_MAX_ABS
    check = check_conversion(gpt, ids)
    assert (
        check.parity.float64_relative <= FLOAT64_RELATIVE and check.parity.float32_max_abs <= FLOAT32_MAX_ABS
    )
    assert check.ones_energy <= 1e-12 and abs(check.add_centering_delta_loss) <= 1e-12
    card = (out / "README.md").read_text()
    assert "## Converted from LayerNorm to RMSNorm" in card and f"| step | {step} |" in card
    # train.yaml: untied
    assert "**untied**" in card and "untied in training too" in card and "**bias**" in card
    info = json.loads((out / "normgeo_export.json").read_text())
    assert info["as"] == "rms" and info["conversion"]["parity"]["float32_max_abs"] <= FLOAT32_MAX_ABS
    assert "| energy along 1 at the norm inputs, float64 |" in card


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["layer", "rms"])  # GPT2LMHeadModel, and the saved model code
def test_the_angle_probe_through_the_export_gives_the_training_probe_numbers(trained: Path, tmp_path: Path,
                                                                              norm: str, capfd) -> None:
    """analyze.py on the exported Hugging Face directory (tokenized by the exported tokenizer) measures the
    angles the training probe recorded at that step, to 1e-4 degrees, at every site and reference."""
    run = next(trained.glob(f"*-{norm}-s0"))
    out = tmp_path / "hf"
    assert module_main(capfd, "export", run, "--to", "hf", "--out", out).returncode == 0
    config = run / "run_config.yaml"
    seq_len = next(
        int(line.split(":")[1]) for line in config.read_text().splitlines() if line.startswith("seq_len:")
    )
    tokens = next(
        int(line.split(":")[1])
        for line in config.read_text().splitlines()
        if line.strip().startswith("tokens:")
    )
    result = entry_point_here("analyze", [  # analyze.py's main in this process
        "model=hub",
        f"model.path={out}",
        "model.trust_remote_code=true",
        f"model.seq_len={seq_len}",
        "probe=pydoc",
        f"probe.tokens={tokens}",
        f"output_root={tmp_path / 'an'}",
        "progress=false",
    ])
    assert result.returncode == 0, result.stderr[-3000:]
    measured = [
        json.loads(line) for line in next((tmp_path / "an").rglob("angles.jsonl")).read_text().splitlines()
    ]
    training = [json.loads(line) for line in (run / "angles.jsonl").read_text().splitlines()]
    at_step = {(r["layer"], r["site"], r["ref"]): r["mean_deg"] for r in training if r["step"] == 3}
    through_export = {(r["layer"], r["site"], r["ref"]): r["mean_deg"] for r in measured}
    assert set(through_export) == set(at_step) and len(at_step) >= 30
    assert max(abs(through_export[k] - at_step[k]) for k in at_step) <= 1e-4


@pytest.mark.slow
def test_evaluate_runs_lm_evaluation_harness_offline_and_the_verdict_reads_it(trained: Path, shared: Path,
                                                                              tmp_path: Path, capfd) -> None:
    task_dir = tmp_path / "tasks"
    made = module_main(capfd, "evaluate", "--make-task", task_dir, "--corpus", shared / WIKIPEDIA,
                       "--examples", 40)
    assert made.returncode == 0, made.stderr[-3000:]
    runs = sorted(p for p in trained.iterdir() if (p / "checkpoints").is_dir())
    earlier = {"step": 2, "limit": 5, "tasks": {"an_earlier_task": {"acc": 0.5, "step": 2, "limit": 5}}}
    (runs[0] / "eval.json").write_text(json.dumps(earlier))  # an earlier evaluation's score: kept
    result = module_main(capfd, "evaluate", *runs, "--tasks", TASK_NAME, "--include-path", task_dir,
                         "--limit", 8)
    assert result.returncode == 0, result.stderr[-3000:]
    # The examples longer than the runs' 64-token context, counted here from the task's own file.
    encode = tiktoken_encoding().encode_ordinary
    examples = [json.loads(line) for line in (task_dir / "next_sentence.jsonl").read_text().splitlines()][:8]
    longer = sum(
        any(len(encode(f"{e['context']} {choice}")) > 64 for choice in e["choices"]) for e in examples
    )
    assert longer > 0  # Wikipedia paragraphs: most do not fit
    for run in runs:
        record = json.loads((run / "eval.json").read_text())
        scores = record["tasks"][TASK_NAME]
        assert record["step"] == 3 and scores["examples"] == 8 and 0 <= scores["acc"] <= 1
        assert (scores["step"], scores["limit"], scores["context"]) == (3, 8, 64)  # what it was measured at
        assert scores["truncated"] == longer
        assert (
            f"warning: {run}: {TASK_NAME}: {longer} of 8 examples are longer than the model's "
            "64-token context" in result.stderr
        )
    assert json.loads((runs[0] / "eval.json").read_text())["tasks"]["an_earlier_task"] == earlier["tasks"][
        "an_earlier_task"]
    compared = module_main(capfd, "compare", trained, "--out", tmp_path / "compare", "--formats", "png",
                           "--refs=ones")
    assert compared.returncode == 0, compared.stderr[-3000:]
    verdict = (tmp_path / "compare" / "verdict.csv").read_text()
    assert f"downstream/{TASK_NAME}/acc" in verdict
    # Unknown task: refused before anything is evaluated.
    refused = module_main(capfd, "evaluate", runs[0], "--tasks", "no_such_task", "--include-path", task_dir)
    assert refused.returncode == 2 and "unknown lm-eval task" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "norm", "placement"),
    [
        ("transformer-lens", "rms", "pre"),
        ("transformer-lens", "layer_nobias", "pre"),
        ("nnsight", "dyt", "post"),
        ("hf", "rms_bias", "post"),
    ],
)
def test_every_target_loads_back_with_the_checkpoint_logits(
    tmp_path: Path, target: str, norm: str, placement: str
) -> None:
    from models.export.lens import load_transformer_lens, to_nnsight

    checkpoint = hand_checkpoint(tmp_path / "run" / "checkpoints" / "step-0000005.ckpt", norm, placement)
    out = tmp_path / "out"
    assert export_main([str(tmp_path / "run"), "--to", target, "--out", str(out)]) == 0
    gpt, _, _ = load_checkpoint(checkpoint)
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = gpt(ids)
        if target == "transformer-lens":
            logits = load_transformer_lens(out)(ids)
        elif target == "nnsight":
            wrapped = to_nnsight(load_hf(out))
            with wrapped.trace(ids):
                logits = wrapped.output.logits.save()
        else:
            logits = load_hf(out)(ids).logits
    assert (logits - expected).abs().max().item() <= 1e-5
    assert "## How to load" in (out / "README.md").read_text()


def signal_when(args: list, ready, env: dict) -> subprocess.CompletedProcess:
    """Run ``python -m <args>``, send SIGTERM as soon as ``ready()`` holds (polled every millisecond)."""
    proc = subprocess.Popen([sys.executable, "-m", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 600
    while not ready():
        assert proc.poll() is None, f"{args[0]} ended before the signal:\n{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.slow
def test_sigterm_during_export_evaluate_or_compare_is_one_line_and_leaves_nothing(
        trained: Path, shared: Path, tmp_path: Path, capfd) -> None:
    """Issue 34: SIGTERM in the middle of each command ends it with exit 143 and one line, without a
    traceback; the export's .partial folder, the evaluation's temporary export and compare's staging folder
    are removed, and eval.json and --out are as they were."""
    run = next(trained.glob("*-layer-s0"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}

    def check(result: subprocess.CompletedProcess, doing: str) -> None:
        assert result.returncode == 143, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"SIGTERM {doing}: stopped")
        # (torch caches its own there)
        assert not list(scratch.glob("normgeo-*")) and not list(tmp_path.glob(".*"))

    out = tmp_path / "exported"
    check(signal_when(["normgeo.export", run, "--to", "hf", "--out", out],
                      lambda: any(p.name.startswith(".exported.partial") for p in tmp_path.iterdir()), env),
          "during the export")
    assert not out.exists()

    task_dir = tmp_path / "tasks"
    assert module_main(capfd, "evaluate", "--make-task", task_dir, "--corpus", shared / WIKIPEDIA,
                       "--examples", 40).returncode == 0
    before = (run / "eval.json").read_bytes() if (run / "eval.json").exists() else None
    check(
        signal_when(
            ["normgeo.evaluate", run, "--tasks", TASK_NAME, "--include-path", task_dir],
            lambda: any((p / "hf").is_dir() for p in scratch.iterdir()),
            env,
        ),
        "during the evaluation",
    )
    assert ((run / "eval.json").read_bytes() if (run / "eval.json").exists() else None) == before

    compare_out = tmp_path / "compare"
    check(signal_when(["normgeo.compare", trained, "--out", compare_out],
                      lambda: compare_out.is_dir() and any(compare_out.glob(".compare.*")), env),
          "during the comparison")
    assert not compare_out.exists()  # it created the folder: gone with the staging


def test_another_export_into_the_same_out_meanwhile_is_one_line(capsys, tmp_path: Path, monkeypatch) -> None:
    """Two exports started into one --out: the one that renames second finds it taken (here another export's
    files appear while this one writes), says so in one line, exit 2, and leaves the other's files alone."""
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "rms")
    out = tmp_path / "hf"
    save_hf = export.save_hf

    def save_while_another_export_finishes(gpt, partial, **kwargs):
        save_hf(gpt, partial, **kwargs)
        out.mkdir()
        (out / "config.json").write_text("{}")  # the other export's

    monkeypatch.setattr(export, "save_hf", save_while_another_export_finishes)
    assert export_main([str(run), "--to", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"error: --out {out} was written by another command while this export ran: nothing of this one "
        "was kept; choose a new directory"
    )
    assert [p.name for p in out.iterdir()] == ["config.json"] and not list(tmp_path.glob(".hf.partial*"))


def test_a_truncated_eval_json_is_named_by_compare(capsys, tmp_path: Path) -> None:
    for norm in ("layer", "rms"):
        for seed in (0, 1):
            make_run(tmp_path / "sweep", norm, seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    damaged = tmp_path / "sweep" / "rms-s1" / "eval.json"
    damaged.write_text('{"step": 10, "tasks": {"wiki_next_sentence": {"acc": 0.3')
    runs = sorted(str(p) for p in (tmp_path / "sweep").iterdir())
    assert compare_main([*runs, "--out", str(tmp_path / "compare"), "--formats", "png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {damaged}: damaged (") and err.endswith("move it away and evaluate again")
    assert "\n" not in err and not (tmp_path / "compare").exists()
