"""setup.cfg lists every package of the plugin: a non-editable install (a wheel, the GPU
bundle's) takes only the listed ones, so a new sub-package left out would be missing there
while every editable test still passed."""

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_lists_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for init in (ROOT / "vllm_triforce").rglob("__init__.py")}
    assert found, "no package found: the test proves nothing"
    assert found - listed == set(), f"packages missing from setup.cfg: {sorted(found - listed)}"
