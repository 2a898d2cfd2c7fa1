"""relayrl's optional dependencies: each an extra of the package (``pip install 'relayrl[EXTRA]'``)."""

from __future__ import annotations

import importlib


def require(module: str, extra: str, field: str):
    """``module``, imported; else a ``ValueError`` naming the field and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{field} needs the {module!r} package ({e}): pip install 'relayrl[{extra}]'") from None
