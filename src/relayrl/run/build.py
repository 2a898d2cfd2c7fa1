"""Assembling a run: data, the verifier's pool, the model and tokenizer, the engines, the episode
runner, the trainer (and its critic). The whole ``Config`` stops here (and in the loop that calls
it): every component is handed the sections it reads.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from relayrl.algos import NEEDS_CRITIC
from relayrl.config import Config, EnvCfg, budget_bounds
from relayrl.data.datasets import PromptSampler, load_prompts
from relayrl.engine.placement import cores, open_engine, placement_note, start_ray, sync_notes, threads
from relayrl.engine.spec import engine_spec, eos_token_ids
from relayrl.envs import python_tool
from relayrl.envs.base import ADAPTERS, load_env_class, make_env_factory
from relayrl.envs.multi import Players, families, is_multi_agent
from relayrl.models import load_policy, load_tokenizer, moe, resolve_model_path, vision
from relayrl.data.lengths import check_prompt_lengths
from relayrl.models.prompts import model_context, model_context_source
from relayrl.failures import failed
from relayrl.records import SamplingParams, group_from_dict
from relayrl.rewards import RewardRunner
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.run.checkpoint import RunState
from relayrl.rollout.driver import EpisodeRollout
from relayrl.rollout.groups import make_groups
from relayrl.run.evaluation import EvalSettings, evaluate, write_report
from relayrl.serve.agent import AgentEpisodes, AgentProgram
from relayrl.train.critic import make_critic
from relayrl.tracking.timeline import Timeline
from relayrl.train import lora
from relayrl.train.trainer import Trainer


@dataclass
class Components:
    tokenizer: object
    policy: object
    engine: object
    trainer: Trainer
    reward: RewardRunner
    sampler: PromptSampler
    eval_prompts: list | None
    params: SamplingParams
    runner: EpisodeRunner  # episodes (single-turn, or with env.name's environment) on an asyncio loop
    adapter_config: dict | None = None  # model.lora: the adapter's adapter_config.json (checkpoints hold the adapter)

    @property
    def agents(self) -> bool:
        return self.runner.multi_turn

    def evaluate(self, cfg: Config, when: str = "") -> dict:
        return evaluate(self.runner, self.tokenizer, self.eval_prompts, eval_settings(cfg), when)

    def close(self) -> None:
        self.runner.close()
        self.engine.close()
        self.reward.close()
        python_tool.use_default()  # the shared python tool's workers (env.name=python) end with the run


def eval_settings(cfg: Config) -> EvalSettings:
    r = cfg.rollout
    return EvalSettings(cfg.eval.samples, cfg.eval.seed, r.temperature, r.max_new_tokens, r.top_p, r.top_k,
                        cfg.data.prompt_format, cfg.run.max_failure_frac)


def group_maker(group_size: int, prompt_format: str, tokenizer, state: RunState):
    """A function making empty groups for prompts, with ids unique over the whole run: the counter is
    part of the checkpoint, so a resumed run never reuses the id of a group it carries."""
    def new_groups(prompts: list) -> list:
        tag = f"g{state.groups_made}"
        state.groups_made += 1
        return make_groups(prompts, tokenizer, group_size, tag, prompt_format)

    return new_groups


def make_rollout(cfg: Config, c: Components, state: RunState, tl: Timeline) -> EpisodeRollout:
    """The rollout driver of ``run.mode`` over the run's runner, sampler and state."""
    r, mode = cfg.rollout, cfg.run.mode
    extra = math.ceil((r.over_provision - 1) * r.prompts_per_step) if r.partial and mode != "async" else 0
    return EpisodeRollout(
        c.runner, c.sampler.take, group_maker(r.group_size, cfg.data.prompt_format, c.tokenizer, state), c.params, r.prompts_per_step,
        {"sync": 0, "periodic": 1, "async": r.max_staleness}[mode], partial=r.partial, extra=extra,
        park_while_training=mode == "sync", drain_before_publish=mode == "periodic", version=state.version,
        carried=[group_from_dict(d) for d in state.partial_buffer], timeline=tl, counters=state.staleness,
        max_groups=(cfg.run.steps - state.step) * r.prompts_per_step, filter_groups=r.dynamic_sampling,
        filter_max=r.dynamic_sampling_max, budget=(*budget_bounds(r), r.group_size) if r.budget == "adaptive" else None,
        observe=lambda g, v: c.sampler.observe(g.prompt, [t.reward for t in g.trajectories if not failed(t)], v),
        sampler_state=c.sampler.snapshot)


