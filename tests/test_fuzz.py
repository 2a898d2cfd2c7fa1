"""Fuzzed bad input through the command line, in-process: configs (YAML files and overrides) and
dataset files (.jsonl/.json/.parquet/folders). Every input is genuinely invalid; each must come
back as exit status 2 and one line on stderr, ``relayrl: <kind> error: ...``, naming the file,
row and field involved, with no traceback and nothing written under the run directory.

Cases are drawn from a seeded generator, so a failure reproduces; a failing case is printed with
its argv and files.
"""

from __future__ import annotations

import json
import math
import random
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from relayrl.cli import main
from relayrl.config import Config
from tests.fuzzing import parser

SEED = 20261122
MIN_CASES = 500


@dataclass
class Case:
    argv: list[str]
    needles: list[str]  # each must appear in the error line
    what: str  # for the failure report
    files: list[Path] = field(default_factory=list)


class Gen:
    """Writes the files for each case under ``root`` and returns the cases."""

    def __init__(self, root: Path, rng: random.Random):
        self.root, self.rng, self.n = root, rng, 0
        self.out = root / "runs"  # run.output_dir of every case: must never be created

    def path(self, suffix: str) -> Path:
        self.n += 1
        return self.root / f"f{self.n:04d}{suffix}"

    def write(self, suffix: str, content: bytes | str) -> Path:
        p = self.path(suffix)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        return p

    def train(self, *args: str) -> list[str]:
        return ["train", *args, f"run.output_dir={self.out}"]


# ---------------------------------------------------------------- config fields and wrong values

def _fields() -> list[tuple[str, Any]]:
    """(section.key, annotation) of every field."""
    return [(f"{sec}.{key}", f.annotation) for sec, info in Config.model_fields.items()
            for key, f in info.annotation.model_fields.items()]


def _strip_optional(ann) -> tuple[Any, bool]:
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return ann, False


def wrong_values(ann) -> list[Any]:
    """Values of the wrong type for a field annotated ``ann`` ([] for a type not handled here)."""
    ann, optional = _strip_optional(ann)
    junk = [{"a": {"b": [1, {"c": None}]}}, [[1, 2], [3]]]
    if ann is bool:
        return ["maybe", 2, 1.5, [True], *junk]
    if ann is int:
        return ["abc", 1.5, True, [1], *junk]
    if ann is float:
        return ["abc", True, float("nan"), float("inf"), [1.0], *junk]
    if ann is str:
        return [[1, 2], *junk] + ([] if optional else [None])
    if get_origin(ann) is Literal:
        return ["no-such-choice", 42, [get_args(ann)[0]], *junk]
    if get_origin(ann) is tuple:
        return ["x", [0.5], [0.5, 0.5, 0.5], *junk]
    if get_origin(ann) is list:
        return ["x", [[1]], [{"a": 1}], {"a": 1}]
    return []


def out_of_range(info) -> list[Any]:
    """Numbers just past each bound of a field (pydantic keeps ge/gt/le/lt in ``metadata``)."""
    out = []
    for m in info.metadata:
        for attr, past in (("ge", lambda b: [b - 1, b - 1000]), ("gt", lambda b: [b, b - 1]),
                           ("le", lambda b: [b + 1, b * 1000 + 1]), ("lt", lambda b: [b, b + 5])):
            bound = getattr(m, attr, None)
            if bound is not None:
                out += past(bound)
    return out


def _field_info(dotted: str):
    sec, key = dotted.split(".")
    return Config.model_fields[sec].annotation.model_fields[key]


