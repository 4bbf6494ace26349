"""What a GPU run will cost, before it runs: ``python -m normgeo.plan <train.py overrides>``
(``normgeo-plan``).

Composes the config exactly as ``train.py`` would (same overrides, same schema check), writing nothing, and
prints the parameter counts, FLOPs, the peak memory per GPU by category (with and without activation
checkpointing, and at a probe), whether it fits each GPU of ``plan.gpus`` and the largest micro_batch that
does, the time and GPU-hours at ``plan.mfu``, and the disk the checkpoint schedule fills. The planning is
``models/step_cost.py`` (fake tensors; a compiled run as Inductor would run it: ``models/compiled_plan.py``);
train.py's pre-flight check is ``normgeo/runs/preflight.py``.

    python -m normgeo.plan experiment=paper_1b norm=rms
    python -m normgeo.plan experiment=paper_1b trainer=fsdp plan.devices=4 plan.mfu=0.35
    python -m normgeo.plan size=410m compile=true --measure   # on a GPU: the compiled step, measured

``--measure`` (one CUDA device) runs three real optimizer steps as the run will train and reports their
allocator peak beside the plan; ``--record`` adds it to ``docs/measured_peaks.json``, the measurements
``docs/plan.md`` and tests/test_plan.py hold the plan against:

    for spec in 70m:16 410m:32 1b:8; do size=${spec%:*}; mb=${spec#*:}
      for gb in $mb $((4 * mb)); do python -m normgeo.plan size=$size micro_batch=$mb global_batch=$gb \
        trainer=gpu compile=true --measure --record; done; done

``--seeds-for METRIC=MARGIN`` (a verdict metric, e.g. ``val_loss/tail``) prints the seeds per arm with which
TOST at 5% shows equivalence within ±MARGIN with 80% power, and the paired t-test detects a difference of
MARGIN, with their GPU-hours; the SD of the paired differences is given (``--sd``) or measured on a sweep's
primary contrast (``--sweep``):

    python -m normgeo.plan experiment=paper_70m --seeds-for val_loss=0.01 --sweep outputs/study
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from corpus.atomic import atomic_open
from corpus.refusal import refused
from models.step_cost import (
    GIB,
    GPUS,
    Plan,
    TrainSetup,
    fits,
    largest_micro_batch,
    make_plan,
    measure_step,
    quiet_plan,
)
from normgeo.config.checks import check_config, override_refusal, unknown_group_option
from normgeo.config.compose import CONF_DIR, TRAIN_CONFIG_DIRS
from normgeo.config.schema import ConfigError, TrainSchema
from normgeo.figures.style import norm_label
from normgeo.figures.sweep import load
from normgeo.figures.tables import print_table
from normgeo.measure.stats import seeds_for_difference, seeds_for_equivalence
from normgeo.readers.identity import DuplicateRuns
from normgeo.runs.build import make_schedule
from normgeo.runs.preflight import setup_from_config
from normgeo.verdict.declared import load_verdict_config
from normgeo.verdict.families import paired_estimates
from normgeo.verdict.measures import run_measures
from normgeo.verdict.metric_table import METRICS, metric

# The peaks measured on GPUs, one place: docs/plan.md's table and tests/test_plan.py read them, --record adds.
MEASURED_PEAKS = Path(__file__).resolve().parents[1] / "docs" / "measured_peaks.json"


def measured_peaks(path: Path = MEASURED_PEAKS) -> list[dict]:
    """The measured rows: size, norm, micro_batch, global_batch, compiled, peak_gib, device, date, torch."""
    return json.loads(path.read_text(encoding="utf-8"))["rows"]


def measured_overrides(row: dict) -> list[str]:
    """The train.py overrides of a measured row (a one-GPU run as bench/gpu_check.py trains it)."""
    return [f"size={row['size']}", f"norm={row['norm']}", f"micro_batch={row['micro_batch']}",
            f"global_batch={row['global_batch']}", "trainer=gpu", f"compile={str(row['compiled']).lower()}"]


def record_measurement(report: dict, path: Path = MEASURED_PEAKS) -> dict:
    """Add the report's measured step to ``path`` (replacing a row of the same configuration and device)."""
    measured, c = report["measured"], report["config"]
    row = {"size": c["size"], "norm": c["norm"], "micro_batch": c["micro_batch"],
           "global_batch": c["global_batch"], "compiled": measured["compiled"],
           "peak_gib": round(measured["peak"] / GIB, 2), "device": measured["device"],
           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "source": "python -m normgeo.plan --measure --record"}
    data = json.loads(path.read_text(encoding="utf-8"))
    same = ("size", "norm", "micro_batch", "global_batch", "compiled", "device")
    data["rows"] = [r for r in data["rows"] if any(r.get(k) != row[k] for k in same)] + [row]
    with atomic_open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    return row


