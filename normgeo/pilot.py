"""Where the variance of the primary question comes from: ``python -m normgeo.pilot outputs/pilot``
(``docs/make_pilot.sh`` trains the runs and calls it).

The primary question (``conf/compare/margins.yaml``: LayerNorm − RMSNorm, ``val_loss/tail``) is a paired
difference d per seed. A pilot sweep of both arms, each run named by its run config's ``seed`` (the initial
weights), ``data.seed`` (the batch order) and ``threads`` (the floating-point order), splits d's SD into:

- **initial weights**: ``seed`` varied, ``data.seed`` and ``threads`` at the base (the lowest values present);
- **batch order**: ``data.seed`` varied, ``seed`` and ``threads`` at the base;
- **floating-point order**: the same (seed, data.seed) at another thread count: each pair's d moves by
  e = d(t) − d(base), and with independent noise of SD s in both, var(e) = 2 s², so s = sqrt(mean(e²) / 2);
- **validation sample**: the base pair's final checkpoints scored window by window on the validation windows
  they were validated on; the SD of the mean difference over a bootstrap of the windows (2,000 draws).

With additive parts (weights + batches + floating point) the study's SD, where ``seed`` and ``data.seed`` move
together, is estimated as sqrt(var_weights + var_batches − var_fp) (each group holds the floating-point noise
once). It also reports each arm's SD over the weights group and the correlation of the two arms' losses within
a seed (the pairing removes 2 ρ sd_LN sd_RMS of the variance), and the seeds per arm the planner asks for at
the declared margin (:func:`normgeo.measure.stats.seeds_for_equivalence` and ``seeds_for_difference``, as
``python -m normgeo.plan --seeds-for``). Writes ``pilot.md``, ``pilot_runs.csv`` and ``pilot.json`` into the
folder (``--out``), and prints ``pilot.md``. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from corpus.atomic import atomic_write_text
from corpus.prepare import PreparedData, load_prepared
from corpus.refusal import Refusal, refused
from corpus.stream import TokenWindows
from corpus.unigram import unigram_cross_entropy
from models.norms import arm_label
from models.pretrained import load_checkpoint
from normgeo.measure.records import DamagedRecords
from normgeo.measure.stats import seeds_for_difference, seeds_for_equivalence
from normgeo.paths import check_own_folder
from normgeo.readers.metrics_csv import read_metrics
from normgeo.run_folder import RUN_CONFIG_FILE, RunFolder
from normgeo.runs.run_config import OUTPUT_MARKERS, load_run_config
from normgeo.runs.summary import read_summary
from normgeo.verdict.declared import load_verdict_config
from normgeo.verdict.measures import VAL_TAIL, tail_mean, validation_curve

BOOTSTRAP = 2000
PILOT_MD, PILOT_CSV, PILOT_JSON = "pilot.md", "pilot_runs.csv", "pilot.json"


class PilotError(Refusal, ValueError):
    """The folder holds no pilot the split can be read from; the message says what is missing."""


@dataclass(frozen=True)
class Split:
    """The paired SD's parts (nats), the runs behind each, and what the planner makes of them."""

    metric: str
    arm: str
    other: str
    margin: float
    sd_weights: float | None
    n_weights: int
    sd_batches: float | None
    n_batches: int
    sd_fp: float | None
    n_fp: int
    largest_fp_move: float | None  # the largest |change| of one arm's metric with the thread count
    sd_validation: float | None
    validation_windows: int
    checkpoint_gap: float | None  # checkpoints' mean difference − the logged final difference (a check)
    sd_arm: float | None
    sd_other: float | None
    correlation: float | None
    sd_study: float | None
    seeds_equivalence: int | None
    seeds_difference: int | None
    design: str  # what the runs trained: tokens per step, steps, learning-rate schedule, validation windows
    mean_final: float  # the runs' mean final validation loss (nats)
    unigram: float | None  # the validation targets' unigram cross-entropy (corpus.unigram)