# A valid value for a field, and override sets under which the mode/options ignore it (written
# here independently of config.APPLIES_ONLY, so that table is tested, not reused).
IGNORED = {
    "rollout.max_staleness": (3, [["run.mode=sync"], ["run.mode=periodic"], []]),
    "rollout.over_provision": (2.0, [[], ["rollout.partial=false"], ["run.mode=async", "rollout.partial=true"]]),
    "rollout.cb_num_blocks": (64, [[], ["rollout.engine=hf"]]),
    "rollout.cb_page_size": (64, [[]]),
    "rollout.cb_max_batch_tokens": (512, [[]]),
    "rollout.engine_threads": (1, [[], ["run.mode=async", "rollout.engine_process=false"],
                                   ["run.mode=periodic", "rollout.engine_process=false"]]),
    "algo.tis_cap": (3.0, [[], ["algo.offpolicy=m2po"], ["algo.offpolicy=none"]]),
    "algo.tis_level": ("sequence", [[], ["algo.offpolicy=decoupled"]]),
    "algo.m2po_tau": (0.1, [[], ["algo.offpolicy=tis"]]),
    "algo.norm_len": (64, [[], ["algo.agg=seq_mean_token_mean"]]),
    "algo.kl_estimator": ("k2", [["algo.kl_coef=0"]]),
    "model.system_prompt": ("be brief", [["data.prompt_format=raw"]]),
    "eval.size": (4, [["data.eval_path=null"]]),
    "eval.every": (1, [["data.eval_path=null"]]),
    "eval.samples": (2, [["data.eval_path=null"]]),
    "run.project": ("mine", [[], ["run.report_to=[tensorboard]"], ["run.report_to=jsonl"]]),
    "rollout.budget_min": (2, [["rollout.budget=fixed"], ["algo.advantage=reinforce_pp"]]),
    "rollout.budget_max": (12, [["rollout.budget=fixed"], ["rollout.group_size=1", "algo.advantage=reinforce_pp"]]),
    "rollout.dynamic_sampling_max": (2, [["rollout.dynamic_sampling=false"], ["algo.advantage=gae"]]),
    "data.selection_pool": (3, [[], ["data.selection=uniform"]]),
    "data.selection_forget": (0.5, [[]]),
    "data.selection_key": ("terms", [[]]),
    "data.selection_prior": (4.0, [[]]),
    "rollout.device": ("cpu", [["rollout.engine=vllm"]]),
    "serve.port": (8123, [[], ["env.name=calculator"]]),
    "serve.model_name": ("mine", [[], ["env.name=python"]]),
    "serve.max_requests": (8, [[]]),
    "trainer.share_prefix": (False, [["trainer.fsdp=true"]]),
    "rollout.weight_sync": ("file", [[], ["rollout.engine=hf-cb"]]),  # (and adapters: test_weight_sync_vllm.py)
    "rollout.sync_bucket_mb": (64, [[]]),
    "rollout.sync_timeout_s": (30.0, [["rollout.engine=hf"]]),
}
NOISE = ["trainer.lr=1e-5", "run.steps=5", "rollout.group_size=4", "run.seed=3", "rollout.top_p=0.9",
         "algo.clip_high=0.3", "trainer.warmup_steps=0", "run.progress=false"]


def _yaml_tree(pairs: list[tuple[str, Any]]) -> dict:
    tree: dict = {}
    for dotted, value in pairs:
        sec, key = dotted.split(".")
        tree.setdefault(sec, {})[key] = value
    return tree


def _as_override(dotted: str, value: Any) -> str:
    return f"{dotted}={json.dumps(value) if not isinstance(value, str) else value}"


# ---------------------------------------------------------------- config cases

