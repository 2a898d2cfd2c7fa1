"""The learning sections of the configuration: the algorithm (``algo``), the critic (``critic``) and the
trainer (``trainer``), every field typed, bounded and documented where it is defined."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relayrl.config.sections import _Section


class AlgoCfg(_Section):
    """Advantages, policy loss, off-policy correction, aggregation, KL, overlong handling. Each is
    chosen by name from a registry (``relayrl.algos``) and any choice combines with any other."""

    preset: Literal["relayrl", "grpo"] = Field(
        "relayrl", description="The algorithm in one word; any field set beside it wins. relayrl (the default): "
        "GRPO's group-normalised advantages with PPO's clip widened above (clip-higher: ε 0.2 below, 0.28 above, "
        "DAPO), dual-clip 3, the token-mean loss (DAPO), KL β=0.05 (k3, in the loss), and, with a group baseline, "
        "adaptive budgets and dynamic sampling (rollout.budget, rollout.dynamic_sampling: groups with no reward "
        "variance replaced). grpo: GRPO as DeepSeekMath defines it (arXiv 2402.03300): advantages (r − mean)/std "
        "per group, PPO's clip ε=0.2 both ways, no dual-clip, each response's token mean averaged over the "
        "group (agg=seq_mean_token_mean), KL β=0.04 (k3, in the loss), every group its group_size responses "
        "(rollout.budget=fixed, rollout.dynamic_sampling=false).")
    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo (group baselines), reinforce_pp (whitened "
        "token returns), reinforce_pp_baseline (group mean subtracted, then whitened), gae (PPO: a learned critic, "
        "see the critic section), evpo (the critic when its explained variance on the batch is > 0, else the "
        "batch-mean baseline), gigpo (agents: step-level credit), rae (multi-agent: SPIRAL's running baseline per game "
        "and role).")
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
    routing_replay: Literal["off", "r3"] = Field(
        "off", description="Mixture-of-experts policies: r3 (rollout routing replay, arXiv 2510.11370): the trainer's "
        "forwards (π_old, the policy's, the KL reference's) send each token to the experts the engine chose for it "
        "(recorded by the hf engine), the gate weights recomputed from the live router so it still learns; off: "
        "routed live. Either way moe/routing_diff reports the share of tokens whose experts differ between engine "
        "and trainer. No effect on a dense model.")
    router_aux_coef: float = Field(
        0.0, ge=0, description="Mixture-of-experts policies: weight of the routers' load-balancing loss (Switch "
        "Transformer's, per layer) in the policy loss. 0 (off), as RL peers keep it: it pulls the routers toward an "
        "even load whatever the reward says, which moves routing away from what the engine sampled with.")
    reward_coef: float = Field(
        1.0, ge=0, description="Weight of the advantage from the reward (verifier, judge, environment) in the loss; "
        "with a teacher (teacher.path/.url) its per-token term is added beside it. 0: pure on-policy distillation "
        "(no verifier needed: reward.fn=none).")
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
    rae_alpha: float = Field(0.95, ge=0, lt=1, description="advantage=rae: decay α of each game and role's running "
                             "baseline, b ← α·b + (1 − α)·R (SPIRAL's 0.95).")

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
    pack: bool = Field(
        False, description="Padding-free micro-batches: a micro-batch's rows concatenated end to end into one "
        "sequence of their real tokens (at most trainer.micro_batch_tokens), position ids restarting at each row, "
        "attention confined to each row (transformers' packed-sequence masking): the same log-probs and gradient as "
        "padded rows, without computing the padding. It pays where rows differ in length (a long tail of responses) "
        "and with a varlen attention kernel (flash attention on a GPU); on a CPU, SDPA computes every row pair's "
        "attention block of a packed sequence, so many short rows cost more attention packed than padded. Off by "
        "default: on the demo (short rows grouped by length) padding is already small (see benchmarks/"
        "trainer_memory.py for the padding fraction of a long-tail batch). Where trainer.share_prefix forwards a "
        "group's prompt once, its micro-batches of responses stay padded.")
    logprob_chunk_tokens: int = Field(
        1024, ge=0, description="Apply the LM head this many tokens at a time, forward and backward, for the "
        "log-probs and entropy (relayrl.train.logprobs): float32 logits are never held for more tokens than this (a "
        "16k-token micro-batch of a 152k vocabulary holds 10 GB of them at once otherwise, and as much again for "
        "their gradient), and only the trained positions are computed. The same values and gradients (to float "
        "rounding). 0: whole logits. A chunk's softmax, log-softmax and entropy hold a few vocabulary-sized "
        "tensors per token (~2.4 MB a token at 152k), so 1024 (SkyRL's; prime-rl: 8192): a Qwen2.5-0.5B-shaped step "
        "over two rows of 1,024 tokens peaked at 10.7 GiB with 1024 and 13.3 GiB with 4096, every memory feature "
        "on (benchmarks/trainer_memory.py, AMD EPYC). The demo's step is no slower with it (a 64-row, 2,240-token "
        "demo batch, one thread on a busy 2-core CPU, median of 12 and 18 interleaved steps: 0.377 and 0.514 s "
        "with 4096 against 0.437 and 0.507 s with 0; its trained tokens fit one chunk of 1024 too).")
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
