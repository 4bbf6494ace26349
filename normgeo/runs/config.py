"""Hydra/OmegaConf glue: where conf/ lives, the one name slug, the resolvers conf/ uses and the schemas'
registration (the config check itself: :mod:`normgeo.runs.checks`)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from omegaconf import OmegaConf

from normgeo.runs.schema import SCHEMAS, key_docs

# conf/train: train.py's (and python -m corpus's) groups; conf/analyze: analyze.py's model presets;
# conf/shared: the probe presets both use (added by hydra_plugins/normgeo_searchpath).
CONF_ROOT = Path(__file__).resolve().parents[2] / "conf"
CONF_DIR = str(CONF_ROOT / "train")
REPO_ROOT = CONF_ROOT.parent
# An absolute path in a generated page: a "/" not inside a word, a number or a URL ("https://"), then no space.
ABSOLUTE_PATH = re.compile(r"(?<![\w./])/(?!/)[^\s,;)'\"`]+")


def repo_relative(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with every absolute path on this machine written relative to the repository (``../shared/...``),
    so that a generated page's commands and sources run from any checkout."""

    def relative(match: re.Match[str]) -> str:
        path = match.group(0)
        top = Path("/", Path(path).parts[1]) if len(Path(path).parts) > 1 else None
        return os.path.relpath(path, root) if top is not None and top.exists() else path

    return ABSOLUTE_PATH.sub(relative, text)
ANALYZE_CONF_DIR = str(CONF_ROOT / "analyze")
SHARED_CONF_DIR = str(CONF_ROOT / "shared")


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
        OmegaConf.register_new_resolver("model_slug", slug)  # conf/analyze/analyze.yaml's output folder
    if not OmegaConf.has_resolver("normgeo_key_docs"):  # hydra.help.template: every key with its doc
        OmegaConf.register_new_resolver("normgeo_key_docs", _key_docs)


def _key_docs(schema: str) -> str:
    return "\n".join(key_docs(SCHEMAS[schema][0])).replace("$", "$$")  # the help template is a string.Template


register_resolvers()
from normgeo.runs.schema import register as _register_schemas  # noqa: E402  (needs the resolvers above)

_register_schemas()
