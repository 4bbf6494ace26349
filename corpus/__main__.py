"""Prepare training data ahead of time: ``python -m corpus data=openwebtext`` (same overrides as train.py).

Run it where the source can be reached (a login node with internet for OpenWebText); training jobs
then only read ``<data_root>/<name>/{train,val}.bin`` and ``meta.json``. Existing files are re-hashed in
full and prepared again when they do not match ``meta.json``: this is also the repair command.
``python -m corpus verify data=...`` only checks (every byte) and says whether a repair is needed.

The config is composed with Hydra's compose API, not ``@hydra.main``: this command writes only the data
folder, never ``.hydra/`` or a log into the run directory that the same overrides name for train.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from corpus.prepare import META_FILE, load_prepared, prepare
from corpus.refusal import Refusal, refused
from normgeo.config.checks import (
    build,
    group_options,
    hydra_error_line,
    override_refusal,
    unknown_group_option,
)
from normgeo.config.compose import CONF_DIR, TRAIN_CONFIG_DIRS
from normgeo.config.schema import check_data_path
from normgeo.paths import check_own_folder
from normgeo.runs.run_config import OUTPUT_MARKERS
from normgeo.signals import stop_on_signals

USAGE = "usage: python -m corpus [verify] data=<option> [data.source.path=...] [data_root=...]"


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    groups = TRAIN_CONFIG_DIRS
    if {"-h", "--help"} & set(overrides):
        print(f"{__doc__.split(chr(10) + chr(10))[0]}\n\n{USAGE}\n\ndata=<option>: "
              f"{', '.join(group_options('data', groups) or [])}; every other key as train.py takes it "
              "(python train.py --help)")
        return 0
    verify_only = bool(overrides) and overrides[0] == "verify"
    overrides = overrides[verify_only:]
    if refusal := override_refusal(overrides, "python -m corpus") or unknown_group_option(overrides, groups):
        print(f"{USAGE}\nerror: {refusal}", file=sys.stderr)
        return 2
    stop_on_signals("while preparing the data", "run the same command again to prepare it")
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="corpus"):
            cfg = compose(config_name="train", overrides=overrides)
        check_data_path(cfg)  # data=local without its path: named as train.py names it
        data_cfg = cfg.data
        directory = str(data_cfg.directory)
        # The command that repairs this corpus: this very command, without ``verify``.
        repair = str(data_cfg.prepare_command or " ".join(["python -m corpus", *overrides]))
        source = build(data_cfg.source, "data.source")  # a bug in a source keeps its traceback
    except (HydraException, OmegaConfBaseException, Refusal) as err:
        said = err if isinstance(err, Refusal) else hydra_error_line(err)  # Hydra's several lines in one
        print(f"{USAGE}\nerror: {said}", file=sys.stderr)
        return 2
    try:  # a command writes only into a folder it owns (normgeo.paths.check_own_folder): not inside a run
        check_own_folder(Path(directory), "data.directory", OUTPUT_MARKERS, own=META_FILE, beside="data")
        if verify_only:
            data = load_prepared(directory, tokenizer=data_cfg.tokenizer, prepare_hint=repair, verify="full")
        else:
            data = prepare(source, directory, tokenizer=data_cfg.tokenizer,
                           val_fraction=data_cfg.val_fraction, verify="full", repair=True)
    except Refusal as err:
        return refused(err)
    splits = data.meta["splits"]
    print(
        f"{data.directory}: {'verified, ' if verify_only else ''}train {splits['train']['tokens']:,} tokens, "
        f"val {splits['val']['tokens']:,} tokens from {data.meta['source']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
