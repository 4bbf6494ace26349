"""The cross-model summary on the console (python -m normgeo.analysis summary): readable at 80 columns.

It used to be one table of 12 columns that rich squeezed into 80 columns as ``89… ± 1.…``; now each
model gets two tables that fit, and no number is ever cut (normgeo.figures.tables folds text instead).
"""

from __future__ import annotations

import io

import pytest

from normgeo.figures.model_summary import print_summary, summarize
from normgeo.figures.tables import print_table

REFS = ("ones", "rand_a", "rand_b")


def angle_rows(model: str, norm: str, steps: list[int | None], layers: int) -> list[dict]:
    """angles.jsonl rows as analyze.py and the training probe write them: every norm, site kind, reference."""
    rows = []
    for step in steps:
        for layer in range(layers):
            for kind in ("in", "std", "out"):
                for i, ref in enumerate(REFS):
                    mean = 89.0 + 0.37 * i + 0.011 * layer + (11.5 if kind == "out" and ref == "ones" else 0)
                    rows.append(
                        {
                            "model": model,
                            "norm": norm,
                            "step": step,
                            "site": f"layer{layer}.ln1.{kind}",
                            "ref": ref,
                            "count": 100_000,
                            "zero_count": 0,
                            "mean_deg": mean,
                            "std_deg": 1.234 + 10.1 * (kind == "out"),
                            "min_deg": 60.0,
                            "max_deg": 120.0,
                        }
                    )
    return rows


def null_rows(model: str, norm: str, steps: list[int | None], layers: int) -> list[dict]:
    return [
        {
            "model": model,
            "norm": norm,
            "step": step,
            "site": f"layer{layer}.ln1.{kind}",
            "count": 100_000,
            "mean_deg": 89.9,
            "null_means": [89.5 + 0.01 * k for k in range(64)],
            "in_null_band": layer % 2 == 0,
        }
        for step in steps
        for layer in range(layers)
        for kind in ("in", "std", "out")
    ]


def rendered(summary: list[dict], width: int = 80) -> str:
    out = io.StringIO()
    print_summary(summary, file=out, width=width)
    return out.getvalue()


@pytest.mark.parametrize("steps", [[None], [0, 1000, 100000]], ids=["pretrained", "checkpoints"])
def test_the_summary_is_readable_at_80_columns_with_every_number_whole(steps: list[int | None]) -> None:
    models = [("smollm2-135m-instruct-q4_1", "rms", 30), ("pythia-1.4b-deduped", "layer", 49)]
    rows = [r for model, norm, layers in models for r in angle_rows(model, norm, steps, layers)]
    null = [r for model, norm, layers in models for r in null_rows(model, norm, steps, layers)]
    summary = summarize(rows, null)
    text = rendered(summary)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for row in summary:  # every pooled angle, and the per-norm numbers, printed whole
        assert f"{row['mean_deg']:.2f} ± {row['std_deg']:.2f}" in text
        assert f"{row['norm_abs_dev_deg']:.2f}" in text and f"{row['between_norm_std_deg']:.2f}" in text
    for model, norm, layers in models:
        assert f"{model} ({norm}, {layers} norms, 100,000 tokens)" in text
    ones = [row for row in summary if row["ref"] == "ones"]
    assert all(f"{row['norms_in_null_band']}/{row['sites']}" in text for row in ones)
    assert all(f"{row['ones_pooled_rank_pct']:.0f}%" in text for row in ones)


def test_a_squeezed_table_folds_text_and_keeps_numbers_whole() -> None:
    """Every table tool (status, plan, summary): a table wider than the console is never cut with '…'."""
    out = io.StringIO()
    header = ["run directory", "tokens/s", "loss"]
    print_table(header, [["outputs/" + "x" * 90, "123,456.78", "3.14159"]], left=("run directory",), file=out,
                width=40)
    text = out.getvalue()
    assert "…" not in text and "123,456.78" in text and "3.14159" in text
    assert max(len(line) for line in text.splitlines()) <= 40
