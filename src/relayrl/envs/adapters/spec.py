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
        except (yaml.YAMLError, ValueError, RecursionError):  # (not YAML; `!!int x`, 5,000 digits; [[[...]]])
            args[key] = value
    return name, args


MAX_SIZE = 100_000  # rows generated at start, all kept in memory: more is not a run's data, it is a stall


def count_arg(args: dict, key: str, default: int, spec: str, field: str, low: int, high: int) -> int:
    """``args[key]`` (removed from ``args``) as an integer in [low, high], else one line naming the spec and key."""
    value = args.pop(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}={spec!r:.200}: {key} must be an integer, got {type(value).__name__} "
                         f"{str(value)[:40]!r}")
    if not low <= value <= high:
        raise ValueError(f"{field}={spec!r:.200}: {key}={value} is out of range ({low}..{high:,})")
    return value
