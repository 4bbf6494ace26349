"""Inference-time geometry of a pretrained model: ``python analyze.py model=pythia-1.4b``.

Streams ``probe.tokens`` tokens of the probe corpus (1M of Wikipedia, as the paper) through the model,
tokenized by the model's own tokenizer, and measures the angle of every token vector with the uniform
vector 1, two random directions and K null directions before each norm (``.in``), after its
standardization (``.std``) and after it (``.out``). Writes to ``outputs/analyze/<model>/``:
``angles.jsonl``, ``null.jsonl`` (where 1 stands among the null directions), ``intervention.jsonl``
(the loss change when LayerNorm's centering is removed or RMSNorm's added), ``probe_references.npz``,
``figures/``, ``summary.csv``/``summary.md`` (pooled over tokens and layers) and ``run_info.json``.

    python analyze.py model=smollm2-135m probe=local probe.path=../shared/corpora/wikipedia
    python analyze.py model=hub model.path=EleutherAI/pythia-160m
    python analyze.py model=checkpoint model.checkpoint=outputs/1b-rms-s0/checkpoints/last.ckpt
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from corpus.refusal import Refusal
from models.pretrained import load_model
from normgeo.config.checks import Refused, build, check_config, config_errors_exit_2, refuse
from normgeo.config.compose import (
    ANALYZE_CONF_DIR,
    CONF_ROOT,
    attach_log_file,
    close_file_logs,
    write_hydra_files,
)
from normgeo.figures.intervention_panels import print_intervention
from normgeo.figures.model_summary import print_summary
from normgeo.measure.pipeline import probe_ids
from normgeo.measure.probe_config import ProbeConfig
from normgeo.model_records import measure_model, probe_setup
from normgeo.paths import (
    check_own_folder,
    check_writable_folder,
    remove_created,
    topmost_missing,
)
from normgeo.run_folder import (
    REFERENCES_FILE,
    RUN_INFO_FILE,
)
from normgeo.runs.run_config import OUTPUT_MARKERS
from normgeo.signals import ignore_at_exit, stop_on_signals

log = logging.getLogger("normgeo.analyze")
# The log's name until the outputs are written: a failed
# start leaves an earlier analysis's analyze.log as it was.
PARTIAL = ".partial"


def _device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def analyze(cfg: DictConfig, probe: ProbeConfig) -> Path:
    """Measure one model with ``probe`` (the validated ``cfg.probe``) and write its outputs; returns the
    output directory."""
    out_dir = Path(cfg.out_dir)
    started = time.perf_counter()
    loaded = load_model(cfg.model, lm_head=bool(probe.intervention))
    model = loaded.model
    if cfg.model.get("device_map"):
        device = None  # accelerate placed the layers; inputs go where the first parameter is
    else:
        device = _device(cfg)
        model.to(device)
    loaded_at = time.perf_counter()
    # The probe's size rule, now that the model's seq_len is known (before anything is tokenized).
    setup = probe_setup(model, probe, cfg.model.seq_len, "model.seq_len")
    parameter = next(model.parameters())
    log.info("%s: %s params, %s norms (%s), d=%d, %s on %s, seq_len %d",
             cfg.model.name, f"{sum(p.numel() for p in model.parameters()):,}", len(setup.norms), setup.kind,
             setup.dim, parameter.dtype, device or "device_map", setup.seq_len)

    source = build(probe.source, "probe.source")
    ids = probe_ids(source, loaded.encode_batch, loaded.separator, probe)
    tokenized_at = time.perf_counter()
    measured = measure_model(
        model, ids, setup, probe, batch_size=cfg.model.batch_size, name=cfg.model.name, source=loaded.source,
        probe_source=source.describe(), step=loaded.step, tokens_per_step=loaded.tokens_per_step,
        forward=loaded.forward, headless=loaded.headless, device=device, progress=cfg.progress,
        announce_cost=True, separator=loaded.separator,
    )
    records = measured.records
    measured.info.update(load_s=round(loaded_at - started, 2), tokenize_s=round(tokenized_at - loaded_at, 2))
    figures = measured.save(out_dir)
    summary = measured.summary
    print_summary(summary, title=f"{cfg.model.name}: angles before/after its norms ({len(ids):,} tokens)")
    if records.intervention:
        budget = records.intervention[0]["intervention_tokens"]
        print_intervention(records.intervention, title=f"{cfg.model.name}: the centering intervention "
                           f"(the first {budget:,} tokens, 95% block-bootstrap intervals)")
    info = measured.info
    log.info("probe: %s tokens in %.1f s (%.0f tokens/s); peak RSS %.0f MiB",
             f"{len(ids):,}", info["probe_s"], info["tokens_per_s"], info["peak_rss_mib"])
    written = [*records.files, REFERENCES_FILE]
    log.info("wrote %s, summary.csv/md and %d figure(s) to %s", ", ".join(written), len(figures), out_dir)
    return out_dir


@hydra.main(config_path=ANALYZE_CONF_DIR, config_name="analyze", version_base="1.3")
def run(cfg: DictConfig) -> Refused | None:
    """compose (Hydra) -> validate -> create out_dir, log into it -> measure and write
    -> Hydra's files (.hydra/, analyze.log) only then. A refusal or failure removes
    the folders this start created and its partial log, so an earlier analysis in
    out_dir stays as it was; a refused job of a ``-m`` sweep lets the others run."""
    try:
        probe = check_config("analyze", cfg).probe
        check_writable_folder(Path(cfg.out_dir), "out_dir")
        check_own_folder(Path(cfg.out_dir), "out_dir", OUTPUT_MARKERS, own=RUN_INFO_FILE, beside="analysis")
    except Refusal as err:
        return refuse(cfg.out_dir, err)
    stop_on_signals("during the analysis", "a folder this run created is removed; run the same command again")
    out_dir = Path(cfg.out_dir)
    created = topmost_missing(out_dir)
    log_file = out_dir / f"{HydraConfig.get().job.name}.log"
    partial_log = log_file.with_name(log_file.name + PARTIAL)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        attach_log_file(partial_log)
        analyze(cfg, probe)
    except BaseException as err:
        close_file_logs(out_dir)
        partial_log.unlink(missing_ok=True)
        remove_created(out_dir, created)
        if isinstance(err, Refusal):  # a user's mistake: one line (any other exception keeps its traceback)
            return refuse(out_dir, err)
        raise
    close_file_logs(out_dir)
    write_hydra_files(out_dir, cfg)
    partial_log.replace(log_file)
    return None


# Hydra's own config errors exit 2 too, an unknown group option naming the options (normgeo.config.checks).
main = config_errors_exit_2(run, [Path(ANALYZE_CONF_DIR), CONF_ROOT / "shared"])

if __name__ == "__main__":
    try:
        main()
    finally:
        ignore_at_exit()
