"""``relayrl train|eval [CONFIG.yaml] [section.key=value ...]``, ``relayrl plot RUN [RUN ...]``,
``relayrl show RUN [--episode ID]``, ``relayrl export CHECKPOINT --merge OUT``.

Every error in the input reaches the user as one line on stderr, ``relayrl: <kind> error:
<message>``, exit status 2; an engine failure, or user code that fails too often at run time
(``relayrl.failures``), is one line with exit status 1.
Ctrl-C (SIGINT) is one line saying the run was interrupted, where its last complete checkpoint is
and the command that resumes it, exit status 130 (128 + SIGINT, the shell's convention). SIGTERM and
SIGUSR1 (slurm, Kubernetes, `kill`: ``relayrl.run.stops``) finish the step, save it and say the same,
exit status 143 or 138 (128 + the signal); before the first step, or a second one, stop as Ctrl-C does.
Anything else is a bug in relayrl and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
from pathlib import Path

from relayrl.config import describe, load_config, one_line
from relayrl.config.naming import NOT_NAMING

def _run_folder(default: str, cmd: str) -> str:
    """How the command names a run's folder (``config.naming``), for its --help."""
    kept = ", ".join(sorted(NOT_NAMING - {"run.name"})) + ", eval.*"
    return textwrap.fill(
        f"A run goes to <run.output_dir>/<run.name>. With run.name unset (in CONFIG.yaml and on the command line) "
        f"the command names it: CONFIG's file name (my.yaml: my) or {default}, then each override as key-value "
        f"(`relayrl {cmd} run.seed=1`: runs/{default}-run.seed-1), but for the fields of its length and watching, "
        f"which --resume may change ({kept}): the same command with --resume continues the same run.", 110) + "\n"


USAGE_NOTE = """\
Configuration: defaults < CONFIG.yaml < section.key=value overrides (YAML syntax for values).
With no arguments, `relayrl train` runs the built-in demo (chained addition, tiny model, CPU).
""" + _run_folder("demo", "train") + """
Fields:
"""