def run_table(root: Path, metric: str) -> pd.DataFrame:
    """One row per finished run under ``root``: norm, seed, data_seed,
    threads, run_dir, the metric and the final validation loss. A run stopped
    before its end (no summary.json saying finished) is not a pilot point."""
    rows = []
    for config_path in sorted(root.glob(f"*/{RUN_CONFIG_FILE}")):
        run_dir = config_path.parent
        config = load_run_config(run_dir) or {}
        try:
            finished = bool(read_summary(run_dir).get("finished"))
        except DamagedRecords as err:  # its own account unreadable: not a pilot point, and said so
            print(f"skipped: {err}", file=sys.stderr)
            finished = False
        metrics = read_metrics(run_dir)
        curve = validation_curve(metrics)
        if curve.empty or not finished:
            continue
        data = config.get("data") or {}
        values = {"val_loss": float(curve.iloc[-1]), "val_loss/tail": tail_mean(curve, VAL_TAIL)}
        seed = int(config.get("seed", 0))
        norm = (config.get("norm") or {}).get("name")
        rows.append({"run": run_dir.name, "run_dir": str(run_dir), "norm": norm, "seed": seed,
                     "data_seed": int(data.get("seed", seed)), "threads": config.get("threads"),
                     "val_seed": data.get("val_seed"), "metric": values[metric], "final": values["val_loss"],
                     "rise": largest_rise(metrics)})
    return pd.DataFrame(rows, columns=["run", "run_dir", "norm", "seed", "data_seed", "threads", "val_seed",
                                       "metric", "final", "rise"])


def largest_rise(metrics: pd.DataFrame) -> float | None:
    """The largest rise of the logged training loss above its running minimum (nats): a spike. In the CPU
    study's runs an ordinary run rises about 1 nat once, early (docs/pilot/); one that diverged for a while at
    its peak learning rate and came back, over 4."""
    train = metrics[metrics["metric"] == "train/loss"].dropna(subset=["value"]).sort_values("step")["value"]
    return float((train - train.cummin()).max()) if len(train) else None


def pairs(runs: pd.DataFrame, arm: str, other: str) -> pd.DataFrame:
    """The paired difference arm − other per (seed, data_seed, threads) where both arms ran."""
    keys = ["seed", "data_seed", "threads"]
    runs = runs.assign(threads=runs["threads"].fillna(0).astype(int))  # 0 stands for torch's default
    a = runs[runs["norm"] == arm].set_index(keys)
    b = runs[runs["norm"] == other].set_index(keys)
    common = a.index.intersection(b.index)
    out = pd.DataFrame({"arm": a.loc[common, "metric"], "other": b.loc[common, "metric"],
                        "arm_run": a.loc[common, "run_dir"], "other_run": b.loc[common, "run_dir"]})
    out["d"] = out["arm"] - out["other"]
    return out.reset_index()


def design_text(run_dir: Path) -> str:
    """The training design of a pilot run, from its run config, in one line."""
    config = load_run_config(run_dir) or {}
    optim = config.get("optim") or {}
    return (
        f"{config.get('global_batch')} sequences x {config.get('seq_len')} tokens per step, "
        f"{config.get('max_steps'):,} steps, peak learning rate {optim.get('lr'):g} after "
        f"{optim.get('warmup_steps')} warm-up steps, cosine to {optim.get('min_lr_ratio'):g} of the peak, "
        f"{config.get('val_sequences')} validation windows (val_seed={config.get('val_seed')})"
    )


