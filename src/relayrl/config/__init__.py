"""The one typed, validated configuration (``section.field``): the sections (``sections``), the root
and its validation (``schema``, ``rules``), loading from YAML and the command line (``load``)."""

from relayrl.config.load import (  # noqa: F401
    describe, dump_config, load_config, parse_override, recorded_tree, resolved_tree,
)
from relayrl.config.rules import APPLIES_ONLY, budget_bounds, inapplicable_set  # noqa: F401
from relayrl.config.schema import Config  # noqa: F401
from relayrl.config.sections import (  # noqa: F401
    ConfigError, DataCfg, JudgeCfg, EnvCfg, EvalCfg, LoraCfg, ModelCfg, RayCfg, RewardCfg, RolloutCfg, RunCfg, ServeCfg,
)
from relayrl.config.teachers import SftCfg, TeacherCfg  # noqa: F401
from relayrl.config.training import AlgoCfg, CriticCfg, TrainerCfg  # noqa: F401
from relayrl.failures import one_line  # noqa: F401
