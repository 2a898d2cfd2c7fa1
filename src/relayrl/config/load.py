"""Loading the configuration: YAML, dotted overrides, clear errors that name the key and where it
was set; the resolved tree a run records, and the ``--help`` text.
"""

from __future__ import annotations

import difflib
import reprlib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from relayrl.config import aliases
from relayrl.config.rules import APPLIES_ONLY
from relayrl.config.schema import Config
from relayrl.config.sections import ConfigError
from relayrl.config.yaml_input import load_yaml, read_config_bytes
from relayrl.failures import one_line


def _subsection(info) -> type | None:
    """The section class of a field that is a section of its own (model.lora), else None."""
    a = info.annotation
    return a if isinstance(a, type) and issubclass(a, BaseModel) else None


def _check_keys(tree: dict, source: str) -> None:
    """Reject unknown sections/fields with the valid choices (before pydantic, for clearer errors)."""
    sections = Config.model_fields
    for sec, body in tree.items():
        if sec not in sections:
            near = difflib.get_close_matches(str(sec), sections, n=1)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{source}: unknown section {str(sec)!r:.80}.{hint} Valid sections: {', '.join(sections)}")
        _check_body(sec, body, sections[sec].annotation, source)


def _check_body(name: str, body: Any, cls: type, source: str) -> None:
    if not isinstance(body, dict):
        raise ConfigError(f"{source}: '{name}' must be a mapping of fields, got {type(body).__name__}")
    fields = cls.model_fields
    for key in body:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" Did you mean '{name}.{near[0]}'?" if near else ""
            raise ConfigError(
                f"{source}: unknown key '{name}.{str(key):.80}'.{hint} Valid keys in '{name}': {', '.join(fields)}"
            )
        sub = _subsection(fields[key])
        if sub is not None:
            _check_body(f"{name}.{key}", body[key], sub, source)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r:.80} must look like section.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"override key {key!r:.80} must be section.key (two levels, or three in a section's own "
                          "section: model.lora.r), e.g. trainer.lr=1e-5")
    if raw == "":
        return parts, ""
    try:
        value, _ = load_yaml(raw, "command line", tuple(parts), lines=False)  # (refuses what would crash later)
    except yaml.YAMLError:
        value = raw  # not YAML (`run.name=a: b`): the text as written
    if isinstance(value, str):  # (argv's undecodable bytes arrive as lone surrogates, which YAML cannot read)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"command line: '{'.'.join(parts)[:80]}': invalid Unicode: a lone surrogate at character "
                              f"{e.start + 1} (no tokenizer or file can take it)") from None
    return parts, value


def _nest(parts: list[str], value: Any) -> dict:
    """``[a, b, c], v`` → ``{a: {b: {c: v}}}``."""
    for part in reversed(parts):
        value = {part: value}
    return value


def _merge(into: dict, tree: dict, path: tuple = ()) -> None:
    """``tree`` over ``into``, section by section and into a section's own sections (model.lora); any
    other value (a mapping such as env.args included) replaces the one before."""
    for key, value in tree.items():
        where = (*path, key)
        if isinstance(value, dict) and isinstance(into.get(key), dict) and (not path or _subsection(_field_info(where))):
            _merge(into[key], value, where)
        else:
            into[key] = value


def _leaves(tree: dict, prefix: tuple = ()) -> list[tuple]:
    """The (section, field[, field]) path of every value of ``tree``."""
    out = []
    for key, value in tree.items():
        section = not prefix or _subsection(_field_info((*prefix, key)))  # (a section, or a section's own section)
        out += _leaves(value, (*prefix, key)) if isinstance(value, dict) and section else [(*prefix, key)]
    return out


def _field_info(path: tuple):
    cls, info = Config, None
    for part in path:
        info = cls.model_fields[part]
        cls = info.annotation
    return info


def _yaml_problem(e: yaml.YAMLError) -> str:
    """' at line L column C: problem' (PyYAML's own text quotes the source over several lines)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    if mark is None or problem is None:
        return f": {one_line(e)}"
    context = getattr(e, "context", None)
    return f" at line {mark.line + 1} column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def _read_yaml(p: Path) -> tuple[dict, dict[tuple[str, str], str]]:
    """The file's sections, and the text of every scalar as written (see ``_coerce``)."""
    data = read_config_bytes(p)  # (a regular file, of a config's size)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    try:
        tree, node = load_yaml(text, str(p))  # (parsed once; depth, aliases, duplicate keys, values checked)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML{_yaml_problem(e)}") from None
    if tree is None:
        raise ConfigError(f"{p}: the config file is empty (no sections)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(tree).__name__}")
    tree = aliases.tree(tree, str(p))  # (TRL's names at the top: learning_rate, beta, ...)
    tree = {sec: {} if body is None else body for sec, body in tree.items()}  # `run:` with nothing under it
    _check_keys(tree, str(p))
    texts: dict[tuple, str] = {}

    def scalars(node, path: tuple) -> None:
        for k, v in node.value:
            if isinstance(v, yaml.ScalarNode):
                texts[(*path, k.value)] = v.value
            elif isinstance(v, yaml.MappingNode) and path:  # a section's own section (model.lora)
                scalars(v, (*path, k.value))

    for sec, body in node.value:
        if isinstance(body, yaml.MappingNode):
            scalars(body, (sec.value,))
    return tree, texts