def env_factory(env: EnvCfg, group_size: int | None = None, workspace=None):
    """What makes an episode's environment (``env.name``): None (single-turn), a function making one
    environment per episode, ``Players`` (a multi-agent environment: one per match, and who plays each
    role) or an ``AgentProgram`` (``env.name=agent:...``: sessions of the endpoint)."""
    if not env.name:
        return None
    kind, _, name = env.name.partition(":")
    if kind == "agent":
        if env.eval_roles:
            raise ValueError("env.eval_roles: an agent program plays its roles itself (env.roles names them)")
        return AgentProgram.load(env.name, name, env.args, env.roles, workspace)
    if kind == "textarena" and env.args.get("num_players", 1) != 1:  # a two-player game: matches
        from relayrl.envs.adapters.textarena import TextArenaMatch

        TextArenaMatch.check(name)
        args = dict(env.args)
        try:
            TextArenaMatch(name, **args)  # (its arguments checked now)
        except TypeError as e:
            raise ValueError(f"env.args do not fit TextArenaMatch: {e}") from None
        return Players.of(lambda: TextArenaMatch(name, **args), TextArenaMatch, env.name, env.roles, env.eval_roles,
                          group_size, env.vs_scripted)
    if env.name == "workspace":  # (its settings: the workspace section)
        return make_workspace_env(env, workspace)
    make = make_env_factory(env.name, env.args)
    cls = None if kind in ADAPTERS and name else load_env_class(env.name)
    if cls is not None and is_multi_agent(cls):
        return Players.of(make, cls, env.name, env.roles, env.eval_roles, group_size, env.vs_scripted)
    if env.roles or env.eval_roles:
        raise ValueError(f"env.roles/env.eval_roles: env.name={env.name} is not a multi-agent environment (no roles "
                         "list and turn(): relayrl.envs.multi.MultiAgentEnv)")
    return make


def make_workspace_env(env: EnvCfg, workspace):
    """env.name=workspace: one ``WorkspaceEnv`` per episode, with the workspace section's settings."""
    from relayrl.envs.workspace import WorkspaceEnv
    from relayrl.workspaces.episode import Settings

    if env.args or env.roles or env.eval_roles:
        raise ValueError("env.name=workspace takes no env.args, env.roles or env.eval_roles: its settings are the "
                         "workspace section's (workspace.max_workspaces, workspace.memory_mb, ...)")
    settings = Settings.of(workspace) if workspace is not None else Settings()
    return lambda: WorkspaceEnv(settings)


def make_reward_runner(cfg: Config) -> RewardRunner:
    """The verifier's isolated worker pool: here, or in a Ray actor with ``run.backend=ray``."""
    r = cfg.reward
    if r.fn == "none":  # (the reward is a judge's, or none at all: pure distillation)
        from relayrl.rewards import NoVerifier

        return NoVerifier()
    kw = {"timeout_s": r.timeout_s, "workers": r.workers, "memory_mb": r.memory_mb, "sandbox": r.sandbox,
          **({"weights": r.fn_weights} if r.fn_weights else {})}
    if cfg.run.backend == "ray":
        from relayrl.run.ray_pools import RayRewardRunner

        start_ray(cfg.ray)
        return RayRewardRunner(r.fn, **kw)
    return RewardRunner(r.fn, **kw)


def make_scoring(cfg: Config, tokenizer, prompts=(), train: bool = True) -> dict | None:
    """The runner's judge and teachers (``rollout.scoring.EpisodeScoring``'s arguments), None without either:
    a judge URL or a teacher URL that does not answer, a teacher whose tokenizer is not the policy's, a prompt
    naming no teacher there: one line each, here, before any work. ``train=False`` (relayrl eval): the judge
    only where reward.fn is 'none' (the held-out score is reward.fn's otherwise), no teachers."""
    from relayrl.rewards.judge import Judge
    from relayrl.rewards.teachers import Teachers

    j, t = cfg.reward.judge, cfg.teacher
    use_judge = bool(j.path or j.url) and (train or cfg.reward.fn == "none")
    use_teachers = train and t.on
    if not (use_judge or use_teachers):
        return None
    judge = Judge(j) if use_judge else None
    try:
        r = cfg.rollout  # (the teacher scored under the distribution the student samples from)
        teachers = Teachers(t, tokenizer, "model.tokenizer" if cfg.model.tokenizer else "model.path", prompts,
                            sampling=(r.temperature, r.top_k, r.top_p)) if use_teachers else None
    except BaseException:
        if judge is not None:
            judge.close()
        raise
    return {"judge": judge, "teachers": teachers, "fn_weight": cfg.reward.fn_weight, "judge_weight": j.weight,
            "judge_in_eval": cfg.reward.fn == "none", "teacher_timeout_s": t.timeout_s}