def compose(overrides: Sequence[str]) -> TrainSchema:
    """train.py's typed config for ``overrides``, checked by the schema, without running Hydra's job (no
    files)."""
    if refusal := (override_refusal(overrides, "normgeo.plan")  # the options listed, as train.py does
                   or unknown_group_option(overrides, TRAIN_CONFIG_DIRS)):
        raise ConfigError(refusal)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
        cfg = hydra_compose(config_name="train", overrides=list(overrides))
    return check_config("train", cfg)


def checkpoint_disk(cfg: TrainSchema, plan: Plan) -> dict[str, int]:
    """Bytes the schedule writes: scheduled checkpoints (weights only unless keep_optimizer) + last.ckpt
    (full state). Tensor bytes only: the metadata (hparams, RNG states, run config) adds some kB."""
    schedule = make_schedule(cfg)  # the schedule train.py builds
    weights = plan.counts.parameter_bytes
    full = weights + plan.counts.optimizer_bytes
    each = full if schedule.keep_optimizer else weights
    return {"checkpoints": len(schedule), "scheduled_bytes": each, "last_bytes": full,
            "total_bytes": each * len(schedule) + full}


def gpu_rows(cfg: TrainSchema, plan: Plan, gpus: Sequence[str]) -> list[dict]:
    """Per GPU type: fits (configured micro_batch, with/without checkpointing), largest micro_batch, time."""
    setup, rows = plan.setup, []
    for key in gpus:
        gpu = GPUS[key]
        row: dict = {"gpu": key, "name": gpu.name, "memory_gib": gpu.memory / GIB}
        for checkpointing, strategy_plan in plan.plans.items():
            tag = "ac" if checkpointing else "no_ac"
            row[f"fits_{tag}"] = fits(strategy_plan.memory.total, gpu.memory, cfg.plan.headroom_gib,
                                      cfg.plan.fragmentation)
            row[f"largest_micro_batch_{tag}"] = largest_micro_batch(
                strategy_plan.peak, gpu.memory, setup.global_batch, setup.world_size,
                cfg.plan.headroom_gib, cfg.plan.fragmentation)
        step_s = plan.step_flops() / (setup.world_size * gpu.bf16_flops * cfg.plan.mfu)
        row["step_s"] = step_s
        row["run_hours"] = step_s * cfg.max_steps / 3600
        row["gpu_hours"] = row["run_hours"] * setup.world_size
        rows.append(row)
    return rows


def measured_step(setup: TrainSetup) -> dict:
    """:func:`models.step_cost.measure_step` on this machine's GPU, as a JSON-able dict; ``{"reason": ...}``
    where it cannot run (no CUDA device, or a strategy over several devices, whose buckets and shards only the
    trace models)."""
    if not torch.cuda.is_available():
        return {"reason": "no CUDA device here: the step is measured on the GPU it will train on"}
    if setup.world_size != 1 or setup.strategy != "single":
        return {"reason": f"{setup.strategy} over {setup.world_size} device(s): only a one-device step is "
                          "measured (the trace plans DDP's buckets and FSDP2's shards)"}
    return asdict(measure_step(setup, torch.device("cuda", torch.cuda.current_device())))


