"""Every option of every Hydra group composes and instantiates; no config file hides behind .gitignore."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from callbacks.checkpointing import CheckpointSchedule
from corpus.__main__ import main as corpus_main
from corpus.datamodule import TokenDataModule
from corpus.prepare import load_prepared
from corpus.sources import HubParquetSource, LocalFilesSource, PydocSource
from normgeo.config.checks import check_config
from normgeo.config.compose import ANALYZE_CONF_DIR, CONF_DIR, CONF_ROOT
from normgeo.config.schema import CheckpointSchema
from normgeo.runs.build import make_datamodule
from tests.conftest import ROOT

TRAIN_GROUPS = ("norm", "placement", "size", "data", "probe", "trainer", "logger", "experiment")
# Options that need a value from the command line before they resolve.
REQUIRED = {"data=local": ["data.source.path=corpus"], "probe=local": ["probe.path=corpus"]}


def compose_train(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=False)


def options(group: str) -> list[str]:
    """The presets of a train.py group: conf/train/<group>/, or conf/shared/<group>/ (probe)."""
    return sorted(
        p.stem for root in (Path(CONF_DIR), CONF_ROOT / "shared") for p in (root / group).glob("*.yaml")
    )


@pytest.mark.parametrize("group", TRAIN_GROUPS)
def test_every_option_of_every_train_group_composes_and_resolves(group: str) -> None:
    found = options(group)
    assert found, f"conf/{group}/ is empty"
    for option in found:
        override = f"{group}={option}"
        cfg = compose_train(override, *REQUIRED.get(override, []))
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        assert resolved["data"]["_target_"] == "corpus.datamodule.TokenDataModule", override


def test_every_checkpoint_and_data_default_is_written_once_in_the_schema() -> None:
    """The checkpoint and data keys' defaults live in the schema alone: train.yaml's checkpoint node names
    only the class, and CheckpointSchedule's and TokenDataModule's parameters have no defaults."""
    assert list(OmegaConf.load(Path(CONF_DIR) / "train.yaml").checkpoint) == ["_target_"]
    for built in (CheckpointSchedule, TokenDataModule):
        parameters = inspect.signature(built).parameters.values()
        assert [p.name for p in parameters if p.default is not inspect.Parameter.empty] == [], built
    keys = [f.name for f in dataclasses.fields(CheckpointSchema) if f.name != "_target_"]
    composed = compose_train().checkpoint  # the composed config still holds every key, at its default
    assert {key: composed[key] for key in keys} == {
        key: getattr(CheckpointSchema(_target_="x"), key) for key in keys}


def test_the_data_options_are_the_documented_ones() -> None:
    assert options("data") == ["local", "openwebtext", "pydoc"]


@pytest.mark.parametrize(
    ("option", "source_type", "auto_prepare"),
    [
        ("pydoc", PydocSource, True),
        ("local", LocalFilesSource, True),
        ("openwebtext", HubParquetSource, False),
    ],
)
def test_data_options_instantiate_the_datamodule(tmp_path: Path, option, source_type, auto_prepare) -> None:
    extra = ["data.source.path=../shared/corpora/webtext"] if option == "local" else []
    cfg = compose_train(f"data={option}", f"data_root={tmp_path}", "global_batch=16", "micro_batch=4", *extra)
    module = make_datamodule(check_config("train", cfg))
    assert isinstance(module, TokenDataModule) and isinstance(module.source, source_type)
    assert module.auto_prepare is auto_prepare
    assert module.directory.parent == tmp_path
    assert (module.global_batch, module.micro_batch, module.seq_len) == (16, 4, cfg.seq_len)
    assert module.prepare_command.startswith(f"python -m corpus data={option}")


def test_openwebtext_reads_the_hubs_parquet_files() -> None:
    source = instantiate(compose_train("data=openwebtext").data.source)
    assert source.candidates and all(
        c.startswith("hf://datasets/Skylion007/openwebtext") and c.endswith(".parquet")
        for c in source.candidates
    )


def test_each_local_corpus_gets_its_own_prepared_folder(tmp_path: Path) -> None:
    first = compose_train("data=local", "data.source.path=/corpora/a/web", f"data_root={tmp_path}").data
    second = compose_train("data=local", "data.source.path=/corpora/b/web", f"data_root={tmp_path}").data
    assert Path(first.directory).name.startswith("local-web-")
    assert first.directory != second.directory


def test_prepare_command_prepares_a_local_corpus(shared: Path, tmp_path: Path) -> None:
    corpus = shared / "corpora" / "webtext" / "openwebtext-10k.sujen07.val.dedup.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "corpus", "data=local", f"data.source.path={corpus}", f"data_root={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = tmp_path.glob("local-*")
    data = load_prepared(folder, verify="full")
    assert data.meta["source"] == f"local:{corpus}"
    assert f"train {data.num_tokens('train'):,} tokens" in done.stdout
    assert data.meta["splits"]["train"]["documents"] + data.meta["splits"]["val"]["documents"] == 426


def test_no_source_or_config_file_is_git_ignored() -> None:
    """A broad ignore rule (e.g. ``data/``) once hid conf/data/ from every clone."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = [
        str(p.relative_to(ROOT))
        for folder in (
            "conf",
            "models",
            "callbacks",
            "corpus",
            "normgeo",
            "hydra_plugins",
            "slurm",
            "bench",
            "tests",
        )
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and p.suffix in {".py", ".yaml", ".sbatch", ".md"} and "__pycache__" not in p.parts
    ]
    assert len(files) > 50
    ignored = subprocess.run(["git", "check-ignore", *files], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == [], f"ignored by .gitignore: {ignored.stdout.split()}"


def test_probe_wikipedia_is_article_text_and_wikitext_stays_an_option() -> None:
    with initialize_config_dir(config_dir=ANALYZE_CONF_DIR, version_base="1.3"):
        analyze = compose("analyze")
    for cfg in (compose_train("probe=wikipedia"), analyze):
        source = instantiate(cfg.probe.source)
        assert source.candidates == ["hf://datasets/wikimedia/wikipedia/20231101.en/*.parquet"]
        assert cfg.probe.sample and cfg.probe.min_doc_tokens == 64 and cfg.probe.null_directions == 64
    wikitext = compose_train("probe=wikitext")
    assert "Salesforce/wikitext" in instantiate(wikitext.probe.source).candidates[0]
    assert (wikitext.probe.sample, wikitext.probe.min_doc_tokens) == (False, 0)


def test_the_prepare_command_has_help_and_names_the_data_options(capsys, tmp_path: Path) -> None:
    """Issue 52, class 6: ``python -m corpus --help`` answers (before: Hydra's lexer exception), and an
    unknown ``data=`` option is the usage, then one line listing the options (last, where a user looks, as
    argparse puts it), exit 2, nothing prepared."""
    assert corpus_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m corpus" in out and "data=<option>: local, openwebtext, pydoc" in out
    assert corpus_main(["data=nosuch", f"data_root={tmp_path}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: data=nosuch: no such option of data; choose from local, openwebtext, pydoc"
    assert err[0].startswith("usage: python -m corpus") and not any(tmp_path.iterdir())