def load_tokenizer_for(cfg: Config, base: str, log) -> tuple[object, str]:
    """(tokenizer, its path): model.tokenizer if set, else the model's own."""
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    path = resolve_model_path(cfg.model.tokenizer, log=log, field=field) if cfg.model.tokenizer else base
    return load_tokenizer(path, cfg.data.prompt_format, field=field), path


def check_prompts_fit(cfg: Config, weights: str, tokenizer, prompts: list, eval_prompts: list | None) -> None:
    """A prompt longer than the model's context leaves after rollout.max_new_tokens is an input
    error now, naming the row, not a generation failure mid-run. The messages give the context
    length and where it was read (a model's config can say less than the user assumes)."""
    found = model_context_source(weights)
    if found is None:
        return
    context, origin = found
    field, reserved = ("env.max_tokens", cfg.env.max_tokens) if cfg.env.name else \
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
    limit, fmt = context - reserved, cfg.data.prompt_format
    if limit < 1:
        raise ValueError(f"{field}={reserved} leaves no room for a prompt: the model's context is {context} tokens "
                         f"({origin}); set {field} below {context}")
    room = f"the model's context of {context} tokens ({origin}) leaves after {field}={reserved}"
    check_prompt_lengths(prompts or [], tokenizer, limit, fmt, source=cfg.data.path, room=room)
    if eval_prompts:
        check_prompt_lengths(eval_prompts, tokenizer, limit, fmt, source=cfg.data.eval_path, room=room)


def load_data(cfg: Config) -> tuple[list, list | None]:
    """Training and held-out prompts (``DataError`` naming file and row on bad input)."""
    d = cfg.data
    fields = dict(prompt_field=d.prompt_field, answer_field=d.answer_field, id_field=d.id_field,
                  metadata_fields=d.metadata_fields, system_prompt=cfg.model.system_prompt,
                  prompt_format=d.prompt_format, image_field=cfg.vision.image_field)
    prompts = load_prompts(d.path, **fields)
    eval_prompts = load_prompts(d.eval_path, limit=cfg.eval.size, **fields) if d.eval_path else None
    return prompts, eval_prompts


