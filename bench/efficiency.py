"""Is RMSNorm cheaper than LayerNorm? The optimizer-step time of the norm arms, interleaved, with an interval.

Per size and mode (eager, compiled) the arms ``layer``, ``rms`` and ``layer_nobias`` are built as train.py
builds them (:class:`Arm`: one seed, the harness's AdamW and schedule) and step on the same fixed batches,
their order rotated from repeat to repeat. Per arm: the median step, tokens/s and MFU; against ``rms``: the
geometric mean of the per-repeat step-time ratios with its 95% t interval; one profiled step gives the
norm's share of the kernel time. docs/benchmarks.md explains the method.

    python bench/efficiency.py                                     # on a GPU: every size and mode, printed
    python bench/efficiency.py --sizes 70m --modes eager --json /tmp/eff-70m.json
    python bench/efficiency.py --page docs/efficiency.md /tmp/eff-*.json   # the page from saved results
    python bench/efficiency.py --standin --sizes 70m --json /tmp/x.json    # CPU stand-in: tiny models

``--standin`` builds, per size, a one-block model of width 32 on 32-token windows (``size=tiny``), so that
every size and mode runs on a CPU in seconds: it says that the measurement runs, not what a GPU does.
"""

from __future__ import annotations

import gc
import json
import math
import platform
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from benchlib import per_call_seconds, refused, rotated, script_parser, synchronize, utc_stamp
from hydra import compose, initialize_config_dir
from norm_cost import TOP_KERNELS, profiled_kernels
from train_throughput import autocast

from corpus.atomic import atomic_write_text
from models.hardware import default_precision, missing_cuda
from models.lit import compute_dtype, peak_flops
from models.norms import compile_refusal
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.measure.stats import mean_t_interval
from normgeo.runs.build import make_module

SIZES = ("70m", "160m", "410m", "1b")
ARMS = ("layer", "rms", "layer_nobias")
MODES = ("eager", "compiled")
REFERENCE = "rms"
STANDIN = ["size=tiny", "size.n_layer=1", "size.n_embd=32", "size.n_head=2", "seq_len=32", "micro_batch=2"]


def compile_counts() -> dict[str, int]:
    """Graphs Dynamo has compiled and graph breaks it has taken in this process so far."""
    counters = torch._dynamo.utils.counters
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class Arm:
    """One norm arm as train.py builds it, with its optimizer and schedule, and one optimizer step."""

    def __init__(self, size: str, arm: str, mode: str, device: torch.device, standin: bool,
                 extra: Sequence[str] = ()) -> None:
        """``extra``: Hydra overrides after the size's (bench/harness_overhead.py's: its run's own shape)."""
        overrides = [f"size={size}", f"norm={arm}", f"compile={mode == 'compiled'}",
                     f"trainer={'gpu' if device.type == 'cuda' else 'cpu'}"]
        if standin:
            overrides = [*overrides[1:], *STANDIN]
        overrides = [*overrides, *extra]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            self.cfg = check_config("train", compose("train", overrides=overrides))
        module = make_module(self.cfg)
        module.to(device)
        optimizers = module.configure_optimizers()
        self.optimizer = optimizers["optimizer"]
        self.schedule = optimizers["lr_scheduler"]["scheduler"]
        self.model = module.model.train()
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if mode == "compiled":
            self.model.compile()  # as LitGPT.configure_model compiles an unsharded model
        self.device, self.clip = device, float(self.cfg.trainer["gradient_clip_val"])
        self.fused = bool(self.optimizer.defaults.get("fused"))
        self.tokens = self.cfg.micro_batch * self.cfg.seq_len
        self.flops_per_token = module.model.flops_per_token(self.cfg.seq_len)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Two fixed batches of the arm's shape from its seed: the same for every arm of a size."""
        generator = torch.Generator().manual_seed(self.cfg.seed)
        shape = (self.cfg.micro_batch, self.cfg.seq_len + 1)
        vocab = self.model.config.vocab_size
        windows = [torch.randint(0, vocab, shape, generator=generator).to(self.device) for _ in range(2)]
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with autocast(self.cfg, self.device):
            loss = self.model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], indices: range) -> None:
        """A step per index, on the batches in turn."""
        for index in indices:
            self.step(*batches[index % len(batches)])