def plan_config(cfg: TrainSchema, *, both_checkpointing: bool = True, probe: bool = True,
                measure: bool = False) -> tuple[Plan, dict]:
    """The plan of a composed config and everything the command prints (a JSON-able dict); ``measure``: also
    the step measured on this machine's GPU (:func:`measured_step`)."""
    unknown = [g for g in cfg.plan.gpus if g not in GPUS]
    if unknown:
        raise ConfigError(f"plan.gpus={unknown[0]}: unknown GPU (one of {', '.join(GPUS)})")
    setup = setup_from_config(cfg)
    with quiet_plan():
        plan = make_plan(setup, both_checkpointing=both_checkpointing, probe=probe)
    report = {
        "config": {"size": cfg.size.name, "norm": cfg.norm.name, "precision": setup.precision,
                   "strategy": setup.strategy, "world_size": setup.world_size,
                   "micro_batch": setup.micro_batch, "global_batch": setup.global_batch,
                   "seq_len": setup.seq_len, "max_steps": int(cfg.max_steps),
                   "activation_checkpointing": setup.activation_checkpointing, "mfu": cfg.plan.mfu},
        "counts": asdict(plan.counts),
        "flops_per_token": {
            "counted": plan.configured.flops_per_token,
            "analytic": plan.analytic_flops_per_token,
            **{f"counted_{'ac' if k else 'no_ac'}": v.flops_per_token for k, v in plan.plans.items()},
        },
        "flops_per_step": plan.step_flops(),
        "tokens_per_step": plan.tokens_per_step(),
        "total_tokens": plan.tokens_per_step() * int(cfg.max_steps),
        "memory": {("ac" if k else "no_ac"): v.memory.as_dict() for k, v in plan.plans.items()},
        "peak_per_sample": {("ac" if k else "no_ac"): v.peak.per_sample for k, v in plan.plans.items()},
        "measured_at_micro_batch": list(plan.configured.peak.measured_at),
        "probe_memory": plan.probe.as_dict() if plan.probe else None,
        "gpus": gpu_rows(cfg, plan, cfg.plan.gpus),
        "disk": checkpoint_disk(cfg, plan),
        "headroom": {"gib": cfg.plan.headroom_gib, "fragmentation": cfg.plan.fragmentation},
        "compile": setup.compiled,
        "planned": "compiled" if plan.configured.compiled else "eager",
        "measured": measured_step(setup) if measure else None,
    }
    return plan, report


def _gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def print_report(report: dict) -> None:
    c, n, f = report["config"], report["counts"], report["flops_per_token"]
    print(
        f"plan: {c['size']} {c['norm']} · {c['strategy']} over {c['world_size']} GPU(s) · {c['precision']} · "
        f"micro_batch {c['micro_batch']} · global_batch {c['global_batch']} x seq_len {c['seq_len']} · "
        f"{c['max_steps']:,} steps (the tables: planned with fake tensors, the {report['planned']} step)"
    )
    print(f"parameters: {n['parameters']:,} total · {n['non_embedding']:,} non-embedding · "
          f"{n['parameter_bytes'] / 1e9:.2f} GB · AdamW state {n['optimizer_bytes'] / 1e9:.2f} GB")
    delta = f["counted"] / f["analytic"] - 1
    print(
        f"FLOPs per token: {f['counted']:.4g} counted (FlopCounterMode) · {f['analytic']:.4g} = 6N + "
        f"12·L·T·d with N = {n['matmul_parameters']:,} matmul weights ({delta:+.1%}: flash attention's "
        "backward recomputes the scores)"
        + (
            f" · {f['counted_ac']:.4g} with activation checkpointing"
            if "counted_ac" in f and not c["activation_checkpointing"]
            else ""
        )
    )
    print(f"per optimizer step: {report['flops_per_step']:.4g} FLOPs, {report['tokens_per_step']:,} tokens · "
          f"whole run: {report['total_tokens']:,} tokens")
    columns = list(report["memory"])
    header = ["GiB per GPU",
              *[("activation checkpointing" if k == "ac" else "no checkpointing") for k in columns]]
    if report["probe_memory"]:
        header.append("at a probe")
    rows = []
    for key in ("parameters", "gradients", "optimizer", "activations", "temporaries", "total"):
        row = [key, *[_gib(report["memory"][k][key]) for k in columns]]
        if report["probe_memory"]:
            row.append(_gib(report["probe_memory"][key]))
        rows.append(row)
    rows.append(["+ per extra sample", *[_gib(report["peak_per_sample"][k]) for k in columns],
                 *([""] if report["probe_memory"] else [])])
    print_table(header, rows, left=("GiB per GPU",))
    print(measured_text(report))
    h = report["headroom"]
    gpu_header = ["GPU", "GiB", "fits", "largest micro_batch", "fits (AC)", "largest micro_batch (AC)",
                  "s / step", "run hours", "GPU-hours"]
    gpu_lines = [[r["name"], f"{r['memory_gib']:.1f}", _yes(r.get("fits_no_ac")),
                  _mb(r.get("largest_micro_batch_no_ac")), _yes(r.get("fits_ac")),
                  _mb(r.get("largest_micro_batch_ac")), f"{r['step_s']:.2f}", f"{r['run_hours']:.1f}",
                  f"{r['gpu_hours']:.0f}"] for r in report["gpus"]]
    print_table(gpu_header, gpu_lines, left=("GPU",))
    print(
        f"fits: planned peak x {1 + h['fragmentation']:g} (fragmentation) + {h['gib']:g} GiB (CUDA context, "
        "NCCL) <= the card; largest micro_batch: peaks traced at micro_batch "
        f"{report['measured_at_micro_batch']} and extrapolated linearly, among those dividing global_batch / "
        f"GPUs; time at {c['mfu']:.0%} MFU of the dense bf16 peak (models/step_cost.py GPUS), probes and "
        "validation not included"
    )
    d = report["disk"]
    print(f"disk: {d['checkpoints']} scheduled checkpoints x {d['scheduled_bytes'] / 1e9:.2f} GB + last.ckpt "
          f"{d['last_bytes'] / 1e9:.2f} GB = {d['total_bytes'] / 1e9:.1f} GB (probe files not counted)")