def build(cfg: Config, state: RunState, ckpt: Path | None, data: tuple, log) -> Components:
    """Everything the loop needs; from checkpoint ``ckpt`` when resuming. What was started is
    closed again if a later part fails (a bad model path must not leave an engine process)."""
    own, engine_threads, trainer_threads = threads(cfg.rollout, cfg.run)
    torch.set_num_threads(trainer_threads)
    log(f"threads: trainer {trainer_threads}" + (f", engine process {engine_threads or 'torch default'}" if own else
                                                 " (the engine decodes in them)")
        + ("" if cfg.run.threads else f" ({cores()} cores, the free ones counted at start: run.threads sets them)"))
    torch.manual_seed(cfg.run.seed)
    prompts, eval_prompts = data
    d = cfg.data  # (first: a selection_key the prompts lack fails before anything starts)
    sampler = PromptSampler(prompts, cfg.run.seed, d.shuffle, state.sampler, d.selection, d.selection_pool,
                            d.selection_forget, d.selection_key, d.selection_prior)
    with contextlib.ExitStack() as undo:
        reward = make_reward_runner(cfg)  # first: a bad reward.fn fails before the model loads
        undo.callback(reward.close)
        reward.stats.failures, reward.stats.timeouts = state.reward_failures, state.reward_timeouts
        make_env = env_factory(cfg.env, cfg.rollout.group_size, cfg.workspace)
        if isinstance(make_env, Players) and cfg.rollout.budget == "adaptive":
            if "budget" in cfg.rollout.model_fields_set:  # (set by the user: said, not changed)
                raise ValueError(f"rollout.budget=adaptive does not combine with env.name={cfg.env.name}, a multi-agent "
                                 "environment: its extra responses would not fill whole matches; set "
                                 "rollout.budget=fixed")
            cfg.rollout.budget = "fixed"  # (the default where a group baseline reads variance: not for matches)
            log(f"rollout.budget: fixed for env.name={cfg.env.name}, a multi-agent environment (adaptive budgets' "
                "extra responses would not fill whole matches)")
        if cfg.run.backend == "ray":  # the python tool's worker pool in a Ray actor too (at its first call)
            from relayrl.run.ray_pools import RayPythonTool

            python_tool.use_default(RayPythonTool)
            undo.callback(python_tool.use_default)
        base = resolve_model_path(cfg.model.path, log=log)
        adapter = cfg.model.lora.r > 0  # (a checkpoint then holds the adapter only: the base is model.path)
        weights = str(ckpt) if ckpt and not adapter else base
        tokenizer, tok_path = load_tokenizer_for(cfg, base, log)
        check_prompts_fit(cfg, weights, tokenizer, prompts, eval_prompts)
        scoring = make_scoring(cfg, tokenizer, prompts)  # (a judge or teacher that cannot start: now)
        if scoring:
            undo.callback(lambda: [x.close() for x in (scoring["judge"], scoring["teachers"]) if x is not None])
        policy = load_policy(weights, cfg.model.dtype, field="checkpoint" if ckpt and not adapter else "model.path")
        vision.freeze_tower(policy, cfg.vision.train_tower)
        policy, lora_spec = load_adapter(cfg, policy, ckpt, adapter_roles(cfg, make_env))
        ref = load_policy(base, cfg.model.dtype) if cfg.algo.kl_coef > 0 and not adapter else None
        # seeded per resume point, so a resumed run does not repeat its samples; in-process, one thread
        # decodes and trains (HFEngine's driven): it decodes while it waits for episodes
        spec = engine_spec(cfg.rollout, cfg.model.dtype, weights, tok_path, state.version,
                           cfg.run.seed * 1_000_003 + state.step, engine_threads, lora_spec,
                           routes=cfg.algo.routing_replay == "r3" and moe.is_moe(policy))
        first = lora.adapter_state(policy) if adapter else policy.state_dict()
        check_sync_buckets(cfg, first, adapter)
        engine = open_engine(spec, cfg.run, cfg.ray, first, tokenizer)
        undo.callback(engine.close)
        if sync_notes(engine):  # (vLLM, Ray: the collective, or the file or Ray's store and why)
            log(f"weight updates: {sync_notes(engine)}")
        if placement_note(engine):
            log(placement_note(engine))
        if adapter:  # the engines start from the base: the adapter of this version goes to them as any update
            engine.load_weights(first, state.version)
        runner = make_runner(cfg, engine, tokenizer, reward, make_env, eos_token_ids(weights, tokenizer),
                             model_context(weights), scoring)
        runner.per_role_adapters = bool(lora.adapter_names(policy))
        undo.callback(runner.close)
        trainer = make_trainer(cfg, policy, ref)  # (a critic.path that does not load closes what was started)
        undo.pop_all()
    r = cfg.rollout
    # every episode samples from its own numbers (SamplingParams.seed): what it draws does not depend on
    # what else the engine decodes, so a run repeats itself. Not on vLLM: its per-request generators slow
    # its sampler, and its batched kernels do not repeat bit for bit anyway.
    seed = None if r.engine == "vllm" else cfg.run.seed
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, seed=seed)
    return Components(tokenizer, policy, engine, trainer, reward, sampler, eval_prompts, params, runner,
                      lora_spec.adapter_config(base) if lora_spec else None)


def check_sync_buckets(cfg: Config, weights: dict, adapter: bool) -> None:
    """rollout.sync_bucket_mb must hold the policy's largest tensor where updates may go through the collective:
    refused at start, before an engine starts."""
    if cfg.rollout.weight_sync != "file" and (cfg.run.backend == "ray" or (cfg.rollout.engine == "vllm" and not adapter)):
        from relayrl.engine.weight_sync import SyncError, metas, plan_buckets

        try:
            plan_buckets(metas(weights), cfg.rollout.sync_bucket_mb << 20)
        except SyncError as e:
            raise ValueError(str(e)) from None