def config_cases(g: Gen) -> list[Case]:
    rng, cases = g.rng, []
    # run.output_dir: every case overrides it last (so nothing is written where it should not be)
    fields = [(f, a) for f, a in _fields() if f != "run.output_dir"]

    def yaml_case(tree_or_text, needles, what):
        text = tree_or_text if isinstance(tree_or_text, (str, bytes)) else yaml.safe_dump(tree_or_text)
        p = g.write(".yaml", text)
        cases.append(Case(g.train(str(p)), [*needles], what, [p]))
        return p

    # wrong types, in a YAML file and on the command line
    for dotted, ann in fields:
        for value in wrong_values(ann):
            p = g.path(".yaml")
            p.write_text(yaml.safe_dump(_yaml_tree([(dotted, value)])))
            cases.append(Case(g.train(str(p)), [dotted, str(p)], f"wrong type in file: {dotted}={value!r}", [p]))
            if isinstance(value, float) and not math.isfinite(value):  # no JSON spelling; YAML's is .nan/.inf
                value = ".nan" if value != value else ".inf"
            if not isinstance(value, str) or _strip_optional(ann)[0] is not str:
                cases.append(Case(g.train(*rng.sample(NOISE, 2), _as_override(dotted, value)), [dotted],
                                  f"wrong type override: {dotted}={value!r}"))
    # out of range
    for dotted, _ in fields:
        for value in out_of_range(_field_info(dotted)):
            cases.append(Case(g.train(_as_override(dotted, value)), [dotted], f"out of range: {dotted}={value}"))
            if rng.random() < 0.5:
                yaml_case(_yaml_tree([(dotted, value)]), [dotted], f"out of range in file: {dotted}={value}")
    # fields the mode ignores, set explicitly
    for dotted, (value, contexts) in IGNORED.items():
        for ctx in contexts:
            for _ in range(3):
                decided = {a.split("=", 1)[0] for a in ctx}  # (noise must not undo the context: group_size=1)
                noise = [n for n in rng.sample(NOISE, rng.randint(0, 3)) if n.split("=", 1)[0] not in decided]
                if rng.random() < 0.5:
                    args = [*noise, *ctx, _as_override(dotted, value)]
                    rng.shuffle(args)
                    cases.append(Case(g.train(*args), [dotted, "only applies"], f"ignored field: {args}"))
                else:
                    pairs = [tuple(a.split("=", 1)) for a in [*noise, *ctx]]
                    tree = _yaml_tree([(k, yaml.safe_load(v)) for k, v in pairs] + [(dotted, value)])
                    yaml_case(tree, [dotted, "only applies"], f"ignored field in file: {tree}")
    # the batch is smaller than the optimiser steps asked of it
    for _ in range(15):
        pps, gs = rng.randint(1, 8), rng.randint(1, 8)
        ups = pps * gs + rng.randint(1, 20)
        cases.append(Case(g.train(f"rollout.prompts_per_step={pps}", f"rollout.group_size={gs}",
                                  f"trainer.updates_per_step={ups}"),
                          ["trainer.updates_per_step", "rollout.prompts_per_step", "rollout.group_size"],
                          f"updates_per_step={ups} > {pps}×{gs}"))
    # trackers that are none (the error lists the valid names); project names a tracker refuses
    for bad in ["tensorbord", "wandb,mlfow", "[jsonl, tb]", "WandB", "[tensorboard, null]", "[[wandb]]"]:
        cases.append(Case(g.train(f"run.report_to={bad}"), ["run.report_to", "'tensorboard'"], f"run.report_to={bad}"))
    for name in ["a/b", "x:y", "100%", "a#b", "q?", "''"]:
        cases.append(Case(g.train("run.report_to=[wandb]", f"run.project={name}"), ["run.project"],
                          f"run.project={name}"))
    # run.name that is not a plain folder name
    for name in ["a/b", "..", ".", "", "../escape", "x/../../y", "/abs", "a\\b", "nul\x00byte"]:
        cases.append(Case(g.train(f"run.name={name}"), ["run.name"], f"run.name={name!r}"))
    # unknown keys and sections
    for _ in range(25):
        dotted, _ann = rng.choice(fields)
        sec, key = dotted.split(".")
        typo = key[:1] + rng.choice("xqz") + key[1:]
        cases.append(Case(g.train(f"{sec}.{typo}=1"), [f"{sec}.{typo}"], f"unknown key {sec}.{typo}"))
        yaml_case({sec: {typo: 1}}, [f"{sec}.{typo}"], f"unknown key in file {sec}.{typo}")
        bad_sec = sec + rng.choice(["s", "_", "x"])
        cases.append(Case(g.train(f"{bad_sec}.{key}=1"), [bad_sec], f"unknown section {bad_sec}"))
        yaml_case({bad_sec: {key: 1}}, [bad_sec], f"unknown section in file {bad_sec}")
    # override syntax
    for item in ["trainer.lr", "=1", "trainer..lr=1", ".lr=1", "trainer.=1", "a.b.c=1", "trainer.lr.x=1e-5",
                 "rollout.group_size.x=4", "trainer=1", "run.mode.sync=1", "x=y=z", " . =1"]:
        cases.append(Case(g.train(item), [item.split("=")[0].strip() or "section.key"], f"override {item!r}"))
    # nested junk and non-mapping structure in files
    for sec in Config.model_fields:
        for junk in ([1, 2], "text", 3, [{"a": 1}]):
            yaml_case({sec: junk}, [str(g.root), f"'{sec}' must be a mapping"], f"section {sec} = {junk!r}")
    for top in ([1, 2], "just text", 42, 3.5, True, [{"run": {"name": "x"}}]):
        yaml_case(yaml.safe_dump(top), ["top level must be a mapping"], f"top level {top!r}")
    deep = "run:\n  name: " + "[" * 3000 + "]" * 3000 + "\n"
    p = yaml_case(deep, [], "deeply nested value")
    cases[-1].needles.append(str(p))
    # invalid YAML, binary garbage, empty files
    broken = ["run: [1, 2\n", "run:\n  name: 'open\n", "run: {a: 1\n", "run:\n\tname: x\n", "run:\n  - a\n  b: c\n",
              "a: b: c\n", "run: !!python/object:os.system x\n", "? [a]\n: b\n", "---\nrun: {}\n---\nmodel: {}\n",
              "run:\n  name: x\n   steps: 3\n", "%YAML 9.9\n---\n{}", "@\n", "`x`\n", "run: *undefined\n"]
    for text in broken:
        p = yaml_case(text, [], f"broken YAML {text!r}")
        cases[-1].needles.append(str(p))
    for _ in range(20):
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))) + b"\xff\xfe"
        p = yaml_case(garbage, [], "binary garbage")
        cases[-1].needles.append(str(p))
    for text in ["", "\n\n", "# only a comment\n", "~\n", "null\n"]:
        p = yaml_case(text, ["empty"], f"empty config {text!r}")
        cases[-1].needles.append(str(p))
    missing = g.root / "no-such-config.yaml"
    cases.append(Case(g.train(str(missing)), [str(missing)], "missing config file"))
    folder = g.root / "folder.yaml"
    folder.mkdir()
    cases.append(Case(g.train(str(folder)), [str(folder)], "config path is a folder"))
    # command-line usage
    for argv, needle in [(["frobnicate"], "frobnicate"), ([], "cmd"), (["train", "--bogus"], "--bogus"),
                         (["train", "--resume=3"], "--resume"), (["train", "notes.txt"], "notes.txt"),
                         (["train", "a.yaml", "b.yaml"], "b.yaml"), (["eval", "--checkpoint"], "--checkpoint")]:
        cases.append(Case(argv, [needle], f"usage {argv}"))
    return cases


