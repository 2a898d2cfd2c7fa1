"""What each command reads of the one configuration: ``relayrl sft`` takes the model, data, trainer, run and
evaluation settings (and the generation settings its evaluation samples with); ``relayrl train`` everything
but the ``sft`` section. A field set where the command ignores it is an error naming it, as a field set where
the mode ignores it is (``rules.APPLIES_ONLY``); ``sft_defaults`` gives a supervised run its own defaults where
the user left them unset."""

from __future__ import annotations

from pydantic import BaseModel

# fields the rules resolve by assignment (which pydantic counts as set): not the user's
_RESOLVED = {"rollout": {"budget", "dynamic_sampling"}, "trainer": {"lr"}, "reward": {"fn"}}

SFT_ONLY = {"sft": None, "data": {"response_field", "min_reward"}}  # None: the whole section
# what relayrl sft ignores: the learning algorithm and the rollout's shape (its evaluation samples with the rest)
RL_ONLY = {"algo": None, "critic": None, "env": None, "serve": None, "teacher": None,
           "rollout": {"prompts_per_step", "group_size", "partial", "over_provision", "max_staleness",
                       "dynamic_sampling", "dynamic_sampling_max", "budget", "budget_min", "budget_max", "schedule",
                       "engine_process"},
           "data": {"selection", "selection_pool", "selection_forget", "selection_key", "selection_prior"},
           "run": {"mode", "save_rollouts", "mismatch_alarm", "max_failure_frac"},
           "reward": {"fn_weight", "fn_weights", "judge"},
           "trainer": {"updates_per_step"}}  # (one optimiser step a batch of demonstrations: it stretched the schedule)

SFT_DEFAULTS = {("data", "path"): "builtin:demo-sft", ("run", "name"): "sft", ("trainer", "pack"): True}


def _set(cfg: BaseModel, which: dict) -> list[str]:
    out = []
    for sec, fields in which.items():
        section = getattr(cfg, sec, None)
        if section is None:
            continue
        given = section.model_fields_set - _RESOLVED.get(sec, set())
        out += [f"{sec}.{f}" for f in sorted(given) if fields is None or f in fields]
    return out


def check_command(cfg: BaseModel, command: str) -> None:
    """A field set that ``command`` ("train" or "sft") ignores is a ``ValueError`` naming it."""
    if command == "train":
        bad, why = _set(cfg, SFT_ONLY), "it only applies to relayrl sft"
    else:
        bad, why = _set(cfg, RL_ONLY), "relayrl sft does not read it (it trains on demonstrations, no rollout)"
    if bad:
        raise ValueError(f"{bad[0]} is set, but {why}: remove it")


def sft_defaults(cfg: BaseModel) -> BaseModel:
    """``cfg`` with a supervised run's defaults where the user left a field unset: the built-in demonstrations,
    run.name 'sft' (beside the RL demo's runs/demo), packing on (rows of demonstrations differ in length)."""
    for (sec, key), value in SFT_DEFAULTS.items():
        section = getattr(cfg, sec)
        if key not in section.model_fields_set:
            setattr(section, key, value)
    return cfg