def adapter_roles(cfg: Config, make_env) -> tuple[str, ...]:
    """model.lora.per_role: the roles that get an adapter, those the policy plays in training or evaluation
    (their families: ``solver#1`` and ``solver#2`` share ``solver``'s); () otherwise."""
    if not (cfg.model.lora.r and cfg.model.lora.per_role):
        return ()
    if isinstance(make_env, AgentProgram):
        return families(make_env.roles)
    if not isinstance(make_env, Players):
        raise ValueError(f"model.lora.per_role=true: env.name={cfg.env.name} is not a multi-agent environment "
                         "(one with roles): there is one role, and one adapter")
    return families(make_env.train + make_env.eval)


def load_adapter(cfg: Config, policy, ckpt: Path | None, roles: tuple[str, ...] = ()):
    """(the policy to train, the adapter's spec): with model.lora.r > 0 the policy wrapped with a fresh adapter
    (``train.lora``; ``roles``: one per role, model.lora.per_role), or the checkpoint's when resuming; else the
    policy as it is and None."""
    if not cfg.model.lora.r:
        return policy, None
    policy, spec = lora.wrap(policy, cfg.model.lora, roles)
    if ckpt is not None:
        lora.load_adapter(policy, ckpt)
    return policy, spec


ALARM_ROWS = 8  # rows of fresh tokens run.mismatch_alarm checks each step against the previous weights too


def make_trainer(cfg: Config, policy, ref=None) -> Trainer:
    """The trainer, with its critic when the advantage estimator needs one (on every torchrun rank
    alike with trainer.fsdp: the critic is sharded as the policy is)."""
    r = cfg.rollout
    critic = make_critic(cfg.critic, cfg.trainer, cfg.model.path, cfg.model.dtype, cfg.run.seed, cfg.run.steps) \
        if cfg.algo.advantage in NEEDS_CRITIC else None
    return Trainer(policy, cfg.trainer, cfg.algo, r.temperature, cfg.run.steps, cfg.algo.norm_len or r.max_new_tokens,
                   ref_model=ref, top_p=r.top_p, top_k=r.top_k, critic=critic, group_size=r.group_size,
                   check_rows=ALARM_ROWS if cfg.run.mismatch_alarm else 0,
                   teacher_coef=cfg.teacher.coef if cfg.teacher.on else 0.0)


def follower_trainer(cfg: Config) -> Trainer:
    """A torchrun follower rank's trainer (``trainer.fsdp``), built as rank 0 builds its own."""
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    base = resolve_model_path(cfg.model.path, log=lambda *a, **k: None)
    # (model.lora.per_role: the environment's roles, whose adapters rank 0's policy holds)
    roles = (adapter_roles(cfg, env_factory(cfg.env, cfg.rollout.group_size, cfg.workspace))
             if cfg.model.lora.per_role else ())
    policy, _ = load_adapter(cfg, load_policy(base, cfg.model.dtype), None, roles)  # (rank 0's weights: by broadcast)
    ref = load_policy(base, cfg.model.dtype) if cfg.algo.kl_coef > 0 and not cfg.model.lora.r else None
    return make_trainer(cfg, policy, ref)


def response_budget(cfg: Config) -> int:
    """The tokens one response may take: an episode's budget with an environment, else one generation's."""
    return cfg.env.max_tokens if cfg.env.name else cfg.rollout.max_new_tokens


def make_runner(cfg: Config, engine, tokenizer, reward: RewardRunner, make_env=None, eos_ids=None,
                context: int | None = None, scoring: dict | None = None) -> EpisodeRunner:
    """The episode runner over ``engine``: ``reward.fn`` verifies final turns, ``make_env`` (None:
    single-turn) makes each episode's environment, or is an agent program (``relayrl.serve.agent``:
    the endpoint starts, serving ``context`` tokens); ``eos_ids``: the ids the engine stops on."""
    def score_batch(items):
        return reward.score([(text, prompt.answer, dict(prompt.metadata)) for text, prompt in items])

    e, agent = cfg.env, None
    limits = EpisodeLimits(e.max_turns, e.max_tokens, e.step_timeout_s, e.episode_timeout_s, e.name, e.context,
                           e.max_context_tokens) if make_env else None
    if isinstance(make_env, AgentProgram):
        s = cfg.serve
        agent = AgentEpisodes(make_env, e.name, s.model_name, context, s.host, s.port, s.max_requests,
                              s.max_connections)
        make_env = None
    return EpisodeRunner(engine, tokenizer, make_env, limits, schedule=cfg.rollout.schedule, score_batch=score_batch,
                         eos_ids=eos_ids, agent=agent, scoring=scoring)


