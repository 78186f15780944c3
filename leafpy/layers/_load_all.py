"""Imports every layer module so that each registers itself (the registry lists nothing by hand)."""

import importlib
import pkgutil
from pathlib import Path

_here = Path(__file__).parent
for _group in ("activation", "common", "loss", "utility", "container"):
    for _info in pkgutil.iter_modules([str(_here / _group)]):
        importlib.import_module(f"{__package__}.{_group}.{_info.name}")