def sd_of(values: Sequence[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def validation_windows(run_dir: Path) -> tuple[PreparedData, TokenWindows, int, int]:
    """(the prepared data, the windows, their count, the micro-batch) of the run's validation: the data
    module's draw (``val_seed``, else ``seed``; ``val_sequences`` rounded to whole micro-batches)."""
    config = load_run_config(run_dir) or {}
    data = config["data"]
    prepared = load_prepared(data["directory"], tokenizer=data.get("tokenizer", "gpt2"))
    micro = int(config["micro_batch"])
    count = max(micro, int(config["val_sequences"]) // micro * micro)
    seed = config.get("val_seed")
    windows = TokenWindows(str(prepared.path("val")), prepared.num_tokens("val"), int(config["seq_len"]),
                           count, int(data["seed"] if seed is None else seed))
    return prepared, windows, count, micro


def unigram_baseline(run_dir: Path) -> float:
    """The unigram cross-entropy (nats) of the run's validation targets under its training split's token
    frequencies (:mod:`corpus.unigram`): what learning the frequencies alone reaches."""
    prepared, windows, count, _ = validation_windows(run_dir)
    targets = np.stack([windows[i][1].numpy() for i in range(count)])
    return unigram_cross_entropy(prepared, targets)


def window_losses(run_dir: Path) -> np.ndarray:
    """The run's last checkpoint, scored window by window on the validation windows it was validated on."""
    folder = RunFolder(run_dir)
    newest = [*folder.scheduled_checkpoints().values()][-1:]  # the highest step's, or none
    found = folder.last_checkpoint if folder.last_checkpoint.is_file() else next(iter(newest), None)
    if found is None:
        raise PilotError(f"{run_dir}: no checkpoint to score the validation windows with")
    model, _, _ = load_checkpoint(found)
    _, windows, count, micro = validation_windows(run_dir)
    losses = []
    with torch.no_grad():
        for start in range(0, count, micro):
            inputs, targets = zip(*(windows[i] for i in range(start, min(start + micro, count))), strict=True)
            logits = model(torch.stack(inputs))
            per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.stack(targets),
                                                          reduction="none")
            losses += per_token.mean(dim=1).tolist()
    return np.asarray(losses)


def validation_sd(arm_run: Path, other_run: Path) -> tuple[float, int, float]:
    """(the bootstrap SD of the mean window difference arm − other, windows, their mean difference)."""
    diff = window_losses(arm_run) - window_losses(other_run)
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(diff), size=(BOOTSTRAP, len(diff)))
    return float(diff[draws].mean(axis=1).std(ddof=1)), len(diff), float(diff.mean())


def split_variance(root: Path, score_windows: bool = True) -> tuple[Split, pd.DataFrame]:
    """The split of the primary question's paired SD from the pilot runs under ``root``."""
    config = load_verdict_config()
    arm, other, name = config.primary.arm, config.primary.other, config.primary.metric
    if not name.startswith("val_loss"):
        raise PilotError(
            f"the primary metric {name} is not a validation loss; the pilot splits val_loss only"
        )
    runs = run_table(root, name)
    if runs.empty:
        raise PilotError(
            f"{root}: no finished run (run_config.yaml and a logged val/loss); run docs/make_pilot.sh"
        )
    paired = pairs(runs, arm, other)
    if paired.empty:
        raise PilotError(f"{root}: no (seed, data.seed, threads) with both {arm} and {other}")
    base_seed, base_data, base_threads = (int(paired[k].min()) for k in ("seed", "data_seed", "threads"))
    at_base = paired[paired["threads"] == base_threads]
    weights = at_base[at_base["data_seed"] == base_data]
    batches = at_base[at_base["seed"] == base_seed]
    moved = []
    runs_fp = runs.assign(threads=runs["threads"].fillna(0).astype(int))
    for row in paired[paired["threads"] != base_threads].itertuples():
        same = paired[(paired["seed"] == row.seed) & (paired["data_seed"] == row.data_seed)
                      & (paired["threads"] == base_threads)]
        if not same.empty:
            moved.append(row.d - float(same["d"].iloc[0]))
    arm_moves = []
    for (norm, _, _), group in runs_fp.groupby(["norm", "seed", "data_seed"]):
        if group["threads"].nunique() > 1 and norm in (arm, other):
            arm_moves.append(float(group["metric"].max() - group["metric"].min()))
    sd_w, sd_b = sd_of(list(weights["d"])), sd_of(list(batches["d"]))
    sd_fp = math.sqrt(float(np.mean(np.square(moved))) / 2) if moved else None
    var_study = [v * v for v in (sd_w, sd_b) if v is not None]
    sd_study = None
    if var_study:
        total = sum(var_study) - (sd_fp ** 2 if sd_fp is not None and len(var_study) == 2 else 0.0)
        sd_study = math.sqrt(max(total, *var_study))  # never below either measured part
    sd_val, windows, gap = None, 0, None
    base = at_base[(at_base["seed"] == base_seed) & (at_base["data_seed"] == base_data)]
    if score_windows and not base.empty:
        sd_val, windows, mean_diff = validation_sd(Path(base["arm_run"].iloc[0]),
                                                   Path(base["other_run"].iloc[0]))
        final = runs.set_index("run_dir")["final"]
        gap = mean_diff - (final[base["arm_run"].iloc[0]] - final[base["other_run"].iloc[0]])
    sd_arm, sd_other = sd_of(list(weights["arm"])), sd_of(list(weights["other"]))
    correlation = (float(np.corrcoef(weights["arm"], weights["other"])[0, 1])
                   if len(weights) >= 3 and sd_arm and sd_other else None)
    margin = config.margin(name)
    seeds_eq = seeds_diff = None  # also when more than the planners' 100,000 seeds would be needed
    with contextlib.suppress(ValueError):
        seeds_eq = seeds_for_equivalence(sd_study, margin, alpha=config.alpha) if sd_study else None
    with contextlib.suppress(ValueError):
        seeds_diff = seeds_for_difference(sd_study, margin, alpha=config.alpha) if sd_study else None
    unigram = unigram_baseline(Path(base["arm_run"].iloc[0])) if score_windows and not base.empty else None
    split = Split(name, arm, other, margin, sd_w, len(weights), sd_b, len(batches), sd_fp, len(moved),
                  max(arm_moves) if arm_moves else None, sd_val, windows, gap, sd_arm, sd_other, correlation,
                  sd_study, seeds_eq, seeds_diff, design_text(Path(runs["run_dir"].iloc[0])),
                  float(runs["final"].mean()), unigram)
    return split, runs


def _n(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def pilot_markdown(split: Split, runs: pd.DataFrame) -> str:
    s = split
    pair = f"{arm_label(s.arm)} − {arm_label(s.other)}"
    lines = [
        f"# The pilot: where the variance of {pair} `{s.metric}` comes from",
        "",
        f"The design priced: {s.design}.",
        "",
        f"{len(runs)} runs. Each part is the SD of the paired difference with only that source varied "
        "(nats); `python -m normgeo.pilot` (normgeo/pilot.py says how each is computed).",
        "",
        "| source | varied | pairs | SD of the paired difference |",
        "|---|---|---|---|",
        f"| initial weights | `seed` | {s.n_weights} | {_n(s.sd_weights)} |",
        f"| batch order | `data.seed` | {s.n_batches} | {_n(s.sd_batches)} |",
        f"| floating-point order | `threads` | {s.n_fp} | {_n(s.sd_fp)} |",
        f"| validation sample | bootstrap over {s.validation_windows} windows of one pair | 1 | "
        f"{_n(s.sd_validation)} |",
        "| **the study's design** (`seed` and `data.seed` together) | estimated | - | "
        f"**{_n(s.sd_study)}** |",
        "",
        f"- Each arm over the initial weights: SD {_n(s.sd_arm)} ({arm_label(s.arm)}), {_n(s.sd_other)} "
        f"({arm_label(s.other)}); their correlation within a seed: {_n(s.correlation, '.2f')} (the pairing "
        "removes 2 ρ sd sd of the variance: near 0, the arms' runs decorrelate and the pairing buys "
        "nothing).",
        (
            f"- The thread count moved one arm's `{s.metric}` by at most {_n(s.largest_fp_move)} nats "
            f"(the margin: ±{s.margin:g}; a quarter of it: {s.margin / 4:g})."
            if s.n_fp
            else "- The floating-point order: no pair of runs with another thread count here (the study "
            "re-trains two of its runs with 2 threads: `docs/make_threads_check.sh`)."
        ),
        f"- What the runs learned: mean final validation loss {s.mean_final:.3f} nats over the {len(runs)} "
        "runs; the validation text's unigram cross-entropy (the training split's token frequencies, add-half "
        f"smoothing) is {_n(s.unigram, '.3f')}.",
        "- Check: the checkpoints scored on the validation windows differ from the logged final difference "
        f"by {_n(s.checkpoint_gap, '+.5f')} nats.",
        f"- At the study's SD, ±{s.margin:g} nats at 80% power: {s.seeds_equivalence or '-'} seeds per arm "
        f"to show equivalence (TOST, true difference 0), {s.seeds_difference or '-'} to detect a difference "
        f"of {s.margin:g}: `python -m normgeo.plan experiment=study_cpu --seeds-for {s.metric}={s.margin:g} "
        f"--sd {_n(s.sd_study)}`.",
        "",
        "| run | arm | seed | data.seed | threads | " + s.metric + " | largest rise of train/loss above its "
        "running minimum |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.run} | {r.norm} | {r.seed} | {r.data_seed} | {r.threads if r.threads is not None else '-'} | "
        f"{r.metric:.4f} | {_n(r.rise, '.2f')} |"
        for r in runs.sort_values(["seed", "data_seed", "threads", "norm"]).itertuples()
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-pilot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the pilot sweep's folder (docs/make_pilot.sh's output)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where pilot.md/.csv/.json go (default: the folder)")
    args = parser.parse_args(argv)
    out = args.out or args.folder
    try:
        if not args.folder.is_dir():
            raise PilotError(f"{args.folder}: not a folder; give the pilot sweep's output folder")
        if args.out is not None:  # a command writes only into a folder it owns: not into a run (issue 64)
            check_own_folder(args.out, "--out", OUTPUT_MARKERS, own=None, beside="pilot")
        split, runs = split_variance(args.folder)
        out.mkdir(parents=True, exist_ok=True)
    except (Refusal, OSError) as err:
        return refused(str(err).splitlines()[0])
    text = pilot_markdown(split, runs)
    atomic_write_text(out / PILOT_MD, text)
    atomic_write_text(out / PILOT_CSV, runs.drop(columns=["run_dir"]).to_csv(index=False))
    atomic_write_text(out / PILOT_JSON, json.dumps(asdict(split), indent=1) + "\n")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
