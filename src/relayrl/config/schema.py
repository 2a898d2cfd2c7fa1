"""The one typed, validated configuration. Two levels: ``section.field``.

Each field is documented where it is defined (``config.sections``, ``training``, ``teachers``); ``relayrl train --help`` prints
these docs. Load order (``config.load``): defaults < YAML file < dotted command-line overrides
(``trainer.lr=1e-5``). Unknown keys, wrong types, out-of-range values and settings the chosen mode
ignores (``config.rules``) fail before any work starts, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.config.rules import check
from relayrl.config.sections import DataCfg, EnvCfg, EvalCfg, ModelCfg, RayCfg, RewardCfg, RolloutCfg, RunCfg, ServeCfg
from relayrl.config.teachers import SftCfg, TeacherCfg
from relayrl.config.training import AlgoCfg, CriticCfg, TrainerCfg
from relayrl.config.vision import VisionCfg
from relayrl.config.workspaces import WorkspaceCfg


# A built-in training set's held-out prompts: data.eval_path when it is left unset (data of one's own: none, never
# the demo's, which would measure the user's reward on the demo's prompts).
BUILTIN_EVAL = {"builtin:demo": "builtin:demo-eval", "builtin:demo-sft": "builtin:demo-eval",
                "builtin:agent-demo": "builtin:agent-demo-eval", "builtin:nim": "builtin:nim-eval",
                "builtin:proposer-solver": "builtin:proposer-solver-eval", "builtin:swe-demo": "builtin:swe-demo-eval",
                "builtin:vlm-demo": "builtin:vlm-demo-eval", "builtin:gui": "builtin:gui-eval"}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: RunCfg = Field(default_factory=RunCfg)
    model: ModelCfg = Field(default_factory=ModelCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    rollout: RolloutCfg = Field(default_factory=RolloutCfg)
    reward: RewardCfg = Field(default_factory=RewardCfg)
    algo: AlgoCfg = Field(default_factory=AlgoCfg)
    critic: CriticCfg = Field(default_factory=CriticCfg)
    trainer: TrainerCfg = Field(default_factory=TrainerCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    env: EnvCfg = Field(default_factory=EnvCfg)
    serve: ServeCfg = Field(default_factory=ServeCfg)
    ray: RayCfg = Field(default_factory=RayCfg)
    sft: SftCfg = Field(default_factory=SftCfg)
    teacher: TeacherCfg = Field(default_factory=TeacherCfg)
    workspace: WorkspaceCfg = Field(default_factory=WorkspaceCfg)
    vision: VisionCfg = Field(default_factory=VisionCfg)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def get(self, dotted: str) -> Any:
        """The value of ``section.field`` (or ``section.sub.field``: model.lora.r)."""
        value: Any = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if "eval_path" not in self.data.model_fields_set:  # (set past validation: it stays unset, as the user left it)
            self.data.__dict__["eval_path"] = BUILTIN_EVAL.get(self.data.path)
        check(self)
        return self
