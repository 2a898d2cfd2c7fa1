"""YAML from a config file or a ``section.key=value`` override, read once and checked before any value is
built: what would otherwise crash, hang or eat the machine is refused in one line naming the key.

- Size: a config file holds settings, not data (``MAX_BYTES``); only regular files are read (a FIFO would
  block forever, a link to /dev/zero would fill memory).
- Shape: nesting deeper than ``MAX_DEPTH``, an alias inside its own anchor (a value that contains itself:
  every later ``deepcopy``, ``model_dump`` and JSON write recurses forever) and aliases that repeat aliases
  (a few hundred characters expand to billions of values: the "billion laughs") are refused on the composed
  node graph, before construction, so nothing is ever expanded.
- Values: each scalar is built alone, so a tag that cannot read its text (``!!int abc``), an integer past
  Python's 4,300 digits, an unknown tag or a lone surrogate (``"\\ud800"``, which no tokenizer or file
  takes) names its key and line.
- Duplicate keys: PyYAML keeps the last silently; a setting written twice is refused with both lines.

The pure-Python loader, not libyaml's: libyaml's composer recurses in C and segfaults on deep nesting
(100,000 levels), where Python's raises RecursionError; the size limit keeps its speed irrelevant.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from relayrl.config.sections import ConfigError

MAX_BYTES = 1 << 20  # a config file: settings, never data (data.path is for that)
MAX_DEPTH = 64  # levels below the top; a section's field holding a nested env.args is 3 or 4
MAX_VALUES = 100_000  # values a file expands to, aliases counted every time they are used
_COLLECTION_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "set", "omap", "pairs")}


def read_config_bytes(p: Path) -> bytes:
    """The bytes of config file ``p``: a regular file of at most ``MAX_BYTES``."""
    try:
        st = os.stat(p)  # (follows a link: a link to /dev/zero is a device)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{p}: cannot read the config file: it is a folder")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p}: cannot read the config file: not a regular file (a FIFO, socket or device would "
                          "block or never end)")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # (a file that grows while read stops here too)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{p}: the config file is larger than {MAX_BYTES >> 20} MiB: a config holds settings "
                          "(rows of data go in a file named by data.path)")
    return data


def load_yaml(text: str, where: str, prefix: tuple = (), lines: bool = True) -> tuple[Any, yaml.Node | None]:
    """(value, root node) of ``text``; ``where`` names the source in messages ("cfg.yaml", "command line"),
    ``prefix`` the key the text is the value of (an override's ``section.key``), ``lines``: whether a line
    number means anything to the user (a file's does, an override's does not). Syntax errors are
    ``yaml.YAMLError`` (the caller says how); everything else is a ``ConfigError`` naming the key."""
    if _bracket_depth(text) > 4 * MAX_DEPTH:  # (PyYAML's scanner is quadratic in flow depth: 3,000 '[' take 4 s)
        raise ConfigError(f"{where}: {_key(prefix) + ': ' if prefix else ''}nested too deeply (more than "
                          f"{MAX_DEPTH} levels)")
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{where}: {_key(prefix) + ': ' if prefix else ''}nested too deeply (more than "
                              f"{MAX_DEPTH} levels)") from None
        if node is None:
            return None, None
        walk = _Walk(loader, where, lines)
        walk.size(node, prefix)
        try:
            return loader.construct_document(node), node
        except Exception as e:  # noqa: BLE001 - (every scalar was built above) whatever PyYAML raises, named
            raise ConfigError(f"{where}{walk.at(node)}: {_key(prefix) or 'the value'} cannot be read: "
                              f"{_why(e)}") from None
    finally:
        loader.dispose()


class _Walk:
    """One pass over the composed node graph: values counted with their aliases (memoised per node, so a
    bomb costs its few nodes, not its expansion), depth, cycles, duplicate keys, every scalar built."""

    def __init__(self, loader: yaml.SafeLoader, where: str, lines: bool):
        self.loader, self.where, self.lines = loader, where, lines
        self.sizes: dict[int, int] = {}
        self.open: set[int] = set()

    def size(self, node: yaml.Node, path: tuple) -> int:
        if id(node) in self.sizes:
            return self.sizes[id(node)]
        here = f"{self.where}{self.at(node)}"
        if id(node) in self.open:
            raise ConfigError(f"{here}: '{_key(path)}' contains itself (a YAML alias inside its own anchor): a value "
                              "must be finite")
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"{here}: '{_key(path[:4])}...' is nested deeper than {MAX_DEPTH} levels")
        self.open.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            self._scalar(node, path)
            n = 1
        elif node.tag not in _COLLECTION_TAGS:
            raise ConfigError(f"{here}: '{_key(path)}' has the tag {node.tag!r:.80}, which a config cannot use")
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(self.size(child, (*path, i)) for i, child in enumerate(node.value))
        else:
            n = 1 + self._mapping(node, path)
        self.open.discard(id(node))
        self.sizes[id(node)] = n
        if n > MAX_VALUES:
            raise ConfigError(f"{here}: '{_key(path) or 'the file'}' expands to more than {MAX_VALUES:,} values "
                              "(aliases that repeat aliases?): a config holds settings")
        return n

    def _mapping(self, node: yaml.MappingNode, path: tuple) -> int:
        n, seen = 0, {}
        for k, v in node.value:
            if k.tag == "tag:yaml.org,2002:merge":  # (`<<: *base`: keys set after it override, as YAML says)
                n += self.size(v, path)
                continue
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            n += self.size(k, path)
            inner = (*path, name if name is not None else "?")
            if name is not None and name in seen:
                raise ConfigError(f"{self.where}: '{_key(inner)}' is set twice{self._lines(seen[name], k)}: YAML would "
                                  "keep the last silently; remove one")
            if name is not None:
                seen[name] = k.start_mark.line + 1
            n += self.size(v, inner)
        return n

    def at(self, node: yaml.Node) -> str:
        return f": line {node.start_mark.line + 1}" if self.lines and node.start_mark is not None else ""

    def _lines(self, first: int, k: yaml.Node) -> str:
        return f" (lines {first} and {k.start_mark.line + 1})" if self.lines else ""

    def _scalar(self, node: yaml.ScalarNode, path: tuple) -> None:
        """Built now, alone (construct_document reuses it), so a value that cannot be read names its key."""
        try:
            value = self.loader.construct_object(node)
        except Exception as e:  # noqa: BLE001 - PyYAML's constructors raise anything (`!!timestamp x`: AttributeError)
            shown = f"{node.tag.replace('tag:yaml.org,2002:', '!!')} {node.value[:40]!r}" + (
                "…" if len(node.value) > 40 else "")
            raise ConfigError(f"{self.where}{self.at(node)}: '{_key(path) or 'the value'}': cannot read {shown}: "
                              f"{_why(e)}") from None
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{self.where}{self.at(node)}: '{_key(path) or 'the value'}': invalid Unicode: a lone "
                                  f"surrogate at character {e.start + 1} (no tokenizer or file can take it)") from None


_BRACKETS = re.compile(r"[\[\]{}]")


def _bracket_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest, counted without reading the YAML (a bracket in a quoted string counts too:
    only a depth no config reaches is refused on it)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _key(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{str(p)[:80]}" for p in path).lstrip(".")


def _why(e: BaseException) -> str:
    problem = getattr(e, "problem", None)
    text = problem if isinstance(problem, str) else str(e)
    return " ".join(text.split())[:200] or type(e).__name__
