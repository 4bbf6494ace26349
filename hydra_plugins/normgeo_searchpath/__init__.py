"""conf/shared (the probe presets) on the search path of train.py, analyze.py and ``python -m corpus``.

A plugin rather than ``hydra.searchpath`` in the primary configs: Hydra's ``--help`` lists only the groups
of the initial search path, and ``probe`` must show there. It only touches apps whose config directory
is one of ours (conf/train, conf/analyze), so other Hydra apps in the same environment are left alone.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONF_ROOT = Path(__file__).resolve().parent.parent.parent / "conf"  # normgeo.config.compose.CONF_ROOT


class NormgeoSharedConf(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        ours = {f"file://{CONF_ROOT / name}" for name in ("train", "analyze")} | {
            str(CONF_ROOT / name) for name in ("train", "analyze")
        }
        if any(element.path in ours for element in search_path.get_path()):
            search_path.append("normgeo-shared", f"file://{CONF_ROOT / 'shared'}")
