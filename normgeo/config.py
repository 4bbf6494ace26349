"""Hydra/OmegaConf glue: resolvers used by conf/ and helpers shared by train.py and analyze.py."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from omegaconf import OmegaConf

# conf/train: train.py's (and python -m corpus's) groups; conf/analyze: analyze.py's model presets;
# conf/shared: the probe presets both use (added by hydra_plugins/normgeo_searchpath).
CONF_ROOT = Path(__file__).resolve().parent.parent / "conf"
CONF_DIR = str(CONF_ROOT / "train")
ANALYZE_CONF_DIR = str(CONF_ROOT / "analyze")
SHARED_CONF_DIR = str(CONF_ROOT / "shared")


def _slug(value: str) -> str:
    """A readable, collision-safe folder name for a path or id: 'webtext-1a2b3c4d'."""
    text = str(value)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text.rstrip("/*")).name or "root").strip("-") or "root"
    return f"{stem}-{hashlib.sha256(os.path.abspath(text).encode()).hexdigest()[:8]}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda path: os.path.abspath(os.path.expanduser(str(path))))
    if not OmegaConf.has_resolver("slug"):
        OmegaConf.register_new_resolver("slug", _slug)
    from normgeo.session import register_resolver

    register_resolver()  # normgeo_if_accepted (conf/train.yaml's hydra.output_subdir and train.log)


register_resolvers()