def describe_eval(cfg: Config, n: int, settings: str | None) -> str:
    """One line: the checkpoint, the data, how many prompts, the generation settings, the verifier."""
    r, e = cfg.rollout, cfg.eval
    env = f", env.name={cfg.env.name} (env.max_tokens={cfg.env.max_tokens})" if cfg.env.name else ""
    return (f"evaluating {cfg.model.path} on {cfg.data.eval_path}: {n} prompts (eval.size={e.size}), "
            f"{e.samples} sampled response{'s' if e.samples > 1 else ''} (temperature {r.temperature}) and one greedy "
            f"each, rollout.max_new_tokens={r.max_new_tokens}, reward.fn={cfg.reward.fn}, "
            f"data.prompt_format={cfg.data.prompt_format}{env}" + (f"; settings: {settings}" if settings else ""))


def evaluate_only(cfg: Config, out_dir: str | Path | None = None, settings: str | None = None) -> dict:
    """Evaluate model.path on data.eval_path; with ``out_dir``, write eval.json and eval_samples.jsonl there.
    What is evaluated, and how, is said first (``settings``: where the config came from)."""
    # soft_wrap: a line longer than the terminal (paths) is left to the terminal to fold, not broken
    # with newlines mid-sentence (rich folds at 80 columns when stderr is a pipe or a file)
    log = Console(stderr=True, soft_wrap=True).print
    d = cfg.data
    if not d.eval_path:
        raise ValueError("data.eval_path is not set" + (f" (settings: {settings})" if settings else "")
                         + ": nothing to evaluate; give one, data.eval_path=FILE")
    prompts = load_prompts(d.eval_path, d.prompt_field, d.answer_field, d.id_field, d.metadata_fields,
                           cfg.model.system_prompt, limit=cfg.eval.size, prompt_format=d.prompt_format)
    log(describe_eval(cfg, len(prompts), settings), markup=False, highlight=False)
    reward = make_reward_runner(cfg)
    try:
        path = resolve_model_path(cfg.model.path, log=log)
        # a LoRA checkpoint (PEFT's files): its base model in the engine, then the adapter, as a run sends it;
        # the tokenizer the checkpoint's own (a relayrl checkpoint has it), else the base's
        lora_spec, base, adapter = lora.read_adapter(path) or (None, path, None)
        own = adapter is None or any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer, tok_path = load_tokenizer_for(cfg, path if own else base, log)
        path = base
        check_prompts_fit(cfg, path, tokenizer, [], prompts)
        engine = open_engine(engine_spec(cfg.rollout, cfg.model.dtype, path, tok_path, 0, cfg.run.seed,
                                         threads(cfg.rollout, cfg.run)[1], lora_spec), cfg.run, cfg.ray, adapter,
                             tokenizer=tokenizer)
        try:  # (an adapter that does not load, or a runner that cannot start, must not leave the engine running)
            if adapter is not None:
                engine.load_weights(adapter, 0)
            runner = make_runner(cfg, engine, tokenizer, reward,
                                 env_factory(cfg.env, workspace=cfg.workspace),
                                 eos_token_ids(path, tokenizer), model_context(path),
                                 make_scoring(cfg, tokenizer, train=False))
            try:
                samples: list[dict] = []
                result = evaluate(runner, tokenizer, prompts, eval_settings(cfg), samples=samples)
            finally:
                runner.close()
        finally:
            engine.close()
        if out_dir is not None:
            from importlib.metadata import version

            __version__ = version("relayrl")

            about = {"model": cfg.model.path, "data": d.eval_path, "prompts": len(prompts), "samples": cfg.eval.samples,
                     "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
                     "reward": cfg.reward.fn, "env": cfg.env.name, "relayrl": __version__}
            report, lines = write_report(out_dir, result, samples, about)
            log(f"eval report: {report}; every response: {lines}")
        return result
    finally:
        reward.close()