def _scalar_type(annotation) -> type | None:
    """str, int or float for a field of that type (or that type | None); else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if annotation in (str, int, float) else None


def _coerce(tree: dict, texts: dict[tuple, str], origin: dict[tuple, str], path: tuple = ()) -> None:
    """YAML types values before we know the field: `run.name=2024` would arrive as an int. A string
    field keeps the value's text as written (`1e3` stays "1e3", `007` stays "007"); a number field
    refuses a bool (pydantic would take `true` as 1)."""
    for key, value in tree.items():
        where = (*path, key)
        if not path:
            _coerce(value, texts, origin, where)
            continue
        info = _field_info(where)
        if _subsection(info) is not None and isinstance(value, dict):
            _coerce(value, texts, origin, where)
            continue
        kind = _scalar_type(info.annotation)
        if kind is str and value is not None and not isinstance(value, (str, list, dict)):
            tree[key] = texts.get(where, str(value))
        elif kind in (int, float) and isinstance(value, bool):
            raise ConfigError(f"{origin.get(where, 'command line')}: {'.'.join(where)} must be a number, got {value!r}")


def _describe(err: dict, origin: dict[tuple[str, str], str]) -> str:
    loc = [str(x) for x in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if len(loc) < 2:  # a section's or the whole config's own check: its message names the fields
        return msg
    where = origin.get(tuple(loc[:3])) or origin.get(tuple(loc[:2]))
    return f"{'.'.join(loc)}: {msg} (got {_short(err.get('input'))}{', from ' + where if where else ''})"


def _short(value: Any) -> str:
    """A value as the message quotes it, bounded however large or deep it is (``!r:.80`` would build the whole
    repr first)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 80, 80, 6, 6
    try:
        return r.repr(value)[:120]
    except Exception:  # noqa: BLE001 - an int past Python's repr limit; a value's own __repr__ that raises
        return f"<{type(value).__name__}>"


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None,
                base_source: str = "") -> Config:
    """defaults < ``base`` (a recorded config: ``recorded_tree``, from ``base_source``) < the YAML file at
    ``path`` < ``overrides``."""
    import copy

    tree: dict = copy.deepcopy(base or {})
    texts: dict[tuple, str] = {}
    origin = {leaf: base_source for leaf in _leaves(tree)}
    if path is not None:
        file_tree, texts = _read_yaml(Path(path))
        _merge(tree, file_tree)
        origin.update({leaf: str(path) for leaf in _leaves(file_tree)})
    for item in map(aliases.override, overrides):
        parts, value = parse_override(item)
        key = ".".join(parts)
        fields = Config.model_fields[parts[0]].annotation.model_fields if parts[0] in Config.model_fields else {}
        if len(parts) == 3 and parts[1] in fields and not _subsection(fields[parts[1]]):
            raise ConfigError(f"override key {key!r:.80}: {parts[0]}.{parts[1]} is a field, not a section of its own "
                              f"(three levels only for those, e.g. model.lora.r=8); set {parts[0]}.{parts[1]}=VALUE")
        _check_keys(_nest(parts, value), f"command line ({key})")
        _merge(tree, _nest(parts, value))
        texts[tuple(parts)], origin[tuple(parts)] = item.split("=", 1)[1].strip(), "command line"
    _coerce(tree, texts, origin)
    try:
        return Config.model_validate(_without_moot(tree, origin))
    except ValidationError as e:
        raise ConfigError("invalid configuration: " + "; ".join(_describe(x, origin) for x in e.errors())) from None


