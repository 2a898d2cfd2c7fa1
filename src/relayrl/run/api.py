"""relayrl from Python — a notebook, a script: what ``relayrl train`` and ``relayrl sft`` do, the command line
being a thin layer over it.

    import relayrl

    run = relayrl.Run("my.yaml", trainer={"lr": 1e-5}, rollout={"group_size": 4})   # or Run(**{"trainer.lr": 1e-5})
    summary = run.train()              # the run's summary (summary.json); run.dir is runs/<name>
    run.train(resume=True)             # continue it from its newest checkpoint
    relayrl.Run(learning_rate=1e-6, num_generations=4).train()                     # TRL's names work too

Settings, lowest first: the defaults < ``config`` (a YAML file) < ``overrides`` (``"section.key=value"``
strings, as on the command line) < keyword arguments: a section as a dict (``trainer={"lr": 1e-5}``), a dotted
name (``**{"trainer.lr": 1e-5}``) or one of TRL's names (``config.aliases``). The run is named as the command
names it (``run.name``, else the file's name and the settings that change what it trains).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from relayrl.config import Config, load_config

__all__ = ["Run"]


def _overrides(settings: dict[str, Any]) -> list[str]:
    """Keyword arguments as ``section.key=value`` overrides (values as JSON, which the override parser's YAML
    reads back as they were: 1e-05, "text", [a, b], {k: v}); a section's own section (``model={"lora": {"r":
    8}}``) as three-level keys."""
    out = []
    for key, value in settings.items():
        if not (isinstance(value, dict) and key in Config.model_fields):
            out.append(f"{key}={json.dumps(value)}")
            continue
        section = Config.model_fields[key].annotation
        for field, v in value.items():
            info = section.model_fields.get(field)
            if isinstance(v, dict) and info is not None and isinstance(info.annotation, type) \
                    and issubclass(info.annotation, BaseModel):
                out += [f"{key}.{field}.{k}={json.dumps(x)}" for k, x in v.items()]
            else:
                out.append(f"{key}.{field}={json.dumps(v)}")
    return out


class Run:
    """One run of ``relayrl train`` (``command="train"``) or ``relayrl sft`` (``command="sft"``): its settings
    checked at once (a ``ConfigError`` naming the field), its folder ``dir``, ``train()`` to run it."""

    def __init__(self, config: str | Path | None = None, overrides: list[str] = (), *,
                 command: Literal["train", "sft"] = "train", **settings: Any):
        from relayrl.config.commands import check_command, sft_defaults
        from relayrl.config.naming import run_name

        self.command = command
        self.overrides = [*overrides, *_overrides(settings)]
        self.config_path = None if config is None else str(config)
        cfg = load_config(self.config_path, self.overrides)
        check_command(cfg, command)
        named = "name" in cfg.run.model_fields_set  # (by the user: sft_defaults sets its own)
        if command == "sft":
            cfg = sft_defaults(cfg)
        self._base, self._named = cfg.run.name, named
        cfg.run.name = run_name(cfg.run.name, self.config_path, self.overrides, named)
        self.cfg = cfg

    @property
    def dir(self) -> Path:
        return self.cfg.run_dir

    def train(self, resume: bool = False, console=None) -> dict:
        """Runs it to the end; returns its summary. Ctrl-C raises KeyboardInterrupt, SIGTERM ``StopRequested``
        once the step is saved (``run.stops``); ``resume=True`` continues from the newest checkpoint."""
        if resume:
            self._find_resumed()
        if self.command == "sft":
            from relayrl.run.sft import sft as run
        else:
            from relayrl.run.loop import train as run
        return run(self.cfg, resume=resume, **({"console": console} if console is not None else {}))

    def _find_resumed(self) -> None:
        """``--resume`` of an unnamed run with a setting changed since it started (one --resume may change:
        run.max_failure_frac, algo.*; or one it refuses: then the refusal, naming the field): the settings name
        another folder, which has no checkpoint. The run it continues is the folder named by the fewest of the
        settings left out that has one; said on stderr."""
        import itertools
        import sys

        from relayrl.config.naming import run_name
        from relayrl.run.checkpoint import latest_checkpoint

        if self._named or latest_checkpoint(self.dir) is not None:
            return
        n = len(self.overrides)
        for k in range(1, n + 1):
            for left_out in itertools.combinations(range(n), k):
                kept = [o for i, o in enumerate(self.overrides) if i not in left_out]
                name = run_name(self._base, self.config_path, kept, False)
                if latest_checkpoint(self.dir.parent / name) is not None:
                    print(f"relayrl: --resume: {self.dir} has no checkpoint; continuing {self.dir.parent / name}, "
                          f"the run these settings continue (its name leaves out "
                          f"{', '.join(self.overrides[i] for i in left_out)}, set since it started)", file=sys.stderr)
                    self.cfg.run.name = name
                    return

    def __repr__(self) -> str:
        return f"relayrl.Run({self.command}, {self.dir})"
