"""The probe's records equal those of the code before issue 73's batching (tests/data/probe_records_*.json),
every file and every field, within float32 rounding: the tiny GPT (random weights, the intervention's
per-block breakdown on part of the tokens) and SmolLM2-135M (real weights, the default probe on every token).

    python tests/test_probe_records.py    # rewrites the fixtures from the code as it is (only on purpose)
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from models.pretrained import load_model
from normgeo.config.checks import check_config
from normgeo.config.compose import ANALYZE_CONF_DIR, CONF_DIR
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import measure_records, tiktoken_separator
from normgeo.measure.probe import make_references, residual_norms
from normgeo.measure.probe_config import BootstrapConfig, ProbeConfig
from normgeo.runs.build import make_module

DATA = Path(__file__).parent / "data"
# Float32 rounding of sums over a few thousand values, and of the 10 significant digits the records keep.
RELATIVE, ABSOLUTE = 1e-5, 1e-6
# A loss change is the difference of two float32 losses of a few nats, each summed in its own thread order:
# its rounding is absolute, a few 1e-6 whatever the change.
LOSS_ABSOLUTE = 2e-5


def probe_tokens(count: int, separator: int, vocab: int, every: int = 97) -> torch.Tensor:
    """Seeded token ids with a separator every ``every`` tokens: documents, so mean sources has starts."""
    ids = torch.randint(0, vocab - 1, (count,), generator=torch.Generator().manual_seed(0))
    ids[every - 1::every] = separator
    return ids


def tiny_records() -> dict[str, list[dict]]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = check_config("train", compose("train", overrides=["size=tiny"]))
    model = make_module(cfg, seed=0).model.eval()
    separator = tiktoken_separator()
    ids = probe_tokens(3 * 256 + 100, separator, model.config.vocab_size)
    probe = ProbeConfig(tokens=len(ids), bootstrap=BootstrapConfig(replicates=50),
                        intervention=["all", "layers"], intervention_tokens=512)
    references = make_references(model.config.n_embd, probe.seed)
    return measure_records(model, ids, model.config.block_size, references, probe, batch_size=2,
                           model_name="tiny", step=3, tokens_per_step=1024, separator=separator).files


def smollm2_records() -> dict[str, list[dict]]:
    with initialize_config_dir(config_dir=ANALYZE_CONF_DIR, version_base="1.3"):
        cfg = compose("analyze", overrides=["model=smollm2-135m"])
    loaded = load_model(cfg.model, lm_head=True)
    norms = find_norm_sites(loaded.model)
    dim = residual_norms(norms)[0].dim
    ids = probe_tokens(2 * 128 + 60, loaded.separator, loaded.model.config.vocab_size)
    probe = ProbeConfig(tokens=len(ids), bootstrap=BootstrapConfig(replicates=50), intervention_tokens=None)
    return measure_records(loaded.model, ids, 128, make_references(dim, probe.seed), probe, batch_size=2,
                           model_name=cfg.model.name, step=loaded.step,
                           tokens_per_step=loaded.tokens_per_step, forward=loaded.forward, norms=norms,
                           separator=loaded.separator).files


MAKERS = {"tiny": tiny_records, "smollm2": smollm2_records}


def fixture(name: str) -> Path:
    return DATA / f"probe_records_{name}.json.gz"


def differences(expected: object, actual: object, where: str) -> list[tuple[str, object, object]]:
    """Where the two differ: numbers beyond float32 rounding, anything else at all (the same structure)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [(where, list(expected), actual)]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{where}.{key}")]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [(where, expected, actual)]
        return [d for i, (e, a) in enumerate(zip(expected, actual, strict=True))
                for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, float) and not isinstance(actual, bool) and isinstance(actual, int | float):
        absolute = LOSS_ABSOLUTE if where.rsplit(".", 1)[-1].startswith("delta_loss") else ABSOLUTE
        close = math.isclose(actual, expected, rel_tol=RELATIVE, abs_tol=absolute)
        return [] if close or (math.isnan(expected) and math.isnan(actual)) else [(where, expected, actual)]
    return [] if actual == expected else [(where, expected, actual)]


def check(name: str) -> None:
    with gzip.open(fixture(name), "rt") as file:
        expected = json.load(file)
    actual = json.loads(json.dumps(MAKERS[name]()))  # as written: tuples are lists, NaN stays NaN
    assert list(actual) == list(expected)
    different = differences(expected, actual, name)
    assert not different, f"{len(different)} field(s) differ, e.g. {different[:10]}"


def test_tiny_gpt_records_equal_the_reference() -> None:
    check("tiny")


@pytest.mark.slow  # loads SmolLM2-135M (~14 s) and probes 316 tokens with the intervention
def test_smollm2_records_equal_the_reference() -> None:
    check("smollm2")


if __name__ == "__main__":
    for name in sys.argv[1:] or MAKERS:
        with gzip.open(fixture(name), "wt") as file:
            json.dump(MAKERS[name](), file)
        print(fixture(name), fixture(name).stat().st_size)