def _without_moot(tree: dict, origin: dict[tuple, str]) -> dict:
    """``tree`` less the fields a file (or a recorded config) set that the command line's choices leave without
    effect (``APPLIES_ONLY``; ``relayrl train examples/agent_demo.yaml data.eval_path=null``: the file's
    eval.size): the check refuses a field set where it does nothing, and one the user cannot unset from the
    command line is not theirs to remove. A field the command line set itself is still refused."""
    import copy

    said = {leaf for leaf, where in origin.items() if where == "command line"}
    moot = [leaf for field, (_, _, deciding) in APPLIES_ONLY.items()
            if (leaf := tuple(field.split("."))) in origin and leaf not in said
            and any(tuple(d.split(".")) in said for d in deciding)]
    if not moot:
        return tree

    def drop(leaves) -> dict:
        out = copy.deepcopy(tree)
        for leaf in leaves:
            body = out
            for part in leaf[:-1]:
                body = body.get(part) if isinstance(body, dict) else None
            if isinstance(body, dict):
                body.pop(leaf[-1], None)
        return out

    try:
        cfg = Config.model_validate(drop(moot))
    except ValidationError:  # (the whole tree's validation names what is wrong)
        return tree
    return drop([leaf for leaf in moot if not APPLIES_ONLY[".".join(leaf)][0](cfg)])


def recorded_tree(dump: dict) -> dict:
    """A recorded config (``Config.model_dump``, what a checkpoint's state.json holds) as a tree for
    ``load_config(base=...)``: the values that differ from the defaults. A field the recorded
    configuration ignores held its default (``load_config`` refuses one set), so what is left loads
    back without tripping that check; a section or field this version does not have is left out."""
    defaults = Config().model_dump(mode="json")
    tree: dict = {}
    for sec, body in dump.items():
        if sec in defaults and isinstance(body, dict):
            for key, value in body.items():
                if key not in defaults[sec] or value == defaults[sec][key]:
                    continue
                default = defaults[sec][key]
                kind = Config.model_fields[sec].annotation.model_fields[key].annotation
                if isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, BaseModel):  # model.lora
                    sub = {k: v for k, v in value.items() if k in default and v != default[k]}
                    if sub:  # (a field it did not have, newer than it, keeps its default)
                        tree.setdefault(sec, {})[key] = sub
                else:
                    tree.setdefault(sec, {})[key] = value
    return tree


def resolved_tree(cfg: Config) -> dict:
    """The resolved config as plain data (section -> field -> value), without the fields the
    configuration ignores: what config.yaml holds and the trackers get as the run's parameters."""
    tree = cfg.model_dump(mode="json")
    for field, (applies, _, _) in APPLIES_ONLY.items():
        if not applies(cfg):
            *path, key = field.split(".")
            body = tree
            for part in path:
                body = body[part]
            del body[key]
    return tree


def dump_config(cfg: Config, path: Path) -> None:
    """The resolved config; fields the configuration ignores are left out, so the file loads back
    (``relayrl train runs/<name>/config.yaml``) without tripping the check on them."""
    path.write_text(yaml.safe_dump(resolved_tree(cfg), sort_keys=False))


def describe(only: set[str] | None = None) -> str:
    """Every field with type, default and doc: the body of ``--help``; with ``only``, the sections and
    ``section.field``s it names."""
    out = []
    for sec, info in Config.model_fields.items():
        cls = info.annotation
        fields = [(n, f) for n, f in nested_fields(cls) if only is None or sec in only or f"{sec}.{n}" in only]
        if fields:
            out.append(f"{sec}:  {(cls.__doc__ or '').strip()}")
        for name, f in fields:
            default = f.default_factory() if f.default_factory else f.default
            if get_origin(f.annotation) is Literal:
                typ = "one of " + "|".join(map(str, get_args(f.annotation)))
            elif get_origin(f.annotation) is list and get_origin(get_args(f.annotation)[0]) is Literal:
                typ = "a list of " + "|".join(map(str, get_args(get_args(f.annotation)[0])))
            elif get_origin(f.annotation) in (Union, types.UnionType) and any(
                    get_origin(a) is Literal for a in get_args(f.annotation)):  # ('all-linear' or list[str])
                typ = " or ".join(", ".join(map(repr, get_args(a))) if get_origin(a) is Literal else
                                  str(a).replace("typing.", "") for a in get_args(f.annotation))
            else:
                typ = getattr(f.annotation, "__name__", None) or str(f.annotation).replace("typing.", "")
            out.append(f"  {sec}.{name} ({typ}, default {default!r})\n      {f.description}")
    return "\n".join(out)



def nested_fields(cls: type) -> list[tuple[str, Any]]:
    """(name, pydantic FieldInfo) of a section's fields, a section of its own (model.lora) by its fields
    (``lora.r``, ...): what the user sets."""
    out = []
    for name, f in cls.model_fields.items():
        sub = _subsection(f)
        out += [(f"{name}.{n}", g) for n, g in nested_fields(sub)] if sub is not None else [(name, f)]
    return out
