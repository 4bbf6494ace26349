"""Hydra/OmegaConf glue: resolvers used by conf/ and helpers shared by train.py and analyze.py."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from omegaconf import OmegaConf

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def slug(name: object, empty: str = "unnamed") -> str:
    """The one file/folder-name rule for a model name, Hub id or path: a Hub id's ``/`` becomes ``--``
    (the Hub cache's convention), every run of other characters than ``A-Za-z0-9._-`` one ``-``.

    ``EleutherAI/pythia-1.4b`` -> ``EleutherAI--pythia-1.4b``; independent of the working directory.
    """
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name or "").replace("/", "--"))
    return text.strip("-.") or empty


def path_slug(value: str) -> str:
    """A readable, collision-safe folder name for a path: 'webtext-1a2b3c4d' (its slug and a hash)."""
    text = str(value)
    stem = slug(Path(text.rstrip("/*")).name, empty="root")
    return f"{stem}-{hashlib.sha256(os.path.abspath(text).encode()).hexdigest()[:8]}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda path: os.path.abspath(os.path.expanduser(str(path))))
    if not OmegaConf.has_resolver("slug"):
        OmegaConf.register_new_resolver("slug", path_slug)
    if not OmegaConf.has_resolver("model_slug"):
        OmegaConf.register_new_resolver("model_slug", slug)  # conf/analyze.yaml's output folder
    from normgeo.session import register_resolver

    register_resolver()  # normgeo_if_accepted (conf/train.yaml's hydra.output_subdir and train.log)


register_resolvers()