def log_ratio_interval(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    """Per-repeat ratios of paired times, their geometric mean and 95% t interval (on the logs)."""
    logs = [math.log(a / b) for a, b in zip(numerator, denominator, strict=True)]
    mean, low, high = mean_t_interval(logs)
    return {"ratios": [math.exp(x) for x in logs], "ratio": math.exp(mean),
            "low": math.exp(low) if low is not None else None,
            "high": math.exp(high) if high is not None else None}


def measure(size: str, mode: str, *, device: torch.device, standin: bool, steps: int, repeats: int,
            warmup: int, arms: Sequence[str] = ARMS) -> dict:
    """Every arm at ``size`` in ``mode``: warm-up, interleaved timed repeats, one profiled step."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    built = {arm: Arm(size, arm, mode, device, standin) for arm in arms}
    first = next(iter(built.values()))
    batches = first.batches()  # the same for every arm
    # annotations_excluded: the kernel totals without the device's annotation ranges
    result: dict = {"size": size, "mode": mode, "arms": {}, "micro_batch": first.cfg.micro_batch,
                    "annotations_excluded": True, "seq_len": first.cfg.seq_len,
                    "tokens_per_step": first.tokens}
    precision = str(first.cfg.trainer.get("precision") or default_precision())  # as trainer_arguments does
    result["precision"] = precision
    peak = peak_flops(device, compute_dtype(precision))
    for arm, run in built.items():
        first_step = per_call_seconds(lambda run=run: run.step(*batches[0]), 1, device)
        run.steps(batches, range(1, warmup))
        synchronize(device)
        result["arms"][arm] = {"first_step_s": first_step, "seconds": [], "fused_adamw": run.fused}
    before = compile_counts()
    for repeat in range(repeats):
        for arm in rotated(arms, repeat):
            seconds = per_call_seconds(lambda run=built[arm]: run.steps(batches, range(steps)), 1, device)
            result["arms"][arm]["seconds"].append(seconds / steps)
    after = compile_counts()
    result["compile"] = {"before_timing": before, "during_timing": {k: after[k] - before[k] for k in after}}
    for arm, run in built.items():
        entry = result["arms"][arm]
        median = statistics.median(entry["seconds"])
        entry.update(median_s=median, tokens_per_s=run.tokens / median,
                     mfu=run.flops_per_token * run.tokens / median / peak if peak else None,
                     profile=profiled_kernels(lambda run=run: run.step(*batches[0]), 1, device))
    if REFERENCE in built:
        reference = result["arms"][REFERENCE]["seconds"]
        result["ratios"] = {arm: log_ratio_interval(result["arms"][arm]["seconds"], reference)
                            for arm in arms if arm != REFERENCE}
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    del built
    return result


def machine(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "lightning": L.__version__,
            "python": platform.python_version(), "device": device.type}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["peak_flops"] = peak_flops(device, torch.bfloat16)
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


# -------------------------------------------------------------------------------------------------- page


def interval_text(ratio: dict) -> str:
    if ratio["low"] is None:
        return f"{ratio['ratio']:.3f} (one repeat: no interval)"
    return f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"


def medians_text(result: dict) -> str:
    """Each arm's median step, and layer/rms with its interval."""
    text = ", ".join(f"{arm} {e['median_s'] * 1e3:.2f} ms" for arm, e in result["arms"].items())
    ratio = result.get("ratios", {}).get("layer")
    return text + (f"; layer/rms {interval_text(ratio)}" if ratio else "")


def faster_text(ratio: dict) -> str:
    """How much faster RMSNorm's step is than the other arm's (the step-time ratio - 1), with its interval."""
    change = ratio["ratio"] - 1
    text = f"{abs(change) * 100:.1f}% {'faster' if change >= 0 else 'slower'}"
    if ratio["low"] is not None:
        text += f" (95% interval {(ratio['low'] - 1) * 100:+.1f}% to {(ratio['high'] - 1) * 100:+.1f}%)"
    return text


def answer_lines(results: Sequence[dict], where: str) -> list[str]:
    """One line per size and mode: how much faster a step of RMSNorm is than one of LayerNorm."""
    return [f"- {r['size']}, {r['mode']}: RMSNorm is {faster_text(r['ratios']['layer'])} per optimizer step "
            f"than LayerNorm on {where}" for r in results if "layer" in r.get("ratios", {})]


def page(results: Sequence[dict], info: dict, command: str, stamp: str, replaced: Sequence[dict] = ()) -> str:
    standin = info.get("gpu") is None
    where = f"a CPU stand-in ({info.get('cpu')}, {info.get('threads')} threads)" if standin else info["gpu"]
    lines = [
        "# Is RMSNorm cheaper? Optimizer-step time of the norm arms",
        "",
        f"Generated by `{command}` on {stamp}: {where}; torch {info['torch']} (CUDA {info['cuda']}), "
        f"lightning {info['lightning']}, python {info['python']}. Do not edit: run it again.",
        "",
        "What is timed (`bench/efficiency.py`'s docstring): one optimizer step of each arm as train.py "
        "builds it (same seed and non-norm weights, the harness's AdamW, fused on CUDA, and schedule, "
        "clipping at 1.0), in the harness's precision (bf16-mixed on a GPU), on the same fixed batches of "
        "the size's micro-batch × sequence length; eager, and `model.compile()` as `compile=true` trains. "
        "The arms are interleaved, their order rotated each repeat (the repeats, steps and warm-up of each "
        "row under Runs). Ratio: step time of the arm / step time of `rms`, the geometric mean of the "
        "per-repeat ratios with its 95% Student-t interval over repeats; above 1 means RMSNorm is faster. "
        "Norm share: the profiled step's kernel time in kernels that are a norm's (eager: the norm ops' own "
        "kernels; compiled: Inductor's kernels that fuse a norm, whole: an upper bound).",
        "",
    ]
    if standin:
        lines += [
            "**CPU stand-in**: a one-block model of width 32 per size; these rows say that the measurement "
            "runs, not what a GPU does.",
            "",
        ]
    measured = {(r["size"], r["mode"]) for r in results}
    missing = [f"{size} {mode}" for size in SIZES for mode in MODES if (size, mode) not in measured]
    lines += [
        "## The answer", "", *answer_lines(results, where), "",
        *([f"Not measured in these runs: {', '.join(missing)}.", ""] if missing else []),
        "## Per size and mode", "",
        "| size | mode | arm | step (median) | tokens/s | MFU | first step | ratio to rms [95% interval] | "
        "norm share of kernel time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        for arm, entry in result["arms"].items():
            ratio = result.get("ratios", {}).get(arm)
            norm_share = entry["profile"]["norm_share"]
            share = f"{norm_share:.1%}" if norm_share is not None else "-"
            mfu = f"{entry['mfu']:.1%}" if entry.get("mfu") is not None else "-"
            lines.append(f"| {result['size']} | {result['mode']} | {arm} | {entry['median_s'] * 1e3:.2f} ms "
                         f"| {entry['tokens_per_s']:,.0f} | {mfu} | {entry['first_step_s']:.1f} s | "
                         f"{interval_text(ratio) if ratio else 'reference'} | {share} |")
    lines += [
        "", "## Compilation during the timing", "",
        "Graphs Dynamo compiled and graph breaks, before the timed repeats (all arms' warm-up) and during "
        "them: a graph compiled during the timing would put the compiler in a step's time.",
        "",
    ]
    for result in results:
        if result["mode"] == "compiled":
            c = result["compile"]
            lines.append(
                f"- {result['size']}: before {c['before_timing']['graphs']} graphs, "
                f"{c['before_timing']['graph_breaks']} graph breaks; during {c['during_timing']['graphs']} "
                f"graphs, {c['during_timing']['graph_breaks']} graph breaks"
            )
    lines += [
        "", "## Where a step's kernel time goes", "",
        f"The profiled step's top {TOP_KERNELS} kernels (on the CPU: aten ops by self time) per size, mode "
        "and arm, with their share of the step's kernel time.",
        "",
    ]
    for result in results:
        for arm, entry in result["arms"].items():
            prof = entry["profile"]
            tops = "; ".join(f"`{short_name(t['name'])}` {t['share']:.1%}" for t in prof["top"] if t["share"])
            lines.append(
                f"- {result['size']} {result['mode']} {arm} ({prof['total_us'] / 1e3:.2f} ms of kernels): "
                f"{tops}"
            )
    if any(not r.get("annotations_excluded") for r in results):
        lines += [
            "",
            "In the runs of the sizes marked † below, the kernel totals (and so the norm shares' "
            "denominator) also count the device range of the `Optimizer.step#AdamW.step` annotation beside "
            "the optimizer's own kernels: the totals are high and the shares low by that range's share of "
            "the step (listed among the top kernels where it is one of them); the code since excludes "
            "annotation ranges.",
        ]
    lines += ["", "## Runs", ""]
    for result in results:
        arms = result["arms"]
        mark = "" if result.get("annotations_excluded") else " †"
        memory = result.get("peak_memory_bytes")
        lines.append(
            f"- {result['size']} {result['mode']}{mark}: micro-batch {result['micro_batch']} × "
            f"{result['seq_len']} tokens; {len(arms[REFERENCE]['seconds'])} repeats of {result['steps']} "
            f"steps per arm after {result['warmup']} warm-up steps; fused AdamW "
            f"{all(a['fused_adamw'] for a in arms.values())}"
            + (f"; peak memory (all arms held) {memory / 2**30:.1f} GiB" if memory is not None else "")
            + (f"; {result['stamp']}" if "stamp" in result else "")
            + f"; `{result['command']}`"
        )
    if replaced:
        lines += ["", "Replaced by a newer run of the same size and mode (not shown above):", ""]
        lines += [f"- {r['size']} {r['mode']}, {r['stamp']}: {medians_text(r)} over "
                  f"{len(r['arms'][REFERENCE]['seconds'])} repeats; `{r['command']}`" for r in replaced]
    return "\n".join(lines) + "\n"


def short_name(name: str) -> str:
    """A kernel's name without its namespaces, template arguments and parameters, at most 70 characters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = re.split(r"[<(]", name, maxsplit=1)[0].rsplit("::", 1)[-1]
    return name if len(name) <= 70 else name[:67] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm per repeat")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved repeats (at least 3 for an interval)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first (the compilation)")
    parser.add_argument("--standin", action="store_true",
                        help="a tiny model per size (CPU: seconds per size)")
    parser.add_argument("--json", type=Path, default=None, help="write the results there (one JSON object)")
    parser.add_argument("--page", type=Path, default=None,
                        help="write the markdown page there from the JSON files given after it "
                        "(no measuring)")
    parser.add_argument("results", nargs="*", type=Path, help="with --page: the JSON files of earlier runs")
    args = parser.parse_args(argv)
    if args.page is not None:
        return write_page(args.page, args.results)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if reason := missing_cuda("--device", device.type, "--device cpu --standin"):
        return refused("efficiency.py", reason)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for name, given, allowed in (("--sizes", sizes, SIZES), ("--modes", modes, MODES)):
        if bad := [x for x in given if x not in allowed]:
            return refused("efficiency.py", f"{name}: unknown {', '.join(map(repr, bad))}; "
                           f"choose from {', '.join(allowed)}")
    if args.steps < 1 or args.repeats < 1 or args.warmup < 1:
        return refused("efficiency.py", "--steps, --repeats and --warmup must be at least 1")
    if "compiled" in modes and (reason := compile_refusal(device.type)):
        return refused("efficiency.py", f"--modes compiled: {reason}; or --modes eager")
    # As the page shows it: what was measured, without where the results were written.
    given = list(argv if argv is not None else sys.argv[1:])
    if "--json" in given:
        del given[given.index("--json") : given.index("--json") + 2]
    command = " ".join(["python bench/efficiency.py", *given])
    results = []
    for size in sizes:
        for mode in modes:
            result = measure(size, mode, device=device, standin=args.standin, steps=args.steps,
                             repeats=args.repeats, warmup=args.warmup)
            result.update(steps=args.steps, warmup=args.warmup, command=command)
            results.append(result)
            print(f"{size} {mode}: {medians_text(result)}", flush=True)
    report = {"machine": machine(device), "stamp": utc_stamp(), "results": results}
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(report))
    return 0


def newest_results(reports: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """Per size and mode the result of the newest run holding it (each result stamped with its run's time),
    sizes and modes in order; and the older results of a size and mode that a newer run replaced."""
    stamped = [{**r, "stamp": report["stamp"]} for report in reports for r in report["results"]]
    stamped.sort(key=lambda r: r["stamp"], reverse=True)  # "YYYY-MM-DD HH:MM UTC" sorts as time
    kept: dict[tuple[str, str], dict] = {}
    replaced = []
    for result in stamped:
        key = (result["size"], result["mode"])
        if key in kept:
            replaced.append(result)
        else:
            kept[key] = result
    order = sorted(kept, key=lambda k: (SIZES.index(k[0]), MODES.index(k[1])))
    return [kept[k] for k in order], replaced


def write_page(out: Path, files: Sequence[Path]) -> int:
    """The page of the results in ``files`` (one machine's), sizes in order, to ``out`` (atomically). Where
    two runs measured the same size and mode, the newer one's result is shown and the older one named."""
    if not files:
        return refused("efficiency.py", "--page needs the JSON files of earlier runs after it")
    reports = [json.loads(path.read_text()) for path in files]
    machines = {report["machine"].get("gpu") or report["machine"].get("cpu") for report in reports}
    if len(machines) > 1:
        return refused("efficiency.py", f"--page takes one machine's runs, these come from "
                       f"{sorted(machines)}: give each machine its own page")
    results, replaced = newest_results(reports)
    stamps = sorted({r["stamp"] for r in results})
    text = page(
        results,
        reports[0]["machine"],
        " ; ".join(dict.fromkeys(r["command"] for r in results)),
        stamps[0] if len(stamps) == 1 else f"{stamps[0]} to {stamps[-1]}",
        replaced,
    )
    atomic_write_text(out, text)
    print(f"written {out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
