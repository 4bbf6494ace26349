"""normgeo from Python (normgeo/api.py, normgeo/readers/frames.py): ``normgeo.measure`` gives analyze.py's
records on analyze.py's tokens, its options are the probe schema's fields refused as the command line
refuses them, ``save`` writes what analyze.py writes, a TransformerLens model with processing off gives the
angles of the same Hugging Face model, and ``load_run``/``load_sweep`` read every file, naming a damaged one
and going on."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import normgeo
from corpus.sources import LocalFilesSource, PydocSource
from models.export.hf import to_hf
from models.export.lens import to_transformer_lens
from models.gpt import GPT, GPTConfig
from models.pretrained import hf_encoder
from normgeo.api import MODEL_KEYS, SOURCE_KEYS, measure_options, option_names
from normgeo.config.schema import AnalyzeModelSchema, ConfigError
from normgeo.measure.pipeline import AnalysisError, probe_ids
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.records import read_rows
from normgeo.measure.run_records import RECORD_FILES
from normgeo.paths import FolderError
from tests.conftest import ROOT, entry_point_here, module_main, save_our_checkpoint

CHECKPOINT_TOKENS = 300  # pydoc's text: a few windows of the checkpoint's 64 positions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_our_checkpoint(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """analyze.py on the checkpoint with probe=pydoc, in this process: its output folder."""
    root = tmp_path_factory.mktemp("outputs")
    done = entry_point_here("analyze", [
        "progress=false", "model=checkpoint", f"model.checkpoint={checkpoint}", "model.name=ours",
        "probe=pydoc", f"probe.tokens={CHECKPOINT_TOKENS}", "probe.intervention=[all,layers]",
        "probe.bootstrap.replicates=200", f"output_root={root}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "analyze" / "ours"


def as_json(rows: list[dict]) -> list[dict]:
    """Rows as a records file holds them (JSON numbers)."""
    return [json.loads(json.dumps(row)) for row in rows]


def test_every_option_is_a_schema_field_with_its_default() -> None:
    probe_fields = {f.name for f in dataclasses.fields(ProbeConfig)}
    model_fields = {f.name for f in dataclasses.fields(AnalyzeModelSchema)}
    assert set(option_names()) == (probe_fields - set(SOURCE_KEYS)) | set(MODEL_KEYS)
    assert set(MODEL_KEYS) <= model_fields
    # No option given: the schema's defaults, as analyze.py's validated probe node has them.
    probe, spec = measure_options({})
    assert dataclasses.replace(probe, source=None, tokens=500) == ProbeConfig(source=None, tokens=500)
    assert (spec.seq_len, spec.batch_size, spec.name) == (1024, 8, None)
    probe, spec = measure_options({"seed": 7, "bootstrap": {"block": 2}, "intervention": [], "batch_size": 3})
    assert (probe.seed, probe.bootstrap.block, probe.intervention, spec.batch_size) == (7, 2, [], 3)


@pytest.mark.parametrize(("options", "refusal"), [
    ({"null_directions": -1}, "null_directions=-1: expected int >= 0"),
    ({"bootstrap": {"replicates": 0}}, "bootstrap.replicates=0: expected int >= 1"),
    ({"seed": 2**33}, "seed=8589934592: expected int >= 0, <= 4294967295"),
    ({"nul_directions": 3}, "nul_directions: no such key (did you mean null_directions?"),
    ({"seq_len": 0}, "seq_len=0: expected int >= 1"),
    ({"intervention": ["everything"]}, "probe.intervention=['everything']: expected a list of distinct"),
    ({"path": "corpus/"}, "path: not an option of normgeo.measure"),
])
def test_a_bad_option_is_refused_in_one_line_naming_it(options: dict, refusal: str) -> None:
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, norm="rms"), seed=0)
    with pytest.raises(ConfigError) as err:
        normgeo.measure(gpt, np.arange(64), **options)
    assert str(err.value).startswith(refusal) and "\n" not in str(err.value)


def preset_options(preset: str, **options) -> dict:
    """The options of a conf/shared/probe preset (its source aside) as analyze.py composes them: analyze.yaml
    caps the documents at 1,024 tokens."""
    composed = OmegaConf.merge(*(OmegaConf.load(ROOT / "conf" / "shared" / "probe" / f"{name}.yaml")
                                 for name in ("pydoc", preset)))
    values = {key: value for key, value in OmegaConf.to_container(composed).items()
              if key not in ("defaults", *SOURCE_KEYS)}
    return {**values, "max_doc_tokens": 1024, **options}


def test_measure_on_analyze_tokens_gives_analyze_records_and_save_writes_its_files(
        analysis: Path, checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """normgeo.measure on analyze.py's tokens of the same checkpoint, with analyze.py's options: every
    records file equal; ``save`` writes the same files (Hydra's aside), which the tools' readers read."""
    loaded = normgeo.load_checkpoint(checkpoint)
    options = preset_options("pydoc", tokens=CHECKPOINT_TOKENS, intervention=["all", "layers"],
                             bootstrap={"replicates": 200, "block": 1})
    ids = probe_ids(PydocSource(), loaded.encode_batch, loaded.separator, measure_options(options)[0])
    records = normgeo.measure(loaded, ids, name="ours", **options)
    assert set(records.files) == {path.name for path in analysis.glob("*.jsonl")}
    for name, rows in records.files.items():
        assert as_json(rows) == read_rows(analysis / name), name
    assert records.angles[["step", "tokens_seen"]].drop_duplicates().values.tolist() == [[7, 7 * 4 * 64]]
    assert list(records.null.columns) == list(read_rows(analysis / "null.jsonl")[0])
    assert not records.mean_sources.empty and len(records.intervention) == 4  # all, layer 0, 1, final
    records.save(tmp_path / "saved")
    written = sorted(str(p.relative_to(tmp_path / "saved")) for p in (tmp_path / "saved").rglob("*"))
    expected = sorted(str(p.relative_to(analysis)) for p in analysis.rglob("*")
                      if not str(p.relative_to(analysis)).startswith((".hydra", "analyze.log")))
    assert written == expected
    info = json.loads((tmp_path / "saved" / "run_info.json").read_text())
    assert set(info) == set(json.loads((analysis / "run_info.json").read_text())) - {"load_s", "tokenize_s"}
    # The cross-model summary reads the saved folder as an analysis of analyze.py's.
    done = module_main(capfd, "analysis", "summary", tmp_path / "saved")
    assert done.returncode == 0 and "ours" in done.stdout, done.stderr[-2000:]
    # Like analyze.py's out_dir: never into a run's folder (nor another command's).
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / "run_config.yaml").write_text("max_steps: 4\n")
    with pytest.raises(FolderError, match="nothing of this command goes there"):
        records.save(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "run_config.yaml"]
    figure = records.plot()
    assert len(figure.axes) == 3 and "ours" in figure._suptitle.get_text()


def test_texts_are_tokenized_as_analyze_tokenizes_its_documents(checkpoint: Path) -> None:
    """Texts: the seeded order, min_doc_tokens, each document closed by the separator; ``tokens`` defaults
    to all of them; too few is refused saying what to change."""
    loaded = normgeo.load_checkpoint(checkpoint)
    texts = [f"Document {i} says that the uniform vector is {'very ' * i}far from the tokens."
             for i in range(40)]
    options = {"mean_sources": False, "intervention": [], "null_directions": 0, "min_doc_tokens": 12}
    records = normgeo.measure(loaded, texts, **options)
    kept = [t for t in texts if len(loaded.encode_batch([t])[0]) >= 12]
    total = sum(len(ids) + 1 for ids in loaded.encode_batch(kept))
    assert records.info["tokens"] == total and records.angles["count"].unique().tolist() == [total]
    with pytest.raises(AnalysisError, match="lower tokens or give more text"):
        normgeo.measure(loaded, texts, tokens=10 * total, **options)


def test_a_transformer_lens_model_without_processing_gives_the_hugging_face_angles() -> None:
    """The same weights as a Hugging Face GPT-2 and as a HookedTransformer with processing off: the angles
    agree within 1e-4 degrees, and the centering intervention (through TransformerLens' own gains and
    biases) too; one loaded with TransformerLens' processing is refused."""
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, norm="layer"), seed=1).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in gpt.parameters():  # gains and biases off their init, so that dropping one shows
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
        gpt.wte.weight.add_(0.05)  # a component along 1 in every embedding, as training leaves
    ids = torch.randint(0, 50257, (4, 64), generator=torch.Generator().manual_seed(7))
    options = {"intervention": ["all", "layers"], "mean_sources": False, "bootstrap": {"replicates": 20}}
    hf, lens = to_hf(gpt), to_transformer_lens(gpt)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    measured = {name: normgeo.measure(model, ids, **options) for name, model in (("hf", hf), ("lens", lens))}
    angles = {name: records.angles.set_index(["layer", "site", "ref"]) for name, records in measured.items()}
    assert len(angles["hf"]) == 5 * 3 * 3 and angles["hf"].index.equals(angles["lens"].index)
    assert (angles["hf"]["mean_deg"] - angles["lens"]["mean_deg"]).abs().max() < 1e-4
    assert angles["hf"].loc[(0, "ln1.in", "ones"), "mean_deg"] < 85  # far from orthogonal to 1
    changes = {name: records.intervention.set_index("scope_name") for name, records in measured.items()}
    assert changes["hf"].index.tolist() == ["all", "layer 0", "layer 1", "layer final"]
    assert (changes["hf"]["delta_loss"] - changes["lens"]["delta_loss"]).abs().max() < 1e-5
    with pytest.raises(AnalysisError, match="from_pretrained_no_processing"):
        normgeo.measure(to_transformer_lens(gpt, process=True), ids, **options)