# what `relayrl eval` reads: whole sections, and the fields of others (its --help lists these only)
EVAL_READS = {"model", "eval", "reward", "env", "data.eval_path", "data.prompt_field", "data.answer_field",
              "data.id_field", "data.metadata_fields", "data.prompt_format", "rollout.engine", "rollout.dtype",
              "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "run.seed"}

EVAL_NOTE = """\
Evaluates a policy on data.eval_path: eval.size prompts, eval.samples sampled responses each and one greedy,
scored by reward.fn (or the environment), writing eval.json and eval_samples.jsonl. Which policy: --checkpoint;
else the newest checkpoint of the run the same arguments train (`relayrl eval my.yaml` after `relayrl train
my.yaml`: runs/my), said in the first line; else, or with --base, model.path untrained.
Configuration: defaults (with --checkpoint: its run's recorded config) < CONFIG.yaml < section.key=value
overrides. The fields it reads (every field: relayrl train --help):
"""


SFT_NOTE = """\
Configuration: defaults < CONFIG.yaml < section.key=value overrides, as for `relayrl train`; the sft section
and data.response_field / data.min_reward are its own, the algo, critic, env and teacher sections and the
rollout's shape are not read. With no arguments, `relayrl sft` fine-tunes the demo model on worked solutions
(builtin:demo-sft) into runs/sft, evaluated as `relayrl train` evaluates. Unset here: data.path is
builtin:demo-sft, run.name is sft, trainer.pack is true.
""" + _run_folder("sft", "sft") + """
Fields:
"""


class UsageError(ValueError):
    pass


# (module, exception class, kind, exit status), most specific first. A class is looked up only
# if its module was imported: one never imported cannot have been raised, and a config error
# then does not pay for importing torch.
ERRORS = [
    (__name__, "UsageError", "usage", 2),
    ("relayrl.config", "ConfigError", "config", 2),
    ("relayrl.data.datasets", "DataError", "data", 2),
    ("relayrl.models", "ModelError", "model", 2),
    ("relayrl.run.resume", "ResumeError", "resume", 2),
    ("relayrl.tracking.trackers", "TrackerError", "tracker", 2),
    ("relayrl.tracking.pictures", "PlotError", "plot", 2),
    ("relayrl.run.show", "ShowError", "show", 2),
    ("relayrl.engine.base", "PolicyMismatch", "sampling", 1),
    ("relayrl.engine.base", "EngineError", "engine", 1),
    ("relayrl.failures", "UserCodeError", "user code", 1),
    ("builtins", "ValueError", "input", 2),
]
MAX_MESSAGE = 2000  # characters: a message quoting a huge value must not flood the terminal
INTERRUPTED = 130  # exit status after Ctrl-C: 128 + SIGINT
STOPPED = 143  # after SIGTERM (138 after SIGUSR1): 128 + the signal


def classify(e: BaseException) -> tuple[str, int] | None:
    """(kind, exit status) for an error relayrl reports in one line; None for a bug."""
    for module, name, kind, status in ERRORS:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(e, getattr(mod, name)):
            return kind, status
    return None


def error_line(kind: str, e: BaseException) -> str:
    """``relayrl: <kind> error: <message>`` on one line: lines folded with "; ", and control
    characters, line separators and lone surrogates (from file names or values quoted in the
    message) escaped, since they would break the line or the terminal."""
    text = one_line(str(e)) or type(e).__name__
    text = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "…"
    return f"relayrl: {kind} error: {text}"


class _Parser(argparse.ArgumentParser):
    """argparse prints usage and exits; here a bad argument is a UsageError like any other bad input."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for a in args:
        if "=" not in a and config is None and a.endswith((".yaml", ".yml")):
            config = a
        elif "=" in a:
            overrides.append(a)
        else:
            raise UsageError(f"unexpected argument {a!r:.80}: expected CONFIG.yaml or section.key=value")
    return config, overrides


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="relayrl", description="RL post-training where the rollout never stalls.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a policy", formatter_class=fmt, epilog=USAGE_NOTE + describe())
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    t.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    f = sub.add_parser("sft", help="supervised fine-tuning on demonstrations (prompt and response, or chat messages; "
                       "or a run's rollout records)", formatter_class=fmt, epilog=SFT_NOTE + describe())
    f.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    f.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    e = sub.add_parser("eval", help="evaluate a policy on the held-out set", formatter_class=fmt,
                       epilog=EVAL_NOTE + describe(EVAL_READS))
    e.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    e.add_argument("--checkpoint", help="a checkpoint folder, or a run's folder: its newest checkpoint (default: "
                   "model.path); its run's recorded config "
                   "(state.json) then replaces the defaults: CONFIG.yaml and section.key=value still override it")
    e.add_argument("--base", action="store_true", help="evaluate model.path, untrained, even where the run the "
                   "arguments name has checkpoints")
    e.add_argument("--samples", type=int, metavar="K", help="sampled responses per prompt (sets eval.samples=K); "
                   "with K > 1 the report has pass@k (pass_at_1, pass_at_2, ..., pass_at_K)")
    e.add_argument("-o", "--output", metavar="DIR", help="where eval.json and eval_samples.jsonl go (default: the "
                   "checkpoint folder with --checkpoint, else <run.output_dir>/<run.name>/eval)")
    pl = sub.add_parser("plot", help="draw the learning curves of runs: one run's curves.png, or several compared "
                        "in one picture", formatter_class=fmt)
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run folders (<run.output_dir>/<run.name>, e.g. runs/demo)")
    pl.add_argument("-o", "--output", metavar="PATH", help="the picture (.png, .pdf or .svg; default: RUN/curves.png "
                    "for one run, compare_<names>.png beside the first run for several)")
    pl.add_argument("--x", choices=["step", "time"], default="step",
                    help="x axis: training steps, or wall-clock minutes (to compare modes)")
    sh = sub.add_parser("show", help="a run's rollout records: the episodes by step, or one episode")
    sh.add_argument("run", metavar="RUN", help="a run folder (<run.output_dir>/<run.name>, e.g. runs/demo)")
    sh.add_argument("--episode", metavar="ID", help="open one episode: its id (e.g. g3/1) or its # in the list")
    sh.add_argument("--step", type=int, metavar="N", help="only step N's episodes")
    sh.add_argument("--failures", action="store_true", help="only the episodes that failed (left out of training)")
    sh.add_argument("--status", choices=["trained", "failed", "filtered"], help="only those trained, failed or "
                    "filtered by dynamic sampling")
    sh.add_argument("--sort", choices=["reward", "length"], help="highest first (default: the run's order)")
    sh.add_argument("--min-reward", type=float, metavar="R")
    sh.add_argument("--max-reward", type=float, metavar="R")
    sh.add_argument("--limit", type=int, default=50, metavar="K", help="at most K rows (default 50; 0: all)")
    x = sub.add_parser("export", help="write a checkpoint's policy as a plain Hugging Face model")
    x.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder of a run with model.lora (PEFT's "
                   "adapter_config.json and adapter_model.safetensors), or the run's folder: its newest checkpoint")
    x.add_argument("--merge", required=True, metavar="OUT", help="the folder to write: the base model with the "
                   "adapter merged into its weights, and the tokenizer (AutoModelForCausalLM.from_pretrained reads it)")
    u = sub.add_parser("push", help="upload a checkpoint's model to the Hugging Face hub (or HF_ENDPOINT's)")
    u.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder, a run's folder (its newest), or "
                   "an exported one: its model, adapter, tokenizer and model card, not the optimiser's state")
    u.add_argument("repo", metavar="REPO_ID", help="the hub repository (user/name), made if it does not exist")
    u.add_argument("--private", action="store_true", help="make the repository private (when it is made)")
    u.add_argument("--revision", default=None, help="the branch to commit to (default: the repository's)")
    b = sub.add_parser("build-demo-model", help="(re)build the demo model into a folder")
    b.add_argument("out", metavar="OUT", help="the folder to write the model and its tokenizer to (created; "
                   "AutoModelForCausalLM.from_pretrained reads it, and model.path=OUT trains it)")
    return p


def _quiet_libraries() -> None:
    """relayrl draws its own progress; drop transformers' per-load bars and advisory warnings."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def interrupted(e: BaseException) -> bool:
    """Ctrl-C, possibly as the cause of another error (the engine's decoding loop runs on the main
    thread in sync mode and reports what stopped it as an engine failure)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def exit_status(e: BaseException) -> int:
    """128 + the signal that stopped the run (130: Ctrl-C)."""
    for _ in range(64):  # (a chain of causes, never a cycle's end)
        if e is None or hasattr(e, "signum") or isinstance(e, KeyboardInterrupt):
            break
        e = e.__cause__ or e.__context__
    return 128 + e.signum if hasattr(e, "signum") else INTERRUPTED


def interrupted_line(cfg, args: list[str], cmd: str = "train", why: str = "interrupted") -> str:
    """Where the interrupted run can be taken up: its last complete checkpoint and the command."""
    from relayrl.run.checkpoint import latest_checkpoint

    command = shlex.join(["relayrl", cmd, *args, "--resume"])
    ckpt = latest_checkpoint(cfg.run_dir)
    if ckpt is None:
        every = cfg.run.save_every
        when = f"every run.save_every={every} steps" if every else "run.save_every=0: only at the end"
        return (f"relayrl: {why} before the run's first checkpoint ({when}, under "
                f"{cfg.run_dir / 'checkpoints'}): nothing to resume from; {command} starts it over")
    step = json.loads((ckpt / "state.json").read_text()).get("step")
    return f"relayrl: {why}; the last complete checkpoint is {ckpt} (step {step}); resume with: {command}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BaseException as e:
        if interrupted(e):
            print("relayrl: interrupted", file=sys.stderr)
            return exit_status(e)
        kind = classify(e) if isinstance(e, Exception) else None
        if kind is None:
            raise
        print(error_line(kind[0], e), file=sys.stderr)
        return kind[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; CONFIG.yaml and overrides may also follow an option (`relayrl train --resume
    run.steps=200`), which argparse alone refuses once its positional list has ended."""
    ns, extra = _parser().parse_known_args(argv)
    if extra and (not hasattr(ns, "args") or any(a.startswith("-") for a in extra)):
        raise UsageError(f"unrecognized arguments: {shlex.join(extra):.200} (see relayrl {ns.cmd} --help)")
    if extra:
        ns.args = [*ns.args, *extra]
    return ns


def newest_checkpoint(path: str) -> str:
    """``path`` itself, or where it is a run's folder (``runs/demo``) its newest complete checkpoint: the
    docs' commands name a run, whatever its length (``relayrl export runs/demo-model.lora.r-8 --merge OUT``)."""
    from relayrl.run.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.exists():
        from relayrl.models import missing_folder

        raise UsageError(f"{path}: {missing_folder(p)}")
    if (p / "state.json").exists() or not (p / "checkpoints").is_dir():
        return path
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise UsageError(f"{path} is a run's folder with no complete checkpoint under {p / 'checkpoints'}")
    return str(ckpt)


def _run(argv: list[str] | None) -> int:
    ns = parse(argv)
    if getattr(ns, "checkpoint", None):  # (export's and eval's)
        ns.checkpoint = newest_checkpoint(ns.checkpoint)
    _quiet_libraries()
    if ns.cmd == "show":
        from relayrl.run.show import show

        show(ns.run, ns.episode, ns.step, ns.failures, ns.status, ns.min_reward, ns.max_reward, ns.sort, ns.limit)
        return 0
    if ns.cmd == "push":
        from relayrl.run.checkpoint import push_to_hub

        print(push_to_hub(ns.checkpoint, ns.repo, ns.private, ns.revision))
        return 0
    if ns.cmd == "export":
        from relayrl.run.checkpoint import recorded_config
        from relayrl.train.lora import export_merged

        recorded, _ = recorded_config(ns.checkpoint)  # (the run's model.dtype: the merged weights keep it)
        from relayrl.files import share

        out = export_merged(ns.checkpoint, ns.merge, ((recorded or {}).get("model") or {}).get("dtype", "float32"))
        share(Path(out).glob("*.safetensors"))  # (written 0600; OUT may hold other files: only these)
        print(out)
        return 0
    if ns.cmd == "build-demo-model":
        from relayrl.demo.model import build_demo_model

        print(build_demo_model(ns.out))
        return 0
    if ns.cmd == "plot":
        from relayrl.tracking.pictures import compare

        print(compare(ns.runs, ns.output, ns.x))
        return 0
    config, overrides = _split(ns.args)
    if ns.cmd in ("train", "sft"):
        from relayrl.run.api import Run

        from relayrl.run.stops import StopRequested

        run = Run(config, overrides, command=ns.cmd)  # (the Python entry point: this command is a layer over it)
        cfg = run.cfg

        try:
            run.train(resume=ns.resume)
        except StopRequested as e:
            print(interrupted_line(cfg, ns.args, ns.cmd, f"stopped by {e.name} after step {e.step}"), file=sys.stderr)
            return exit_status(e)
        except BaseException as e:
            if not interrupted(e):
                raise
            name = getattr(e, "name", "")  # (a stop signal before the first step: SignalInterrupt)
            print(interrupted_line(cfg, ns.args, ns.cmd, f"stopped by {name}" if name else "interrupted"), file=sys.stderr)
            return exit_status(e)
        return 0
    note = None
    if not ns.checkpoint and not ns.base:
        ns.checkpoint, note = _runs_checkpoint(config, overrides)
    cfg, settings = _eval_config(ns, config, overrides)
    if note:  # (once the settings are known good: an error stays one line)
        print(note, file=sys.stderr)
    from relayrl.run.build import evaluate_only

    out = ns.output or ns.checkpoint or cfg.run_dir / "eval"
    print(json.dumps(evaluate_only(cfg, out, settings), indent=1))
    return 0


def _runs_checkpoint(config: str | None, overrides: list[str]) -> tuple[str | None, str]:
    """``relayrl eval ARGS`` after ``relayrl train ARGS``: the newest checkpoint of the run those arguments name
    (the overrides only eval reads — eval.*, data.eval_path — left out of its name), or None (the base model)
    where that run has none; and the line that says which."""
    from relayrl.config.naming import run_name
    from relayrl.run.checkpoint import latest_checkpoint

    naming = [o for o in overrides if not o.startswith(("data.eval_path=", "eval."))]
    cfg = load_config(config, naming)
    run_dir = Path(cfg.run.output_dir) / run_name(cfg.run.name, config, naming, "name" in cfg.run.model_fields_set)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None, (f"relayrl eval: {run_dir} has no checkpoint: evaluating model.path={cfg.model.path}, untrained "
                      "(--checkpoint DIR for another run's)")
    step = json.loads((ckpt / "state.json").read_text()).get("step")
    return str(ckpt), f"relayrl eval: the newest checkpoint of {run_dir}, step {step} ({ckpt}; --base: model.path untrained)"


def _eval_config(ns, config: str | None, overrides: list[str]):
    """``relayrl eval``'s config, and where its settings came from (said before the numbers). With
    --checkpoint, the run's own recorded config replaces the defaults (its data, prompt format,
    verifier, generation settings: the run is evaluated as it was trained and evaluated), then
    CONFIG.yaml and the command line, as for train."""
    from relayrl.config import ConfigError, recorded_tree

    base, source = None, ""
    if ns.checkpoint:
        from relayrl.run.checkpoint import recorded_config

        base, source = recorded_config(ns.checkpoint)
    layers = ([f"the checkpoint's recorded config ({source})"] if base else
              [f"the defaults ({ns.checkpoint} has no state.json recording its run's config)"] if ns.checkpoint else
              ["the defaults"]) + ([config] if config else []) + (["the command line"] if overrides else [])
    overrides = overrides + ([f"model.path={ns.checkpoint}"] if ns.checkpoint else [])
    tree = recorded_tree(base) if base else None
    if tree:
        tree.get("model", {}).pop("tokenizer", None)  # (the checkpoint holds the run's tokenizer)

    def load(extra: list[str]):
        try:
            return load_config(config, overrides + extra, base=tree, base_source=source)
        except ConfigError as e:
            if not base:
                raise
            raise ConfigError(f"{e} (settings: {' < '.join(layers)}; a section.key=value on the command line "
                              "overrides the recorded one)") from None

    # first without --samples: with no held-out prompts eval.samples would be refused as a setting that does
    # not apply, and the line would say to drop --samples where the command needs data.eval_path
    cfg = load([])
    if not cfg.data.eval_path:
        raise ValueError(f"data.eval_path is not set (settings: {' < '.join(layers)}): nothing to evaluate; add "
                         "data.eval_path=FILE to the command (prompts and answers, read as data.path is)")
    if ns.samples is not None:
        cfg = load([f"eval.samples={ns.samples}"])
    return cfg, " < ".join(layers)


if __name__ == "__main__":
    sys.exit(main())
