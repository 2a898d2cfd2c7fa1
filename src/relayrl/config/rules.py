"""Rules across sections: combinations that cannot work, and fields set where the chosen mode
ignores them (``APPLIES_ONLY``: setting one would silently do nothing, so it is an error).
Called by ``Config``'s validator; every message names the fields.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel

from relayrl.config.sections import RolloutCfg
from relayrl.config.training import CriticCfg

# The rules read a whole configuration: the root ``config.schema.Config``, which calls them from its
# validator. They take it as the pydantic model it is, without importing it (the schema imports the
# rules, one way).


def check(c: BaseModel) -> None:
    """Every rule, in order; the first broken one raises ``ValueError`` naming its fields."""
    _several_verifiers(c.reward)
    _judge_alone(c)
    _preset(c)
    _adaptive_sampling_where_it_applies(c)
    _lora_learning_rate(c)
    _workspace_deadlines(c)
    _teachers_and_judges(c)
    r, t = c.rollout, c.trainer
    batch = r.prompts_per_step * r.group_size
    if t.updates_per_step > batch:  # each optimiser step needs at least one response
        raise ValueError(
            f"trainer.updates_per_step={t.updates_per_step} is more than the batch it splits: "
            f"rollout.prompts_per_step × rollout.group_size = {r.prompts_per_step} × {r.group_size} = {batch}")
    if r.vllm_sleep and (c.run.mode != "sync" or c.run.backend != "local"):
        raise ValueError(f"rollout.vllm_sleep=true needs run.mode=sync and run.backend=local (here run.mode="
                         f"{c.run.mode}, run.backend={c.run.backend}): an engine asleep cannot generate "
                         "while the trainer steps")
    if t.bf16 and c.model.dtype != "float32":
        raise ValueError(f"trainer.bf16=true needs model.dtype=float32 (here {c.model.dtype}): "
                         "autocast computes in bfloat16 around float32 weights")
    if c.eval.every > c.run.steps:
        raise ValueError(f"eval.every={c.eval.every} is more than run.steps={c.run.steps}: it would never "
                         "evaluate during training (0: only before and after)")
    if r.budget == "adaptive":
        lo, hi = budget_bounds(r)
        if not lo <= r.group_size <= hi:
            raise ValueError(f"rollout.budget=adaptive needs rollout.budget_min ≤ rollout.group_size ≤ "
                             f"rollout.budget_max, got {lo} ≤ {r.group_size} ≤ {hi}")
    if c.eval.stop_at is not None and not c.eval.every:
        raise ValueError("eval.stop_at needs eval.every ≥ 1: it is checked at the evaluations during training")
    if c.algo.advantage == "gigpo" and c.env.name is None:
        raise ValueError("algo.advantage='gigpo' needs an environment (env.name): its step-level credit is "
                         "over the turns of an episode")
    if c.algo.advantage == "gigpo" and c.env.name.startswith("agent:"):
        raise ValueError(f"algo.advantage='gigpo' does not combine with env.name={c.env.name}: an agent "
                         "program's episodes carry no anchor states to group its steps by, and the extra "
                         "branches of its session would count as episodes of their group; use an episode-level "
                         "advantage (grpo, rloo, ...)")
    if c.algo.advantage == "gigpo" and c.env.context == "elide":
        raise ValueError("algo.advantage='gigpo' does not combine with env.context=elide: a rewritten history's "
                         "branches carry no anchor states of their own; use an episode-level advantage (grpo, rloo, ...)")
    _check_algo(c)
    if r.engine == "vllm" and c.model.lora.r:
        vllm_lora_rank(c.model.lora.r)
    if r.engine == "vllm" and r.speculative == "on" and list(r.speculative_sources) != ["prompt"]:
        raise ValueError(f"rollout.speculative=on with rollout.engine=vllm drafts from the prompt only (vLLM's "
                         f"n-gram method: prompt lookup over the prompt and the request's own output); "
                         f"rollout.speculative_sources={list(r.speculative_sources)}: set it to [prompt] (history "
                         "and siblings are drafted in the hf engine; engine/vllm_spec.py says why not in vLLM)")
    _adapter_per_role(c)
    _expert_adapters(c)
    for field in inapplicable_set(c):
        applies, when, deciding = APPLIES_ONLY[field]
        now = ", ".join(f"{d}={_show(c.get(d))}" for d in deciding)
        raise ValueError(f"{field} is set, but it only applies {when} (here {now}): remove it")


# vLLM's choices of max_lora_rank (vllm/config/lora.py, MaxLoRARanks; the vLLM tests check the two agree)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _expert_adapters(c: BaseModel) -> None:
    """model.lora.experts: merged per expert by relayrl's hf engines. relayrl's vLLM path has not been tried with PEFT's
    target_parameters adapters (vLLM's MoE LoRA kernels need Triton on a GPU), nor FSDP2 with them: both refused."""
    if not (c.model.lora.r and c.model.lora.experts):
        return
    if c.rollout.engine not in ("hf", "hf-cb"):
        raise ValueError(f"model.lora.experts=true needs rollout.engine=hf or hf-cb (here {c.rollout.engine}): "
                         "relayrl's hf engines merge an adapter per expert")
    if c.trainer.fsdp:
        raise ValueError("model.lora.experts=true does not combine with trainer.fsdp yet: train on one process")


def _adapter_per_role(c: BaseModel) -> None:
    """model.lora.per_role: a multi-agent environment's roles, each its own adapter, which the hf engine (merging the
    adapter of each batch's role) and vLLM (an adapter per request) serve."""
    if not (c.model.lora.r and c.model.lora.per_role):
        return
    if c.env.name is None:
        raise ValueError("model.lora.per_role=true needs a multi-agent environment (env.name with roles, e.g. "
                         "proposer_solver or nim): its adapters are one per role")
    if c.rollout.engine not in ("hf", "vllm"):
        raise ValueError(f"model.lora.per_role=true needs rollout.engine=hf or vllm (here {c.rollout.engine}): the "
                         "engines that serve one adapter per role")


def vllm_lora_rank(r: int) -> int:
    """The max_lora_rank vLLM starts with for an adapter of rank ``r``: the smallest it allows that holds it."""
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise ValueError(f"model.lora.r={r} with rollout.engine=vllm: vLLM serves adapters of rank at most "
                         f"{VLLM_LORA_RANKS[-1]}; use a lower rank or rollout.engine=hf")
    return fits[0]


def _judge_alone(c: BaseModel) -> None:
    """reward.fn, where the user left it unset and a judge is given: 'none' (the judge's reward alone)."""
    j = c.reward.judge
    if (j.path or j.url) and "fn" not in c.reward.model_fields_set:
        c.reward.fn = "none"


def _teachers_and_judges(c: BaseModel) -> None:
    """A teacher or a judge given twice, or a loss with nothing to learn from."""
    t, j = c.teacher, c.reward.judge
    if t.path and t.url:
        raise ValueError("teacher.path and teacher.url are both set: give one (teacher.teachers names several)")
    if j.path and j.url:
        raise ValueError("reward.judge.path and reward.judge.url are both set: give one")
    if c.algo.reward_coef == 0 and not t.on:
        raise ValueError("algo.reward_coef=0 leaves nothing to learn from without a teacher (teacher.path or "
                         "teacher.url): set one, or algo.reward_coef > 0")
    if c.reward.fn == "none" and not (j.path or j.url) and c.algo.reward_coef > 0 and not c.env.name:
        raise ValueError("reward.fn=none with no judge (reward.judge.path or .url) and no environment gives every "
                         "response the reward 0: set algo.reward_coef=0 for pure distillation (teacher.path), or a "
                         "verifier or a judge")
    if c.reward.fn_weight == 0 and j.weight == 0:
        raise ValueError("reward.fn_weight=0 and reward.judge.weight=0: the reward is always 0")
    if t.on and c.algo.loss == "gspo":
        raise ValueError("teacher with algo.loss=gspo: GSPO's ratio and advantage are a sequence's, so the teacher's "
                         "per-token term would be averaged over each response (its credit to a token lost): use "
                         "algo.loss=gspo_token (GSPO's ratio, per-token advantages) or ppo_clip")


def _several_verifiers(r: BaseModel) -> None:
    """reward.fn as a list: at least one, none of them 'none', and reward.fn_weights one a function if set."""
    if not isinstance(r.fn, list):
        if r.fn_weights is not None:
            raise ValueError(f"reward.fn_weights is set, but reward.fn is one function ({r.fn!r}): weights go with a "
                             "list of them (reward.fn=[math, my.py:fmt] reward.fn_weights=[1, 0.2])")
        return
    if not r.fn or "none" in r.fn:
        raise ValueError(f"reward.fn={r.fn}: a list names one verifier or more, and 'none' is not one")
    if r.fn_weights is not None and len(r.fn_weights) != len(r.fn):
        raise ValueError(f"reward.fn_weights has {len(r.fn_weights)} weights for the {len(r.fn)} functions of "
                         f"reward.fn: one each, in order")


# algo.preset=grpo: GRPO as DeepSeekMath (arXiv 2402.03300) defines it, for the fields the user left unset
GRPO_PAPER = {("algo", "advantage"): "grpo", ("algo", "loss"): "ppo_clip", ("algo", "clip_low"): 0.2,
              ("algo", "clip_high"): 0.2, ("algo", "dual_clip"): None, ("algo", "agg"): "seq_mean_token_mean",
              ("algo", "kl_coef"): 0.04, ("algo", "kl_estimator"): "k3", ("algo", "kl_mode"): "loss",
              ("rollout", "budget"): "fixed", ("rollout", "dynamic_sampling"): False}


def _preset(c: BaseModel) -> None:
    """``algo.preset``: its settings where the user left a field unset (left unset, as defaults are: a field that
    does not apply beside one the user set — kl_estimator with kl_coef=0 — is not refused; the run's recorded
    config has every value)."""
    if c.algo.preset != "grpo":
        return
    for (section, field), value in GRPO_PAPER.items():
        body = getattr(c, section)
        if field not in body.model_fields_set:
            body.__dict__[field] = value
    c.rollout.model_fields_set.update({"budget", "dynamic_sampling"})  # (not the group baseline's defaults)


def _adaptive_sampling_where_it_applies(c: BaseModel) -> None:
    """rollout.budget and rollout.dynamic_sampling, where the user left them unset: 'adaptive' and true with a
    group baseline over ≥ 2 responses and no teacher (their signal is a group's reward variance; the default run learns on every
    seed with them, not without: the seeds table in docs/performance.md), else 'fixed' and false."""
    from relayrl.algos.estimators import GROUP_BASELINE

    r = c.rollout
    # (with a teacher — pure distillation, or beside a verifier — a group whose rewards are equal still carries its
    # teacher's per-token signal: a group's reward variance does not say what it teaches, so nothing is dropped)
    groups = c.algo.advantage in GROUP_BASELINE and r.group_size >= 2 and c.algo.reward_coef > 0 and not c.teacher.on
    # (resolved past validation, left unset: where a field stays unset, the user did not set it — run.build reads so)
    if "budget" not in r.model_fields_set:
        r.__dict__["budget"] = "adaptive" if groups else "fixed"
    if "dynamic_sampling" not in r.model_fields_set:
        r.__dict__["dynamic_sampling"] = groups


# env.name=workspace: a step may run a task's tests (up to its test_timeout_s, 120 s by default) in a workspace
WORKSPACE_DEADLINES = {"step_timeout_s": 300.0, "episode_timeout_s": 1800.0}


def _workspace_deadlines(c: BaseModel) -> None:
    """env.step_timeout_s and env.episode_timeout_s, where the user left them unset, for env.name=workspace: room
    for the final step's test run in a fresh workspace (``relayrl.workspaces.grading``)."""
    if c.env.name == "workspace":
        for field, value in WORKSPACE_DEADLINES.items():
            if field not in c.env.model_fields_set:
                c.env.__dict__[field] = value


def _lora_learning_rate(c: BaseModel) -> None:
    """trainer.lr, where the user left it unset and an adapter is on (model.lora.r > 0): the full fine-tuning
    default × ``LORA_LR_FACTOR`` (an adapter's fitting rate is ~10x full fine-tuning's: "LoRA without regret";
    tinker-cookbook's get_lr). Resolved here, so the run's recorded config says the rate it trained with."""
    from relayrl.config.sections import LORA_LR_FACTOR

    t = c.trainer
    if c.model.lora.r and "lr" not in t.model_fields_set:
        t.lr = type(t).model_fields["lr"].default * LORA_LR_FACTOR


def budget_bounds(r: RolloutCfg) -> tuple[int, int]:
    """(responses a group gets first, most it gets) with rollout.budget=adaptive."""
    return (r.budget_min if r.budget_min is not None else max(2, r.group_size // 2),
            r.budget_max if r.budget_max is not None else 2 * r.group_size)


def _check_algo(c: BaseModel) -> None:
    """Combinations of the algorithm's choices that cannot work, by name."""
    a, r = c.algo, c.rollout
    from relayrl.algos.estimators import GROUP_BASELINE

    if a.advantage in GROUP_BASELINE and r.group_size == 1:
        raise ValueError(f"rollout.group_size=1 with algo.advantage={a.advantage!r}: its baseline is the mean of a "
                         "group's responses, and a group of one has none to compare with (the advantage is the raw "
                         "reward, and no group variance for rollout.dynamic_sampling or rollout.budget to read): set "
                         "rollout.group_size ≥ 2, or a baseline that needs no group, algo.advantage=reinforce_pp or "
                         "gae")
    if a.advantage in ("gigpo", "rae") and a.kl_mode == "reward" and a.kl_coef > 0:
        raise ValueError(f"algo.kl_mode='reward' does not combine with algo.advantage={a.advantage!r}: its credit "
                         "is computed from the episodes' step rewards when the batch is built, before any KL is "
                         "known; use algo.kl_mode=loss")
    if a.advantage == "evpo" and a.evpo_level == "group" and r.group_size == 1:
        raise ValueError("algo.evpo_level='group' needs rollout.group_size > 1: a group of one response has one "
                         "return, no variance for the critic to explain")
    budget, which = (c.env.max_tokens, "env.max_tokens") if c.env.name else (r.max_new_tokens, "rollout.max_new_tokens")
    if a.overlong == "punish" and a.overlong_buffer > budget:
        raise ValueError(f"algo.overlong_buffer={a.overlong_buffer} is longer than the response budget, {which}="
                         f"{budget}")
    batch = r.prompts_per_step * r.group_size
    if _critic(c) and c.critic.updates_per_step > batch:
        raise ValueError(f"critic.updates_per_step={c.critic.updates_per_step} is more than the batch it splits: "
                         f"rollout.prompts_per_step × rollout.group_size = {batch}")


def _critic(c: BaseModel) -> bool:
    from relayrl.algos import NEEDS_CRITIC

    return c.algo.advantage in NEEDS_CRITIC


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def own_engine_process(r: RolloutCfg, run) -> bool:
    """Does the hf engine run in a process of its own? Null ``rollout.engine_process`` means yes for the
    overlapped modes; several engines or Ray actors always have processes of their own (a router needs
    engines with threads of their own). ``engine.placement`` places engines by this."""
    own = r.engine_process if r.engine_process is not None else run.mode != "sync"
    return own or r.engines > 1 or run.backend == "ray"


_ASYNC = (lambda c: c.run.mode == "async", "with run.mode=async", ("run.mode",))
_CB = (lambda c: c.rollout.engine == "hf-cb", "with rollout.engine=hf-cb", ("rollout.engine",))
_TIS = (lambda c: c.algo.offpolicy == "tis", "with algo.offpolicy=tis", ("algo.offpolicy",))
_EVAL = (lambda c: c.data.eval_path is not None, "when data.eval_path is set", ("data.eval_path",))
_ENV = (lambda c: c.env.name is not None, "with an environment (env.name set)", ("env.name",))
_SERVE = (lambda c: (c.env.name or "").startswith("agent:"), "with an agent program (env.name=agent:...)",
          ("env.name",))
_WORKSPACE = (lambda c: c.env.name == "workspace" or (c.env.name or "").startswith("agent:"),
              "with env.name=workspace or an agent program (env.name=agent:...) on workspace tasks", ("env.name",))
_VLLM = (lambda c: c.rollout.engine == "vllm", "with rollout.engine=vllm", ("rollout.engine",))
_RAY = (lambda c: c.run.backend == "ray", "with run.backend=ray", ("run.backend",))
_SYNC = (lambda c: (c.rollout.engine == "vllm" and not c.model.lora.r) or c.run.backend == "ray", "with run.backend=ray, "
         "or rollout.engine=vllm and full-weight updates (model.lora.r=0: adapters travel as adapters)",
         ("run.backend", "rollout.engine", "model.lora.r"))
_PROJECT_TRACKERS = ("wandb", "mlflow", "trackio", "swanlab")
_BUDGET = (lambda c: c.rollout.budget == "adaptive", "with rollout.budget=adaptive", ("rollout.budget",))
_SPEC = (lambda c: c.rollout.speculative == "on", "with rollout.speculative=on", ("rollout.speculative",))
_SELECT = (lambda c: c.data.selection != "uniform", "with data.selection=vade or cures", ("data.selection",))
_CRITIC = (_critic, "with a critic (algo.advantage=gae or evpo)", ("algo.advantage",))
_LORA = (lambda c: c.model.lora.r > 0, "with an adapter (model.lora.r > 0)", ("model.lora.r",))
_TEACHER = (lambda c: c.teacher.on, "with a teacher (teacher.path, teacher.url or teacher.teachers)",
            ("teacher.path", "teacher.url", "teacher.teachers"))
_TEACHER_LOCAL = (lambda c: bool(c.teacher.path or c.teacher.teachers), "with a teacher model here (teacher.path or "
                  "teacher.teachers)", ("teacher.path", "teacher.teachers"))
_TEACHER_URL = (lambda c: bool(c.teacher.url or c.teacher.teachers), "with a teacher server (teacher.url or "
                "teacher.teachers)", ("teacher.url", "teacher.teachers"))
_JUDGE = (lambda c: bool(c.reward.judge.path or c.reward.judge.url), "with a judge (reward.judge.path or .url)",
          ("reward.judge.path", "reward.judge.url"))
_JUDGE_URL = (lambda c: bool(c.reward.judge.url), "with reward.judge.url", ("reward.judge.url",))
_JUDGE_LOCAL = (lambda c: bool(c.reward.judge.path), "with reward.judge.path", ("reward.judge.path",))

# Fields that the chosen mode/options ignore: field -> (does it apply?, when it applies, the fields
# that decide). Setting one where it does not apply would silently do nothing, so it is an error
# (only when set explicitly: defaults are always present).
APPLIES_ONLY: dict[str, tuple[Callable[[BaseModel], bool], str, tuple[str, ...]]] = {
    "rollout.max_staleness": _ASYNC,
    "rollout.cb_num_blocks": _CB,
    "rollout.cb_page_size": _CB,
    "rollout.cb_max_batch_tokens": _CB,
    "rollout.engine_threads": (lambda c: own_engine_process(c.rollout, c.run), "when the engine runs in its own process "
                               "(rollout.engine_process=true, or null with run.mode=periodic or async; or "
                               "rollout.engines > 1; or run.backend=ray)",
                               ("rollout.engine_process", "run.mode", "rollout.engines", "run.backend")),
    "rollout.dynamic_sampling_max": (lambda c: c.rollout.dynamic_sampling, "with rollout.dynamic_sampling=true",
                                     ("rollout.dynamic_sampling",)),
    "rollout.weight_sync": _SYNC,
    "rollout.sync_bucket_mb": _SYNC,
    "rollout.sync_timeout_s": _SYNC,
    "rollout.budget_min": _BUDGET,
    "rollout.budget_max": _BUDGET,
    "data.selection_pool": _SELECT,
    "data.selection_forget": _SELECT,
    "data.selection_key": _SELECT,
    "data.selection_prior": _SELECT,
    "rollout.fast_decode": (lambda c: c.rollout.engine == "hf", "with rollout.engine=hf", ("rollout.engine",)),
    "rollout.speculative": (lambda c: c.rollout.engine in ("hf", "vllm"), "with rollout.engine=hf or vllm",
                            ("rollout.engine",)),
    "rollout.speculative_sources": _SPEC,
    "rollout.speculative_max_draft": _SPEC,
    "rollout.speculative_lead": (lambda c: c.rollout.speculative == "on" and "siblings" in c.rollout.speculative_sources,
                                 "with rollout.speculative=on and siblings among rollout.speculative_sources",
                                 ("rollout.speculative", "rollout.speculative_sources")),
    "rollout.speculative_batch_tokens": (lambda c: c.rollout.speculative == "on" and c.rollout.engine == "hf",
                                         "with rollout.speculative=on and rollout.engine=hf",
                                         ("rollout.speculative", "rollout.engine")),
    "rollout.dtype": (lambda c: c.rollout.engine != "vllm", "with rollout.engine=hf or hf-cb (vLLM loads the "
                      "weights in model.dtype)", ("rollout.engine",)),
    "rollout.device": (lambda c: c.rollout.engine != "vllm", "with rollout.engine=hf or hf-cb (vLLM places "
                       "itself)", ("rollout.engine",)),
    "trainer.share_prefix": (lambda c: not c.trainer.fsdp, "with trainer.fsdp=false (the sharded ranks forward "
                             "every row whole)", ("trainer.fsdp",)),
    "rollout.vllm_max_model_len": _VLLM,
    "rollout.vllm_gpu_memory_utilization": _VLLM,
    "rollout.vllm_sleep": _VLLM,
    "run.project": (lambda c: any(t in _PROJECT_TRACKERS for t in c.run.report_to),
                    f"when run.report_to names a tracker with projects ({', '.join(_PROJECT_TRACKERS)})",
                    ("run.report_to",)),
    "ray.address": _RAY,
    "ray.num_cpus": _RAY,
    "ray.max_engine_restarts": _RAY,
    "ray.engine_resources": _RAY,
    "algo.tis_cap": _TIS,
    "algo.tis_level": _TIS,
    "algo.m2po_tau": (lambda c: c.algo.offpolicy == "m2po", "with algo.offpolicy=m2po", ("algo.offpolicy",)),
    "algo.norm_len": (lambda c: c.algo.agg == "seq_mean_token_sum_norm", "with algo.agg=seq_mean_token_sum_norm",
                      ("algo.agg",)),
    "algo.kl_estimator": (lambda c: c.algo.kl_coef > 0, "with algo.kl_coef > 0", ("algo.kl_coef",)),
    "model.system_prompt": (lambda c: c.data.prompt_format == "chat", "with data.prompt_format=chat (a raw prompt "
                            "has no messages)", ("data.prompt_format",)),
    "env.args": _ENV,
    "env.max_turns": _ENV,
    "env.max_tokens": _ENV,
    "env.step_timeout_s": _ENV,
    "env.episode_timeout_s": _ENV,
    **{f"workspace.{f}": _WORKSPACE for f in ("max_workspaces", "memory_mb", "disk_mb", "command_timeout_s",
                                                "output_chars", "reward")},
    "serve.host": _SERVE,
    "serve.port": _SERVE,
    "serve.model_name": _SERVE,
    "serve.max_requests": _SERVE,
    "serve.max_connections": _SERVE,
    "algo.gamma": (lambda c: c.algo.advantage in ("gigpo", "reinforce_pp", "gae", "evpo"),
                   "with algo.advantage=gigpo, reinforce_pp, gae or evpo", ("algo.advantage",)),
    "algo.lam": _CRITIC,
    "env.context": (lambda c: bool(c.env.name) and not c.env.name.startswith("agent:"), "with an environment's "
                    "episodes (env.name; an agent program's history is its own)", ("env.name",)),
    "env.max_context_tokens": (lambda c: c.env.context == "elide", "with env.context=elide", ("env.context",)),
    "algo.evpo_level": (lambda c: c.algo.advantage == "evpo", "with algo.advantage=evpo", ("algo.advantage",)),
    "algo.kl_mode": (lambda c: c.algo.kl_coef > 0, "with algo.kl_coef > 0", ("algo.kl_coef",)),
    "algo.dual_clip": (lambda c: c.algo.loss == "ppo_clip", "with algo.loss=ppo_clip (the other losses have no "
                       "dual clip)", ("algo.loss",)),
    "algo.overlong_buffer": (lambda c: c.algo.overlong == "punish", "with algo.overlong=punish", ("algo.overlong",)),
    **{f"critic.{k}": _CRITIC for k in CriticCfg.model_fields},
    "algo.gigpo_omega": (lambda c: c.algo.advantage == "gigpo", "with algo.advantage=gigpo", ("algo.advantage",)),
    "algo.rae_alpha": (lambda c: c.algo.advantage == "rae", "with algo.advantage=rae", ("algo.advantage",)),
    "rollout.over_provision": (lambda c: c.rollout.partial and c.run.mode != "async",
                               "with rollout.partial=true in run.mode=sync or periodic (async over-provisions "
                               "by its staleness bound)", ("rollout.partial", "run.mode")),
    "eval.size": _EVAL,
    "eval.every": _EVAL,
    "eval.samples": _EVAL,
    "eval.stop_at": _EVAL,
    "model.lora.alpha": _LORA,
    "model.lora.dropout": _LORA,
    "model.lora.targets": _LORA,
    "model.lora.per_role": _LORA,
    "model.lora.experts": _LORA,
    "teacher.coef": _TEACHER,
    "teacher.field": (lambda c: bool(c.teacher.teachers), "with teacher.teachers", ("teacher.teachers",)),
    "teacher.timeout_s": _TEACHER,
    "teacher.batch_tokens": _TEACHER_LOCAL,
    "teacher.device": _TEACHER_LOCAL,
    "teacher.dtype": _TEACHER_LOCAL,
    "teacher.model": _TEACHER_URL,
    "teacher.api_key_env": _TEACHER_URL,
    **{f"reward.judge.{k}": _JUDGE for k in ("template", "mode", "weight", "max_concurrency", "timeout_s",
                                             "max_new_tokens", "cache")},
    "reward.fn_weight": _JUDGE,
    "reward.judge.model": _JUDGE_URL,
    "reward.judge.api_key_env": _JUDGE_URL,
    "reward.judge.retries": _JUDGE_URL,
    "reward.judge.device": _JUDGE_LOCAL,
}


def owner(cfg: BaseModel, dotted: str) -> tuple[BaseModel, str]:
    """(the section holding a field, its name) for ``section.field`` or ``section.sub.field``."""
    *path, key = dotted.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return cfg, key


def inapplicable_set(cfg: BaseModel) -> list[str]:
    """Fields set explicitly (pydantic's ``model_fields_set``) where the configuration ignores them."""
    out = []
    for field, (applies, _, _) in APPLIES_ONLY.items():
        section, key = owner(cfg, field)
        if key in section.model_fields_set and not applies(cfg):
            out.append(field)
    return out

