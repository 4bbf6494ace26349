"""A norm arm defined in this test only, as a researcher adds one: its class, its registration and its YAML
(in a folder of the test's, on Hydra's search path), and nothing else. It trains, the probe measures it,
normgeo.compare judges it against RMSNorm, and it exports to Hugging Face with the harness's logits, the
saved model code holding a copy of its class (nnsight wraps that export); TransformerLens refuses it,
naming what it lacks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from models.export.hf import load_hf
from models.norms import NormArm, register_arm, unregister_arm
from models.pretrained import load_checkpoint
from normgeo.compare import main as compare_main
from normgeo.measure.records import read_rows
from tests.conftest import module_main, train_here

SCALE = "scale"
LACKS = "this arm has one scalar gain where its RMSNorm has one per channel"


class ScaleNorm(nn.Module):
    """RMS scaling with one scalar gain: ``g * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


YAML = """# ScaleNorm: RMS scaling with one scalar gain.
name: scale
eps: 1.0e-5
impl: stock
"""


@pytest.fixture
def scale_arm(tmp_path: Path) -> Iterator[Path]:
    """The arm registered, and the folder holding its YAML (``norm/scale.yaml``) for Hydra's search path."""
    conf = tmp_path / "conf"
    (conf / "norm").mkdir(parents=True)
    (conf / "norm" / f"{SCALE}.yaml").write_text(YAML)
    register_arm(NormArm(
        SCALE, ScaleNorm, lambda dim, eps, role: {"dim": dim, "eps": eps}, "rms", "ScaleNorm", "tab:purple",
        "RMS scaling with one scalar gain", contrasts=(("rms", "one gain vs a gain per channel"),),
        transformer_lens_lacks=LACKS,
    ))
    try:
        yield conf
    finally:
        unregister_arm(SCALE)


@pytest.mark.slow  # two tiny trainings, a comparison and two exports: about half a minute
def test_an_arm_defined_in_a_test_trains_probes_compares_and_exports(tmp_path: Path, scale_arm: Path,
                                                                     capfd) -> None:
    out = tmp_path / "outputs"
    for norm in ("rms", SCALE):
        train_here(out / f"tiny-{norm}-s0", f"norm={norm}", f"hydra.searchpath=[file://{scale_arm}]",
                   "max_steps=3", "checkpoint.steps=[2]", "checkpoint.last_every=0", "val_every=3",
                   "val_sequences=8")
    run = out / f"tiny-{SCALE}-s0"
    rows = read_rows(run / "angles.jsonl")
    assert {r["norm"] for r in rows} == {SCALE}
    assert {"ln1.in", "ln1.std", "ln1.out", "final.out"} <= {r["site"] for r in rows}  # an rms-kind site

    assert compare_main([str(out), "--formats", "png", "--refs=ones"]) == 0
    verdict = pd.read_csv(out / "compare" / "verdict.csv")
    judged = verdict[(verdict["arm"] == SCALE) & (verdict["other"] == "rms")]
    assert set(judged["metric"]) >= {"val_loss", "ones_dev/ln1.in"}
    assert "ScaleNorm − RMSNorm" in (out / "compare" / "verdict.md").read_text()

    hf = tmp_path / "hf"
    done = module_main(capfd, "export", run, "--to", "hf", "--out", hf)
    assert done.returncode == 0, done.stderr[-3000:]
    code = (hf / "modeling_normgeo.py").read_text()
    assert "class ScaleNorm(nn.Module):" in code
    imports = [line.split()[1] for line in code.splitlines() if line.startswith(("import ", "from "))]
    assert {name.partition(".")[0] for name in imports} <= {"__future__", "torch", "transformers"}, imports
    assert json.loads((hf / "config.json").read_text())["norm_class"] == "ScaleNorm"
    model = load_hf(hf)
    assert type(model.transformer.ln_f).__name__ == "ScaleNorm"
    assert type(model.transformer.ln_f) is not ScaleNorm  # the saved file's copy, not this module's class
    gpt, _, _ = load_checkpoint(Path(json.loads((hf / "normgeo_export.json").read_text())["checkpoint"]))
    ids = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - gpt(ids)).abs().max().item() <= 1e-5

    wrapped = module_main(capfd, "export", run, "--to", "nnsight", "--out", tmp_path / "nnsight")
    assert wrapped.returncode == 0 and (tmp_path / "nnsight" / "modeling_normgeo.py").read_text() == code

    refused = module_main(capfd, "export", run, "--to", "transformer-lens", "--out", tmp_path / "tl")
    assert refused.returncode == 2 and not (tmp_path / "tl").exists()
    assert refused.stderr.strip() == (
        f"error: TransformerLens cannot hold the {SCALE!r} arm exactly: {LACKS} (export it with --to hf or "
        "--to nnsight)"
    )
