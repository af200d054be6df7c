"""YAML presets that map 1:1 onto ``overnight.pipeline.config.JobConfig``.

``<alias>.yaml`` is applied automatically when ``--model <alias>`` is used;
any preset can also be passed explicitly with ``--config``.
"""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def preset_path(name: str) -> str:
    return os.path.join(HERE, f"{name}.yaml")


def preset_for_model(model: str) -> dict:
    """The preset shipped for a model alias, or {} when there is none."""
    from overnight.pipeline.configio import load_yaml

    path = preset_path(model)
    if os.path.sep in model or not os.path.exists(path):
        return {}
    return load_yaml(path)


def list_presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".yaml"))
