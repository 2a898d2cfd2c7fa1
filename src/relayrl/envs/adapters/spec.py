"""The one-line form of an adapter's task: ``prefix:NAME?key=value&...``."""

from __future__ import annotations

from urllib.parse import parse_qsl

import yaml


def parse_spec(spec: str, field: str) -> tuple[str, dict]:
    """``prefix:NAME?key=value&...`` → (NAME, {key: value}), values read as YAML scalars (numbers, bools)."""
    _, _, rest = spec.partition(":")
    name, _, query = rest.partition("?")
    if not name:
        raise ValueError(f"{field}={spec!r}: name the task after the prefix, e.g. {spec.split(':')[0]}:NAME")
    args = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        try:
            args[key] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            args[key] = value
    return name, args
