"""``relayrl train|eval [CONFIG.yaml] [section.key=value ...]``."""

from __future__ import annotations

import argparse
import json
import sys

from relayrl.config import ConfigError, describe, load_config

USAGE_NOTE = """\
Configuration: defaults < CONFIG.yaml < section.key=value overrides (YAML syntax for values).
With no arguments, `relayrl train` runs the built-in demo (chained addition, tiny model, CPU).

Fields:
"""


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for a in args:
        if "=" not in a and config is None and a.endswith((".yaml", ".yml")):
            config = a
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(f"unexpected argument {a!r}: expected CONFIG.yaml or section.key=value")
    return config, overrides


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="relayrl", description="RL post-training where the rollout never stalls.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a policy", formatter_class=fmt, epilog=USAGE_NOTE + describe())
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    t.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    e = sub.add_parser("eval", help="evaluate a policy on the held-out set", formatter_class=fmt,
                       epilog=USAGE_NOTE + describe())
    e.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    e.add_argument("--checkpoint", help="a checkpoint folder (default: model.path)")
    b = sub.add_parser("build-demo-model", help="(re)build the demo model into a folder")
    b.add_argument("out")
    return p


def _quiet_libraries() -> None:
    """relayrl draws its own progress; drop transformers' per-load bars and advisory warnings."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    _quiet_libraries()
    try:
        if ns.cmd == "build-demo-model":
            from relayrl.demo.model import build_demo_model

            print(build_demo_model(ns.out))
            return 0
        config, overrides = _split(ns.args)
        if ns.cmd == "eval" and ns.checkpoint:
            overrides.append(f"model.path={ns.checkpoint}")
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"relayrl: config error: {e}", file=sys.stderr)
        return 2
    from relayrl.data import DataError
    from relayrl.pipeline import ResumeError, evaluate_only, train

    try:
        if ns.cmd == "train":
            train(cfg, resume=ns.resume)
        else:
            print(json.dumps(evaluate_only(cfg), indent=1))
    except (DataError, ResumeError, ValueError) as e:
        print(f"relayrl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
