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
from normgeo.config import CONF_DIR


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
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


if __name__ == "__main__":
    main()