# ---------------------------------------------------------------- dataset cases

def _row(i: int) -> dict:
    return {"id": f"r{i}", "prompt": f"Sum mod 10: a={i % 10} b=3", "answer": str((i + 3) % 10)}


def _deep(n: int) -> Any:
    x: Any = "x"
    for _ in range(n):
        x = [x]
    return x


# (what, how to break a row, the field the message must name or None); each returns the new row
ROW_BREAKS = [
    ("missing prompt", lambda r: {k: v for k, v in r.items() if k != "prompt"}, "prompt"),
    ("missing answer", lambda r: {k: v for k, v in r.items() if k != "answer"}, "answer"),
    ("prompt int", lambda r: {**r, "prompt": 7}, "prompt"),
    ("prompt float", lambda r: {**r, "prompt": 1.5}, "prompt"),
    ("prompt bool", lambda r: {**r, "prompt": False}, "prompt"),
    ("prompt null", lambda r: {**r, "prompt": None}, "prompt"),
    ("prompt dict", lambda r: {**r, "prompt": {"text": "x"}}, "prompt"),
    ("prompt empty", lambda r: {**r, "prompt": ""}, "prompt"),
    ("prompt blank", lambda r: {**r, "prompt": " \n\t "}, "prompt"),
    ("prompt empty list", lambda r: {**r, "prompt": []}, "prompt"),
    ("prompt bad role", lambda r: {**r, "prompt": [{"role": "usr", "content": "x"}]}, "prompt"),
    ("prompt no role", lambda r: {**r, "prompt": [{"content": "x"}]}, "prompt"),
    ("prompt content int", lambda r: {**r, "prompt": [{"role": "user", "content": 3}]}, "prompt"),
    ("prompt message str", lambda r: {**r, "prompt": ["hello"]}, "prompt"),
    ("prompt blank messages", lambda r: {**r, "prompt": [{"role": "user", "content": "  "}]}, "prompt"),
    ("prompt nested junk", lambda r: {**r, "prompt": _deep(50)}, "prompt"),
    ("prompt lone surrogate", lambda r: {**r, "prompt": "a\ud800b"}, "prompt"),
    ("answer dict", lambda r: {**r, "answer": {"value": 1}}, "answer"),
    ("answer list", lambda r: {**r, "answer": [1, 2]}, "answer"),
    ("answer bool", lambda r: {**r, "answer": True}, "answer"),
    ("answer lone surrogate", lambda r: {**r, "answer": "\udfff"}, "answer"),
    ("id dict", lambda r: {**r, "id": {"k": 1}}, "id"),
    ("id list", lambda r: {**r, "id": [1]}, "id"),
    ("id bool", lambda r: {**r, "id": True}, "id"),
    ("id empty", lambda r: {**r, "id": ""}, "id"),
    ("id null", lambda r: {**r, "id": None}, "id"),
    ("id float", lambda r: {**r, "id": 1.5}, "id"),
    ("duplicate id", lambda r: {**r, "id": "r0"}, "id"),
    ("row is a list", lambda r: [r["prompt"], r["answer"]], None),
    ("row is a number", lambda r: 42, None),
    ("row is a string", lambda r: "Sum mod 10: a=1", None),
    ("row is null", lambda r: None, None),
]


