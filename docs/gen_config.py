"""The configuration reference, generated from the schema when the site is built.

mkdocs runs this file as a hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds the page
``reference/config.md``, written from ``relayrl.config.Config`` (every section, every field: its type,
range, default and description) and ``relayrl.config.APPLIES_ONLY`` (where a field applies, and the
fields that decide it). Nothing is written to disk, so the page cannot drift from the code;
``tests/test_docs.py`` checks it lists every field. ``python docs/gen_config.py`` prints the page.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:  # the site builds from a checkout with or without `pip install -e .`
    sys.path.insert(0, str(SRC))

PAGE = "reference/config.md"

HEADER = """# Configuration reference

Generated from the schema (`relayrl.config.Config`, fields in `src/relayrl/config/sections.py`, `training.py` and `teachers.py`, rules in
`src/relayrl/config/rules.py`) each time the site is built: it lists every field there is.

One typed, validated config, two levels deep (`section.key`; a section's own section, `model.lora`, three). Load order: defaults < a YAML file <
dotted command-line overrides (`relayrl train my.yaml trainer.lr=1e-5`). A misspelled key, a wrong
type, a value out of range, or a field set where the chosen mode or engine ignores it (the
**Applies** line below) fails before any work starts, one line naming the field, exit status 2. A field a
YAML file sets that a command-line override leaves without effect is dropped instead
(`relayrl train examples/agent_demo.yaml data.eval_path=null`: the file's `eval.size`): it cannot be unset
from the command line.
`relayrl train --help` prints the same fields in the terminal.
"""


def type_name(annotation: Any) -> str:
    """The field's type in words: ``one of a|b``, ``int or null``, ``a list of ...``."""
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + " | ".join(f"`{a}`" for a in get_args(annotation))
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        return "a list of " + type_name(item)
    if origin is dict:
        return "a mapping"
    if origin is Union or (origin is not None and type(annotation).__name__ == "UnionType"):
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        return " or ".join(type_name(a) for a in args) + (" or `null`" if nullable else "")
    if type(annotation).__name__ == "UnionType":  # X | Y
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        return " or ".join(type_name(a) for a in args) + (" or `null`" if nullable else "")
    if annotation is Any:
        return "any"
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def default_of(info) -> Any:
    return info.default_factory() if info.default_factory else info.default


def show(value: Any) -> str:
    """A value as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" else value
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def bounds(info) -> str:
    """The field's range from its constraints (``ge=1`` → ``≥ 1``)."""
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
    out = []
    for m in info.metadata:
        for attr, sign in marks.items():
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {v}")
    return ", ".join(out)


def escape(text: str) -> str:
    """Plain text into Markdown: no HTML tags (``<run dir>``), no emphasis from ``*``."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")


def first_sentence(doc: str | None) -> str:
    text = " ".join(line.strip() for line in (doc or "").strip().splitlines())
    return text.split(". ")[0].rstrip(".") + "."


def fields() -> list[tuple[str, str, Any]]:
    """(section, name, pydantic FieldInfo) for every field of every section, in the schema's order."""
    from relayrl.config import Config
    from relayrl.config.load import nested_fields

    return [(sec, name, f) for sec, info in Config.model_fields.items() for name, f in nested_fields(info.annotation)]


def config_reference() -> str:
    """The whole page, Markdown."""
    from relayrl.config import APPLIES_ONLY, Config
    from relayrl.config.load import nested_fields

    out = [HEADER, "## Sections\n"]
    out += [f"- [`{sec}`](#{sec}): {escape(first_sentence(info.annotation.__doc__))}"
            for sec, info in Config.model_fields.items()]
    for sec, info in Config.model_fields.items():
        cls = info.annotation
        doc = " ".join(line.strip() for line in (cls.__doc__ or "").strip().splitlines())
        out.append(f"\n## `{sec}` {{ #{sec} }}\n\n{escape(doc)}\n")
        for name, f in nested_fields(cls):  # (a section's own section by its fields: model.lora.r)
            key = f"{sec}.{name}"
            line = f"**Type** {type_name(f.annotation)}"
            if bounds(f):
                line += f" ({bounds(f)})"
            line += f" · **Default** `{show(default_of(f))}`"
            if key in APPLIES_ONLY:
                _, when, deciding = APPLIES_ONLY[key]
                applies = (f"**Applies** only {escape(when)}; decided by "
                           + ", ".join(f"[`{d}`](#{d.replace('.', '-')})" for d in deciding)
                           + ". Set elsewhere, it is a config error.")
            else:
                applies = "**Applies** everywhere: no mode or engine ignores it."
            out.append(f"### `{key}` {{ #{key.replace('.', '-')} }}\n\n{line}  \n{applies}\n\n"
                       f"{escape(f.description or '')}\n")
    return "\n".join(out)


def on_files(files, config):
    """mkdocs hook: add the generated page to the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=config_reference()))
    return files


if __name__ == "__main__":
    print(config_reference())
