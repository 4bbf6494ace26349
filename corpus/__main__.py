"""Prepare training data ahead of time: ``python -m corpus data=openwebtext`` (same overrides as train.py).

Run it where the source can be reached (a login node with internet for OpenWebText); training jobs
then only read ``<data_root>/<name>/{train,val}.bin`` and ``meta.json``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from corpus.prepare import PreparedDataError, prepare
from corpus.sources import SourceError
from normgeo.config import CONF_DIR, config_errors_exit_2


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
    source = hydra.utils.instantiate(cfg.data.source)
    try:
        data = prepare(source, cfg.data.directory, val_fraction=cfg.data.val_fraction)
    except (SourceError, PreparedDataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    splits = data.meta["splits"]
    print(
        f"{data.directory}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} tokens "
        f"from {data.meta['source']}"
    )


main = config_errors_exit_2(run)  # Hydra's own config errors exit 2, as train.py's

if __name__ == "__main__":
    main()