def _jsonl(rows: list[Any], rng: random.Random) -> tuple[str, list[int]]:
    """JSONL text with blank lines sprinkled in, and the line number of each row."""
    lines, numbers = [], []
    for r in rows:
        if rng.random() < 0.15:
            lines.append("")
        lines.append(json.dumps(r))
        numbers.append(len(lines))
    return "\n".join(lines) + "\n", numbers


def data_cases(g: Gen) -> list[Case]:
    rng, cases = g.rng, []

    def case(p: Path, needles: list[str], what: str, *extra: str):
        argv = g.train(f"data.path={p}", "data.eval_path=null", *extra)
        cases.append(Case(argv, [str(p), *needles], what, [p]))

    # one broken row among good ones, in each format
    for what, brk, fld in ROW_BREAKS:
        for fmt in (".jsonl", ".json", ".jsonl", ".json"):
            n = rng.randint(2, 30)
            bad = rng.randint(1, n - 1)  # row 0 is kept good: "duplicate id" copies its id
            rows: list[Any] = [_row(i) for i in range(n)]
            rows[bad] = brk(rows[bad])
            if fmt == ".jsonl":
                text, numbers = _jsonl(rows, rng)
                where = f"line {numbers[bad]}"
            else:
                text, where = json.dumps(rows, indent=rng.choice([None, 1])), f"row {bad + 1}"
            p = g.write(fmt, text)
            case(p, [where] + ([f"'{fld}'"] if fld else []), f"{fmt} {what} at {where}")
    # (a list-of-messages prompt with data.prompt_format=raw is left out until pipeline.load_data
    # passes prompt_format to load_prompts: tests/test_data_rewards.py covers it there)
    # a metadata field missing in one row
    rows = [{**_row(i), "src": "x"} for i in range(6)]
    del rows[4]["src"]
    p = g.write(".jsonl", "\n".join(map(json.dumps, rows)) + "\n")
    case(p, ["line 5", "'src'"], "missing metadata field", "data.metadata_fields=[src]")
    # bytes that are not UTF-8 inside a row: latin-1, raw surrogates, a cut multi-byte character
    for bad_bytes in (b"caf\xe9", b"\xed\xa0\x80", b"\xe2\x82", b"\xff", b"\xc0\xaf"):
        for fmt in (".jsonl", ".json"):
            n = rng.randint(2, 20)
            bad = rng.randrange(n)
            parts = [json.dumps(_row(i)).encode() for i in range(n)]
            parts[bad] = parts[bad].replace(b"Sum", b"Sum " + bad_bytes)
            data = b"\n".join(parts) + b"\n" if fmt == ".jsonl" else b"[\n" + b",\n".join(parts) + b"\n]"
            line = bad + 1 if fmt == ".jsonl" else bad + 2
            p = g.write(fmt, data)
            first_bad = next(b for b in bad_bytes if b > 0x7F)
            case(p, [f"line {line}", f"0x{first_bad:02x}", "UTF-8"], f"{fmt} bytes {bad_bytes!r} at line {line}")
    # byte-order marks of UTF-16/32
    for enc in ("utf-16", "utf-16-le", "utf-32"):
        for fmt in (".jsonl", ".json"):
            rows = [_row(i) for i in range(3)]
            text = _jsonl(rows, rng)[0] if fmt == ".jsonl" else json.dumps(rows)
            data = text.encode(enc)
            if not data.startswith((b"\xff\xfe", b"\xfe\xff")):
                data = b"\xff\xfe" + data
            p = g.write(fmt, data)
            case(p, ["UTF-16"], f"{fmt} in {enc}")
    # invalid JSON: truncated files, broken lines, JSONL named .json, deep nesting
    for _ in range(12):
        rows = [_row(i) for i in range(rng.randint(2, 20))]
        text, numbers = _jsonl(rows, rng)
        cut = rng.randint(text.index("\n") + 2, len(text) - 3)
        while text[cut - 1] == "\n" or text[cut] == "\n":
            cut -= 1
        p = g.write(".jsonl", text[:cut])
        case(p, [f"line {text[:cut].count(chr(10)) + 1}", "invalid JSON"], "truncated .jsonl")
        full = json.dumps(rows)
        p = g.write(".json", full[: rng.randint(1, len(full) - 1)])
        case(p, ["invalid JSON at line 1"], "truncated .json")
    for bad_line in ['{"prompt": "a", "answer": }', "{'prompt': 'a'}", "{prompt: a}", "[1, 2", '"unterminated',
                     "NaN-ish", '{"prompt": "a"} trailing']:
        rows = [json.dumps(_row(i)) for i in range(4)] + [bad_line]
        rng.shuffle(rows)
        p = g.write(".jsonl", "\n".join(rows) + "\n")
        case(p, [f"line {rows.index(bad_line) + 1}", "invalid JSON"], f"bad JSONL line {bad_line!r}")
    p = g.write(".json", "\n".join(json.dumps(_row(i)) for i in range(3)))
    case(p, ["invalid JSON at line 2", ".jsonl"], "JSONL content in .json")
    for depth in (2000, 100_000):
        p = g.write(".jsonl", json.dumps(_row(0)) + "\n" + "[" * depth + "]" * depth + "\n")
        case(p, ["line 2"], f"nesting {depth} deep in .jsonl")
        p = g.write(".json", "[" * depth + "]" * depth)
        case(p, [], f"nesting {depth} deep in .json")
    for top in ({"prompt": ["a"], "answer": ["1"]}, 42, "rows", None):
        p = g.write(".json", json.dumps(top))
        case(p, ["list of rows"], f".json top level {top!r}")
    # empty files
    for fmt, text in ((".jsonl", ""), (".jsonl", "\n\n  \n"), (".json", ""), (".json", "[]"), (".json", "  ")):
        p = g.write(fmt, text)
        case(p, [], f"empty {fmt} {text!r}")
    # huge rows: a prompt far over the model's context (caught by the prompt-length check)
    for size in (5_000_000, 1_000_000, 300_000):
        rows = [_row(i) for i in range(3)]
        bad = rng.randrange(3)
        rows[bad]["prompt"] = "Sum mod 10: a=3 b=4 " * (size // 20)
        fmt = rng.choice([".jsonl", ".json"])
        text = _jsonl(rows, random.Random(0))[0] if fmt == ".jsonl" else json.dumps(rows)
        p = g.write(fmt, text)
        case(p, [f"prompt id 'r{bad}'", "'prompt'", "tokens"], f"huge prompt of {size} bytes")
    parquet_cases(g, case)
    # not a dataset at all
    for suffix in (".csv", ".txt", ".jsonl.gz", ""):
        p = g.write(suffix, "prompt,answer\na,1\n")
        case(p, ["unsupported dataset format"], f"unsupported {suffix!r}")
    missing = g.root / "no-such-data.jsonl"
    cases.append(Case(g.train(f"data.path={missing}", "data.eval_path=null"), [str(missing)], "missing dataset"))
    cases.append(Case(g.train("data.path=builtin:nope", "data.eval_path=null"), ["builtin:nope"], "unknown builtin"))
    return cases


def parquet_cases(g: Gen, case) -> None:
    """Parquet files and datasets folders, added through ``case``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = g.rng

    def table(rows, p):
        pq.write_table(pa.Table.from_pylist(rows), p)
        return p

    for what, change, fld in [
        ("empty prompt", lambda r: {**r, "prompt": ""}, "prompt"),
        ("null prompt", lambda r: {**r, "prompt": None}, "prompt"),
        ("blank prompt", lambda r: {**r, "prompt": "   "}, "prompt"),
        ("null id", lambda r: {**r, "id": None}, "id"),
        ("duplicate id", lambda r: {**r, "id": "r0"}, "id"),
        ("empty id", lambda r: {**r, "id": ""}, "id"),
    ]:
        for _ in range(3):
            n = rng.randint(2, 40)
            bad = rng.randint(1, n - 1)
            rows = [_row(i) for i in range(n)]
            rows[bad] = change(rows[bad])
            case(table(rows, g.path(".parquet")), [f"row {bad + 1}", f"'{fld}'"], f"parquet {what} at row {bad + 1}")
    for what, rows, needles in [
        ("no prompt column", [{"q": "x", "answer": "1"}], ["row 1", "'prompt'"]),
        ("no answer column", [{"prompt": "x"}], ["row 1", "'answer'"]),
        ("answer struct", [{"prompt": "x", "answer": {"v": 1}}], ["row 1", "'answer'"]),
        ("answer list", [{"prompt": "x", "answer": [1, 2]}], ["row 1", "'answer'"]),
        ("prompt int", [{"prompt": 3, "answer": "1"}], ["row 1", "'prompt'"]),
        ("bad role", [{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}], ["row 1", "'prompt'"]),
        ("no rows", [], ["no rows"]),
    ]:
        p = g.path(".parquet")
        if rows:
            table(rows, p)
        else:
            pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), p)
        case(p, needles, f"parquet {what}")
    good = table([_row(i) for i in range(200)], g.path(".parquet")).read_bytes()
    for _ in range(15):
        cut = rng.randint(0, len(good) - 1)
        case(g.write(".parquet", good[:cut]), ["not a readable Parquet file"], f"parquet cut at {cut}")
    for _ in range(8):
        junk = bytearray(good)
        for _ in range(rng.randint(4, 40)):  # scribble over the footer (schema, offsets)
            junk[rng.randrange(len(junk) - 200, len(junk) - 8)] = rng.randrange(256)
        junk[-4:] = b"PAR1"
        junk[-8:-4] = rng.randrange(2**31).to_bytes(4, "little")  # a footer length that cannot be right
        case(g.write(".parquet", bytes(junk)), ["not a readable Parquet file"], "parquet with a scribbled footer")
    case(g.write(".parquet", b"PAR1" + bytes(rng.randrange(256) for _ in range(100)) + b"PAR1"),
         ["not a readable Parquet file"], "parquet of random bytes")
    case(g.write(".parquet", json.dumps([_row(0)])), ["not a readable Parquet file"], "JSON named .parquet")
    # datasets folders: empty, junk metadata, a saved dataset with its arrow file cut short
    import datasets

    empty = g.root / "ds-empty"
    empty.mkdir()
    case(empty, ["not a readable datasets folder"], "empty folder")
    junk = g.root / "ds-junk"
    junk.mkdir()
    (junk / "dataset_info.json").write_text("{")
    (junk / "state.json").write_text("[1, 2]")
    case(junk, ["not a readable datasets folder"], "folder with junk metadata")
    saved = g.root / "ds-cut"
    datasets.Dataset.from_list([_row(i) for i in range(500)]).save_to_disk(str(saved))
    for arrow in saved.glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:300])
    case(saved, ["not a readable datasets folder"], "datasets folder with a truncated arrow file")


# ---------------------------------------------------------------- the run

def _stand_in_for_build(cfg, state, ckpt, data, log):
    """Replaces pipeline.build: no fuzz case may get as far as loading a model. It first runs the
    check pipeline.build is to run after loading the tokenizer (prompts longer than the model's
    context), which is what catches the huge rows."""
    from relayrl.models import load_tokenizer, resolve_model_path
    from relayrl.data.lengths import check_prompt_lengths
    from relayrl.models.prompts import model_context

    path = resolve_model_path(cfg.model.path)
    tok = _TOKENIZERS.get(path) or _TOKENIZERS.setdefault(path, load_tokenizer(path, cfg.data.prompt_format))
    limit = model_context(path) - cfg.rollout.max_new_tokens
    check_prompt_lengths(data[0], tok, limit, cfg.data.prompt_format, source=cfg.data.path)
    raise ReachedModelLoading()


class ReachedModelLoading(Exception):
    pass


_TOKENIZERS: dict = {}


def test_fuzzed_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import relayrl.run.loop

    monkeypatch.setattr(relayrl.run.loop, "build", _stand_in_for_build)
    monkeypatch.setattr("relayrl.cli._parser", parser())  # (built once: building it is most of a case's time)
    g = Gen(tmp_path, random.Random(SEED))
    cases = config_cases(g) + data_cases(g)
    capsys.readouterr()  # what writing the files printed (datasets' save_to_disk progress)
    failures = []
    t0 = time.perf_counter()
    for c in cases:
        try:
            code = main(c.argv)
        except ReachedModelLoading:
            code = "valid input: it reached model loading"
        out = capsys.readouterr()
        lines = out.err.split("\n")
        problems = [
            f"exit status {code}" if code != 2 else "",
            "stderr is not one line" if len(lines) != 2 or lines[1] != "" or len(out.err.splitlines()) != 1 else "",
            "no 'relayrl: ' prefix" if not out.err.startswith("relayrl: ") else "",
            "a traceback" if "Traceback" in out.err + out.out else "",
            f"does not name {[n for n in c.needles if n not in out.err]}" if any(n not in out.err for n in c.needles)
            else "",
            "wrote the run directory" if g.out.exists() else "",
        ]
        if any(problems):
            failures.append(f"{c.what}: {'; '.join(x for x in problems if x)}\n  argv={c.argv!r:.300}\n"
                            f"  stderr={out.err[:500]!r}")
    elapsed = time.perf_counter() - t0
    print(f"\nfuzz: {len(cases)} bad inputs tried in {elapsed:.1f}s, {len(failures)} mishandled")
    print("\n".join(failures))
    assert not failures, f"{len(failures)} of {len(cases)} mishandled:\n" + "\n".join(failures[:15])
    assert len(cases) >= MIN_CASES