def measured_text(report: dict) -> str:
    """What the memory table is for this configuration (the compiled step or the eager trace), and the
    measured step beside it."""
    traced = report["memory"]["ac" if report["config"]["activation_checkpointing"] else "no_ac"]["total"]
    planned = report["planned"]
    measured = report.get("measured")
    if measured and "peak" in measured:
        kind = "compiled" if measured["compiled"] else "eager"
        return (f"measured on {measured['device']}: {measured['steps']} {kind} steps at micro_batch "
                f"{measured['micro_batch']} peaked at {_gib(measured['peak'])} GiB "
                f"(the {planned} plan above: {_gib(traced)} GiB, ratio {measured['peak'] / traced:.3f})")
    why = f" (not measured: {measured['reason']})" if measured else ""
    if planned == "compiled":
        return ("the table plans the compiled step (models/compiled_plan.py: what Inductor saves and "
                f"writes; allocator fragmentation and workspaces not counted){why}")
    if report["compile"]:
        return ("compile=true: the table traces the eager step (activation checkpointing or FSDP2's "
                f"compute: not planned compiled), an upper bound{why}")
    return f"the table traces the eager step, as compile=false trains{why}"


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def _mb(value: int | None) -> str:
    return "none" if value is None else str(value)


def parse_seeds_for(text: str) -> tuple[str, float]:
    """``METRIC=MARGIN`` of ``--seeds-for``; ValueError with the fix."""
    name, sep, value = text.partition("=")
    if not sep or name not in METRICS:
        raise ValueError(f"--seeds-for {text}: write METRIC=MARGIN with a verdict metric "
                         f"({', '.join(METRICS)}), e.g. --seeds-for val_loss=0.01")
    try:
        margin = float(value)
    except ValueError:
        margin = math.nan
    if not margin > 0 or math.isinf(margin):
        raise ValueError(f"--seeds-for {text}: the margin is a positive number, e.g. {name}=0.01")
    return name, margin


def sweep_sd(sweep: Path, metric: str) -> tuple[float, str]:
    """The SD of the per-seed differences of ``metric`` in the
    sweep's primary contrast, and where it comes from in words."""
    config = load_verdict_config()
    arm, other = config.primary.arm, config.primary.other
    estimates, _ = paired_estimates(run_measures(load([sweep])), config)
    found = [e for e in estimates if (e.arm, e.other, e.metric) == (arm, other, metric) and e.n >= 2]
    if not found:
        raise ValueError(f"--sweep {sweep}: no {arm} vs {other} pair with two or more seeds of {metric}; "
                         f"give the SD with --sd")
    est = max(found, key=lambda e: e.n)
    values = list(est.values)
    where = f"{est.n} seeds of {sweep}" + (f", size {est.size}" if est.size else "")
    return statistics.stdev(values), where


def seeds_report(
    metric: str, margin: float, sd: float, source: str, report: dict, power: float = 0.8
) -> dict:
    """Seeds per arm for equivalence and for a difference at ``margin``, and their GPU-hours per GPU."""
    config = load_verdict_config()
    arm, other = config.primary.arm, config.primary.other
    equivalence = seeds_for_equivalence(sd, margin, power=power, alpha=config.alpha)
    difference = seeds_for_difference(sd, margin, power=power, alpha=config.alpha)
    return {
        "arm": arm, "other": other, "metric": metric, "margin": margin, "sd": sd, "sd_from": source,
        "power": power, "alpha": config.alpha, "size": report["config"]["size"],
        "seeds_equivalence": equivalence, "seeds_difference": difference,
        "gpus": [{"gpu": r["name"], "gpu_hours_per_run": r["gpu_hours"],
                  "gpu_hours_equivalence": 2 * equivalence * r["gpu_hours"],
                  "gpu_hours_difference": 2 * difference * r["gpu_hours"]} for r in report["gpus"]],
    }