@pytest.mark.slow  # SmolLM2 (shared, ~25 s to load) and analyze.py loading it again
def test_measure_on_smollm2_gives_analyze_records(smollm2_model_and_tokenizer, shared: Path,
                                                   tmp_path: Path) -> None:
    model, tokenizer = smollm2_model_and_tokenizer
    wiki = shared / "corpora" / "wikipedia"
    done = entry_point_here("analyze", [
        "progress=false", "model=smollm2-135m", "probe=local", f"probe.path={wiki}", "probe.tokens=160",
        "model.seq_len=64", "probe.intervention=[]", "probe.bootstrap.replicates=100",
        f"output_root={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "analyze" / "smollm2-135m-instruct-q4_1"
    options = preset_options("local", tokens=160, intervention=[], bootstrap={"replicates": 100, "block": 1})
    encode, separator = hf_encoder(tokenizer)
    ids = probe_ids(LocalFilesSource(str(wiki)), encode, separator, measure_options(options)[0])
    records = normgeo.measure(model, ids, tokenizer=tokenizer, name="smollm2-135m-instruct-q4_1", seq_len=64,
                              **options)
    assert set(records.files) == {path.name for path in out.glob("*.jsonl")}
    for name, rows in records.files.items():
        assert as_json(rows) == read_rows(out / name), name
    assert records.angles["layer"].nunique() == 31  # 30 blocks and the final norm


def test_load_run_reads_every_file(analysis: Path) -> None:
    run = normgeo.load_run(analysis)
    assert run.damaged == []
    for name in RECORD_FILES:
        assert run.files[name] == read_rows(analysis / name), name
    assert not run.angles.empty and not run.null.empty and not run.energy.empty
    assert not run.mean_sources.empty and not run.intervention.empty
    positions = read_rows(analysis / "intervention_positions.jsonl")
    assert len(run.frame("intervention_positions")) == len(positions) > 0
    assert run.config["model"]["name"] == "ours" and run.metrics.empty and run.summary == {}


@pytest.mark.parametrize(("damage", "named"), [
    ({"angles.jsonl": b""}, "angles.jsonl:1: damaged record (no record in the file)"),
    ({"null.jsonl": bytes(range(256)) * 4}, "null.jsonl:1: damaged record"),
    ({"energy.jsonl": b'{"model": "ours", "norm": "rms", "step": 7}\n{"model": '}, "energy.jsonl:2"),
    ({"csv/version_0/metrics.csv": b"step,train_loss\n1,2.5\n2,oops\n"}, "metrics.csv:3"),
    ({".hydra/config.yaml": b""}, "config.yaml:1: damaged record (empty"),
])
def test_load_run_names_a_damaged_file_and_reads_the_others(analysis: Path, tmp_path: Path, damage: dict,
                                                            named: str) -> None:
    (tmp_path / "copy").mkdir()
    folder = tmp_path / "copy" / "ours"
    shutil.copytree(analysis, folder)
    for name, content in damage.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    with pytest.warns(UserWarning, match="left out") as warned:
        run = normgeo.load_run(folder)
    assert len(run.damaged) == 1 and named in str(run.damaged[0]) and named in str(warned[0].message)
    damaged = Path(run.damaged[0].path).relative_to(folder)
    for name in RECORD_FILES:
        if Path(name) != damaged:
            assert run.files[name] == read_rows(analysis / name), name
    shutil.copytree(analysis, tmp_path / "whole")  # a sweep of the damaged copy and a whole one
    with pytest.warns(UserWarning, match="left out"):
        sweep = normgeo.load_sweep(tmp_path)
    assert sorted(sweep.by_run) == ["copy/ours", "whole"] and len(sweep.damaged) == 1
    whole = sweep.angles[sweep.angles["run"] == "whole"].drop(columns="run")
    assert whole.to_dict("records") == read_rows(analysis / "angles.jsonl")
    assert sweep.runs["run"].tolist() == ["copy/ours", "whole"]


def test_load_sweep_without_runs_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run folder"):
        normgeo.load_sweep(tmp_path)
