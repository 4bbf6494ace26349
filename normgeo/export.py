"""Export a trained arm: ``python -m normgeo.export RUN_DIR --to hf|transformer-lens|nnsight --out DIR``.

Reads one checkpoint of a train.py run (``--step N``, ``--checkpoint PATH``; default: the run's highest saved
step) and writes a new directory ``--out``: a Hugging Face directory that
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads offline (``--to hf``; nnsight
wraps it: ``--to nnsight``; :mod:`models.export.hf` says which class holds which arm), or TransformerLens
3.9's ``tl_config.json`` and weights (``--to transformer-lens``: the arms a TransformerLens norm holds), each
with the GPT-2 tokenizer, a model card and ``normgeo_export.json``. The directory is assembled beside
``--out`` and renamed into place: a failed export leaves nothing. ``--as rms`` converts a Pre-LN ``layer`` or
``layer_nobias`` arm into an RMSNorm model with the same logits (:func:`models.export.hf.to_hf`), the model
card giving the parity measured at export. Bad input (no checkpoint, a step not saved, an arm the target
cannot hold or convert, an existing ``--out``) is one line on stderr and exit code 2. docs/export.md has more.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from corpus.atomic import atomic_write_json, atomic_write_text, full_disk_cause, give_usual_file_modes
from corpus.refusal import Refusal, refused
from corpus.stream import tokens_per_step
from models.export.hf import (
    RmsParity,
    hf_class_name,
    lm_head_bias,
    rms_conversion_refusal,
    rms_parity,
    save_hf,
    to_hf,
)
from models.export.lens import TRANSFORMER_LENS_TARGET, save_transformer_lens, transformer_lens_refusal
from models.export.tokenizer import gpt2_tokenizer
from models.gpt import GPT
from models.norms import arm_label
from models.pretrained import load_checkpoint
from normgeo.measure.pipeline import measure_records
from normgeo.measure.probe import make_references
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.records import DamagedRecords
from normgeo.paths import check_own_folder, check_writable_folder
from normgeo.readers.identity import read_run_config
from normgeo.readers.metrics_csv import read_metrics
from normgeo.run_folder import CHECKPOINT_GLOB, LAST_CHECKPOINT, RunFolder
from normgeo.runs.run_config import EXPORT_INFO, OUTPUT_MARKERS
from normgeo.runs.session import divergence
from normgeo.signals import stop_on_signals

TARGETS = ("hf", "transformer-lens", "nnsight")
CONVERSIONS = ("rms",)  # --as: the norm a Pre-LN LayerNorm arm is converted to
CONVERTING_TARGETS = ("hf", "nnsight")  # the targets that save the Hugging Face directory
# The token ids the model card's parity is measured on: (sequences, tokens), seeded, capped at the context.
PARITY_SHAPE = (4, 64)
PARITY_SEED = 0


class ExportError(Refusal, ValueError):
    """Bad input: the message is the one line the user reads."""


@dataclass
class Exported:
    out_dir: Path
    checkpoint: Path
    step: int | None
    target: str
    model_class: str
    conversion: ConversionCheck | None = None  # --as rms: what the export measured on the conversion


@dataclass(frozen=True)
class ConversionCheck:
    """What ``--as rms`` measures on the converted model before it writes it (the model card's numbers)."""

    parity: RmsParity
    ones_energy: float  # the largest energy fraction along 1 at any norm input (float64; ~0 by construction)
    # the centering intervention "add centering" at every norm: its Δloss (float64)
    add_centering_delta_loss: float


def ones_energy_and_centering(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(the largest energy fraction along 1 at any norm input, the Δloss of the centering intervention at
    every norm at once) of ``model`` on ``ids`` (sequences, tokens), from the measurement pipeline."""
    probe = ProbeConfig(tokens=ids.numel(), seed=PARITY_SEED, intervention=["all"], intervention_tokens=None)
    records = measure_records(model, ids.flatten(), ids.shape[1], make_references(model.config.n_embd), probe,
                              batch_size=ids.shape[0], model_name="export", step=None, tokens_per_step=None)
    energy = [row["max"] for row in records.energy if row["quantity"] == "ones_fraction"]
    (everywhere,) = records.intervention
    return max(energy), everywhere["delta_loss"]


def check_conversion(gpt: GPT, ids: torch.Tensor) -> ConversionCheck:
    """The RMSNorm conversion's logit parity, and the probe's view of it (float64), on ``ids``."""
    energy, delta_loss = ones_energy_and_centering(to_hf(gpt, as_rms=True, dtype=torch.float64), ids)
    return ConversionCheck(rms_parity(gpt, ids), energy, delta_loss)


def choose_checkpoint(run_dir: Path, step: int | None = None, checkpoint: Path | None = None) -> Path:
    """The checkpoint to export: ``checkpoint``, the one of ``step``, or the run's highest saved step."""
    if checkpoint is not None:
        if not checkpoint.is_file():
            raise ExportError(
                f"--checkpoint {checkpoint}: no such file (give a .ckpt from <run_dir>/checkpoints/)"
            )
        # The model card and normgeo_export.json describe run_dir:
        # a checkpoint of another run would be mislabelled.
        owner = checkpoint.resolve().parent.parent
        if RunFolder(owner).run_config.is_file() and owner != run_dir.resolve():
            raise ExportError(
                f"--checkpoint {checkpoint} belongs to the run {owner}, not {run_dir}: give {owner} "
                "as the run directory"
            )
        return checkpoint
    if not run_dir.is_dir():
        raise ExportError(
            f"run directory {run_dir} does not exist (give a train.py run directory, e.g. "
            "outputs/smoke-rms-s0)"
        )
    folder = RunFolder(run_dir)
    steps = folder.scheduled_checkpoints()
    last = folder.last_checkpoint
    if not steps and not last.is_file():
        raise ExportError(
            f"{run_dir} has no checkpoints (no {folder.checkpoints}/{CHECKPOINT_GLOB} or {LAST_CHECKPOINT}): "
            "give a train.py run directory that has saved one"
        )
    if step is None:
        return steps[max(steps)] if steps else last
    if step not in steps:
        saved = ", ".join(map(str, steps)) or "none"
        raise ExportError(
            f"--step {step}: {run_dir} saved no checkpoint at that step (saved steps: {saved}); "
            "pick one of them or --checkpoint PATH"
        )
    return steps[step]


def _validation_loss(run_dir: Path, step: int | None) -> tuple[float, int] | None:
    """The last validation loss logged at or before ``step`` (value, its step), if the run logged one."""
    try:
        metrics = read_metrics(run_dir)
    except (OSError, ValueError):
        return None
    val = metrics[metrics["metric"] == "val/loss"]
    if step is not None:
        val = val[val["step"] <= step]
    if val.empty:
        return None
    row = val.sort_values("step").iloc[-1]
    return float(row["value"]), int(row["step"])


# Said in the card of every export with its own model code: when trust_remote_code=True is needed, and why the
# tokenizer is loaded by its class (AutoTokenizer reads
# config.json first, finds custom code and asks about it).
CUSTOM_CODE = (
    "`trust_remote_code=True` is needed for the model only: `{cls}` (a norm or placement transformers has no "
    "class for) is defined in `modeling_normgeo.py` beside the weights, which transformers runs. The "
    "tokenizer is GPT-2's and needs no code: `GPT2TokenizerFast.from_pretrained` loads it without asking. "
    "`AutoTokenizer.from_pretrained` reads `config.json` first, finds the model's custom code there and asks "
    "whether to run it; `AutoTokenizer.from_pretrained(DIR, trust_remote_code=False)` loads the same "
    "tokenizer without asking."
)
HOW_TO_LOAD = {
    "hf": """```python
from transformers import AutoModelForCausalLM, GPT2TokenizerFast
model = AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True)  # {cls}
tokenizer = GPT2TokenizerFast.from_pretrained("{dir}")  # GPT-2's BPE: no custom code
logits = model(**tokenizer("The norm of", return_tensors="pt")).logits
```""",
    "nnsight": """```python
from nnsight import NNsight
from transformers import AutoModelForCausalLM
model = NNsight(AutoModelForCausalLM.from_pretrained("{dir}", trust_remote_code=True))  # {cls}
```""",
    "transformer-lens": """```python
import json
from safetensors.torch import load_file
from transformer_lens import HookedTransformer, HookedTransformerConfig
model = HookedTransformer(HookedTransformerConfig(**json.load(open("{dir}/tl_config.json"))))
# Processing OFF: TransformerLens' defaults make the residual stream orthogonal to 1 (see docs/export.md).
model.load_and_process_state_dict(load_file("{dir}/model.safetensors"), fold_ln=False,
    center_writing_weights=False, center_unembed=False, fold_value_biases=False)
```
or, with normgeo installed, `models.export.lens.load_transformer_lens("{dir}")`.""",
}


def parity_ids(gpt: GPT) -> torch.Tensor:
    """The token ids the export measures the conversion's parity on (seeded, real GPT-2 ids)."""
    sequences, tokens = PARITY_SHAPE
    return torch.randint(0, gpt.config.vocab_size, (sequences, min(tokens, gpt.config.block_size)),
                         generator=torch.Generator().manual_seed(PARITY_SEED))


def conversion_section(gpt: GPT, check: ConversionCheck) -> list[str]:
    """The model card's account of ``--as rms``: what changed, and the parity measured at export."""
    cfg = gpt.config
    sequences, tokens = parity_ids(gpt).shape
    return [
        f"## Converted from {arm_label(cfg.norm)} to RMSNorm",
        "",
        f"This is the Pre-LN `{cfg.norm}` arm converted to an RMSNorm model with the same logits (`--as "
        "rms`, `models/export/hf.py`): every weight that writes into the residual stream (token and position "
        "embeddings, each attention and MLP output projection and its bias) is centred across the "
        f"{cfg.n_embd} channels, so the residual stream is mean-zero and each LayerNorm equals an RMSNorm on "
        f"it (same eps, {cfg.norm_eps:g}); each LayerNorm's gain and bias are folded into the linear layer "
        "it feeds (ln1 into the attention's qkv, ln2 into the MLP's first layer, the final norm into the LM "
        "head), and every RMSNorm has gain 1.",
        "",
        "- The LM head is **untied** from the input embedding: it holds the final norm's gain (and the "
        "embedding is centred)"
        + (" and was tied in training." if cfg.tie_embeddings else "; it was untied in training too."),
        (
            "- The LM head has a **bias**: the final LayerNorm's bias, folded into it (`lm_head_bias: true` "
            "in `config.json`)."
            if lm_head_bias(cfg)
            else "- The LM head has no bias (the arm's LayerNorms have none)."
        ),
        "- The residual stream is the original's minus its mean at every position: the angle with **1** that "
        "normgeo measures reads 90° here by construction. Measure the original export (without `--as`) for "
        "the trained geometry.",
        "",
        f"Measured at export on {sequences} x {tokens} seeded token ids:",
        "",
        "| check | value |",
        "|---|---|",
        f"| logit parity, float64 | {check.parity.float64_relative:.1e} (max abs difference / max "
        "abs logit) |",
        f"| logit parity, float32 (these weights) | {check.parity.float32_max_abs:.1e} (max abs difference; "
        f"the original's own float32 logits are {check.parity.float32_rounding:.1e} from its float64 ones) |",
        f"| energy along 1 at the norm inputs, float64 | {check.ones_energy:.1e} (largest fraction) |",
        '| centering intervention "add centering" (every norm), float64 | Δloss '
        f"{check.add_centering_delta_loss:.1e} "
        "nats |",
        "",
    ]


def model_card(gpt: GPT, run_dir: Path, checkpoint: Path, step: int | None, hparams: dict, target: str,
               model_class: str, conversion: ConversionCheck | None = None) -> str:
    cfg = gpt.config
    tokens = (
        step * tokens_per_step(hparams["global_batch"], cfg.block_size)
        if step is not None and "global_batch" in hparams
        else None
    )
    val = _validation_loss(run_dir, step)
    run_config = RunFolder(run_dir).run_config
    lines = [
        f"# normgeo {arm_label(cfg.norm)} ({cfg.placement}-norm), step {step}",
        "",
        "A GPT-2 language model trained by the normgeo harness, exported with "
        f"`python -m normgeo.export --to {target}{' --as rms' if conversion else ''}`.",
        "",
        "| | |",
        "|---|---|",
        f"| arm | `{cfg.norm}` ({arm_label(cfg.norm)}){', converted to RMSNorm' if conversion else ''} |",
        f"| placement | {cfg.placement}-norm |",
        f"| size | {cfg.n_layer} layers, d = {cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}, "
        f"{gpt.num_parameters():,} parameters |",
        f"| embeddings | {'tied' if cfg.tie_embeddings else 'untied'} input embedding and LM head |",
        f"| vocabulary | GPT-2 BPE (tiktoken `gpt2`, {cfg.vocab_size} tokens); logits over "
        f"{cfg.padded_vocab_size} "
        "(padded to a multiple of 64 as in training: the padded ids are never produced by the tokenizer) |",
        f"| step | {step} |",
        f"| tokens seen | {tokens:,} |" if tokens is not None else "| tokens seen | unknown |",
        (
            f"| validation loss | {val[0]:.4f} nats (logged at step {val[1]}) |"
            if val
            else "| validation loss | not logged by this run |"
        ),
        f"| checkpoint | `{checkpoint.resolve()}` |",
        f"| model class | `{model_class}` |",
        "",
        "## How to load",
        "",
        HOW_TO_LOAD[target].format(dir="<this directory>", cls=model_class),
        "",
    ]
    if target != "transformer-lens" and model_class != "GPT2LMHeadModel":
        lines += [CUSTOM_CODE.format(cls=model_class), ""]
    if conversion is not None:
        lines += conversion_section(gpt, conversion)
    try:  # the one reader of a run's config: a damaged file is named in the card, not copied into it
        read_run_config(Path(run_dir))
    except DamagedRecords as err:
        lines += ["## The run's config", "", f"Not included: {err}.", ""]
    else:
        if run_config.is_file():
            lines += ["## The run's config", "", "```yaml", run_config.read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def export_run(run_dir: Path, target: str, out_dir: Path, step: int | None = None,
               checkpoint: Path | None = None, as_norm: str | None = None) -> Exported:
    """Write the export of one checkpoint to ``out_dir`` (which must not exist,
    or be empty); a Refusal (ExportError, FolderError, ...) on bad input. ``as_norm="rms"``: the Pre-LN
    LayerNorm arm converted to RMSNorm (:func:`models.export.hf.to_hf`)."""
    if target not in TARGETS:
        raise ExportError(f"--to {target}: choose one of {', '.join(TARGETS)}")
    if as_norm is not None and as_norm not in CONVERSIONS:
        raise ExportError(f"--as {as_norm}: choose one of {', '.join(CONVERSIONS)}")
    if as_norm is not None and target not in CONVERTING_TARGETS:
        raise ExportError(f"--as {as_norm} writes a Hugging Face directory: use it with --to "
                          f"{' or --to '.join(CONVERTING_TARGETS)}, not --to {target}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"--out {out_dir} exists and is not empty: choose a new directory or remove it")
    check_writable_folder(out_dir, "--out")  # a read-only or file-shaped parent: one line, before the work
    # Not inside a run (where resume, status and the sweep readers look), nor any other command's folder.
    check_own_folder(out_dir, "--out", OUTPUT_MARKERS, own=None, beside=target)
    path = choose_checkpoint(run_dir, step, checkpoint)
    gpt, saved_step, hparams = load_checkpoint(path)
    if target == "transformer-lens" and (refusal := transformer_lens_refusal(gpt.config)):
        raise ExportError(refusal)
    if as_norm is not None and (refusal := rms_conversion_refusal(gpt)):
        raise ExportError(f"--as {as_norm}: {refusal}")
    tokenizer = gpt2_tokenizer(gpt.config.block_size)
    as_rms = as_norm is not None
    model_class = "HookedTransformer" if target == "transformer-lens" else hf_class_name(gpt, as_rms=as_rms)
    conversion = check_conversion(gpt, parity_ids(gpt)) if as_rms else None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    try:  # made inside the try: a signal landing just after the mkdir still finds it removed
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        if target == "transformer-lens":
            save_transformer_lens(gpt, partial)
        else:
            save_hf(gpt, partial, as_rms=as_rms)
        tokenizer.save_pretrained(partial)
        atomic_write_text(
            partial / "README.md",
            model_card(gpt, run_dir, path, saved_step, hparams, target, model_class, conversion),
        )
        atomic_write_json(
            partial / EXPORT_INFO,
            {
                "run_dir": str(run_dir.resolve()),
                "checkpoint": str(path.resolve()),
                "step": saved_step,
                "target": target,
                "model_class": model_class,
                "norm": gpt.config.norm,
                "placement": gpt.config.placement,
                "tie_embeddings": gpt.config.tie_embeddings,
                **({"transformer_lens": TRANSFORMER_LENS_TARGET} if target == "transformer-lens" else {}),
                **(
                    {"as": as_norm, "conversion": dataclasses.asdict(conversion)}
                    if conversion is not None
                    else {}
                ),
            },
        )
        give_usual_file_modes(partial)
        try:
            if out_dir.is_dir():
                out_dir.rmdir()  # empty (checked above); rename needs the name free
            os.rename(partial, out_dir)
        except OSError as err:  # another export wrote --out in the meantime
            raise ExportError(
                f"--out {out_dir} was written by another command while this export ran: nothing of "
                "this one was kept; choose a new directory"
            ) from err
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        full = full_disk_cause(err)
        # safetensors' Rust writer reports a full disk as a SafetensorError, not an OSError: "(os error 28)".
        if full is not None or any(f"(os error {code})" in str(err) for code in (errno.ENOSPC, errno.EDQUOT)):
            where = full.filename if full is not None and full.filename else out_dir.parent
            raise ExportError(
                f"--out {out_dir}: the disk is full ({where}): nothing was kept; free some space and "
                "run the same command again"
            ) from err
        raise
    return Exported(out_dir, path, saved_step, target, model_class, conversion)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a train.py run directory (outputs/<run>)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="export checkpoints/step-<N>.ckpt")
    which.add_argument("--checkpoint", type=Path, default=None, help="export this .ckpt")
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target library")
    parser.add_argument("--out", required=True, type=Path, help="the new directory to write")
    parser.add_argument(
        "--as",
        dest="as_norm",
        default=None,
        choices=CONVERSIONS,
        help="convert a Pre-LN LayerNorm arm to an RMSNorm model with the same logits (--to hf/nnsight)",
    )
    args = parser.parse_args(argv)
    stop_on_signals("during the export", "--out was not written; run the same command again")
    try:
        exported = export_run(args.run_dir, args.to, args.out, args.step, args.checkpoint, args.as_norm)
    except Refusal as exc:
        return refused(exc)
    if (diverged := divergence(args.run_dir)) is not None:
        print(
            f"warning: {args.run_dir} diverged at step {diverged.get('step')} (its summary.json): the export "
            f"holds its checkpoint of step {exported.step}, saved before the divergence",
            file=sys.stderr,
        )
    print(
        f"exported {exported.checkpoint} (step {exported.step}) as {exported.model_class} to "
        f"{exported.out_dir}"
    )
    if (check := exported.conversion) is not None:
        print(f"converted to RMSNorm: logit parity {check.parity.float64_relative:.1e} relative in float64, "
              f"{check.parity.float32_max_abs:.1e} max abs in float32; energy along 1 at the norm inputs "
              f"{check.ones_energy:.1e}; add-centering Δloss {check.add_centering_delta_loss:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