def print_seeds(seeds: dict) -> None:
    about = metric(seeds["metric"])
    margin = about.margin_text(seeds["margin"])
    pair = f"{norm_label(seeds['arm'])} vs {norm_label(seeds['other'])}"
    print(
        f"seeds for {about.text} (`{seeds['metric']}`), paired SD {seeds['sd']:.4g} ({seeds['sd_from']}): "
        f"equivalence within {margin} (TOST at {seeds['alpha']:g}, {seeds['power']:.0%} power if the true "
        f"difference is 0): {seeds['seeds_equivalence']} seeds per arm; a true difference of "
        f"{margin.lstrip('±')} (paired t-test at {seeds['alpha']:g}, {seeds['power']:.0%} power): "
        f"{seeds['seeds_difference']} seeds per arm. GPU-hours: both arms, every seed, at this plan's "
        "GPU-hours per run (its FLOPs at plan.mfu; probes and validation not included)."
    )
    for row in seeds["gpus"]:
        print(
            f"{pair} at {seeds['size']} to {margin}: {seeds['seeds_equivalence']} seeds per arm, "
            f"{row['gpu_hours_equivalence']:,.0f} GPU-hours on {row['gpu']} (2 x "
            f"{seeds['seeds_equivalence']} runs x {row['gpu_hours_per_run']:.2f}; to detect a difference of "
            f"{margin.lstrip('±')}: {seeds['seeds_difference']} seeds per arm, "
            f"{row['gpu_hours_difference']:,.0f} GPU-hours)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train.py overrides (no -m: plan one run at a time)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    parser.add_argument("--measure", action="store_true",
                        help="on a CUDA machine, also run three real steps of the configuration as it will "
                             "train (compiled with compile=true) and report their peak memory")
    parser.add_argument("--record", action="store_true",
                        help="with --measure: add the measured peak to docs/measured_peaks.json")
    parser.add_argument("--seeds-for", metavar="METRIC=MARGIN", default=None,
                        help="seeds per arm that resolve MARGIN for a verdict metric, e.g. val_loss=0.01")
    parser.add_argument("--sd", type=float, default=None,
                        help="SD of the paired per-seed differences (for --seeds-for)")
    parser.add_argument(
        "--sweep",
        type=Path,
        default=None,
        help="a sweep folder (outputs/study) whose primary contrast gives the SD (for --seeds-for)",
    )
    args = parser.parse_args(argv)
    overrides, as_json = args.overrides, args.json
    try:
        seeds_for = None
        if args.seeds_for is None and (args.sd is not None or args.sweep is not None):
            raise ValueError("--sd/--sweep: give them with --seeds-for METRIC=MARGIN")
        if args.seeds_for is not None:
            seeds_for = parse_seeds_for(args.seeds_for)
            if (args.sd is None) == (args.sweep is None):
                raise ValueError(
                    "--seeds-for: give the paired SD with --sd X or a sweep with --sweep DIR (one)"
                )
            if args.sd is not None and not (args.sd > 0 and math.isfinite(args.sd)):
                raise ValueError(f"--sd {args.sd}: a positive number, e.g. --sd 0.03")
            if args.sweep is not None and not args.sweep.is_dir():
                raise ValueError(f"--sweep {args.sweep}: not a folder; give a sweep's output folder")
        cfg = compose(overrides)
        if seeds_for is not None:
            sd, source = (args.sd, "given") if args.sd is not None else sweep_sd(args.sweep, seeds_for[0])
        if args.record and not args.measure:
            raise ValueError("--record: give it with --measure (it records the measured step)")
        _, report = plan_config(cfg, measure=args.measure)
    except DuplicateRuns as err:  # --sweep holding two folders of one run: each named, as compare names them
        print(err, file=sys.stderr)
        return 2
    # Hydra's override/composition errors, ConfigError, and models.step_cost's and measure.stats' ValueErrors
    except (ValueError, HydraException, OmegaConfBaseException, FileNotFoundError) as err:
        return refused(str(err).splitlines()[0] if str(err) else type(err).__name__)
    if seeds_for is not None:
        try:
            report["seeds"] = seeds_report(*seeds_for, sd, source, report)
        except ValueError as err:  # more seeds than the planners search (measure.stats): not a traceback
            return refused(f"--seeds-for {seeds_for[0]}={seeds_for[1]:g}: {err}; a wider margin needs fewer")
    if args.record and "peak" in (report["measured"] or {}):
        row = record_measurement(report)
        print(f"recorded in {MEASURED_PEAKS}: {row}", file=sys.stderr)
    if as_json:
        print(json.dumps(report, indent=1))
    elif seeds_for is not None:
        print_seeds(report["seeds"])
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
