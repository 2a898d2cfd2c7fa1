"""The sections of learning from teachers: ``sft`` (supervised fine-tuning, ``relayrl sft``) and ``teacher``
(on-policy distillation). (A judge, which gives a reward, is ``reward.judge``: ``sections.JudgeCfg``.)"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.sections import _Section


class SftCfg(_Section):
    """relayrl sft: supervised fine-tuning on demonstrations (data.path; data.response_field)."""

    epochs: float | None = Field(
        None, gt=0, description="Passes over the data; sets run.steps to ⌈epochs × examples / sft.batch_size⌉ "
        "(null: run.steps).")
    batch_size: int = Field(
        32, ge=1, description="Examples per optimiser step (split into micro-batches by trainer.micro_batch_tokens; "
        "the loss is the mean over every supervised token of the batch).")


class TeacherCfg(_Section):
    """On-policy distillation: a teacher scores every token the policy samples (teacher.path or teacher.url)."""

    path: str | None = Field(
        None, description="The teacher: a from_pretrained folder or hub id, or a relayrl checkpoint (a LoRA "
        "adapter's too), run teacher-forced on the student's tokens on teacher.device. Its tokenizer must be the "
        "student's (cross-tokenizer distillation is not supported: refused at start).")
    url: str | None = Field(
        None, description="The teacher as an OpenAI-compatible server's base URL (vLLM's `vllm serve`, relayrl's "
        "tests' server): /completions with the prompt as token ids, echo and logprobs (the prompt's log-probs; "
        "hosted chat APIs do not return them). Checked at start.")
    model: str | None = Field(None, description="teacher.url: the model name requests name (null: the server's "
                              "first in /models).")
    api_key_env: str | None = Field(None, description="teacher.url: the environment variable holding the API key "
                                    "(never logged or written).")
    coef: float = Field(
        1.0, ge=0, description="λ: each trained token's advantage gets λ·(log π_teacher − log π_old) of the token "
        "(the per-token reverse KL's policy gradient, undiscounted: Thinking Machines' and tinker's OPD), beside "
        "algo.reward_coef × the verifier's advantage (not normalised by the group: that would z-score it away).")
    teachers: dict[str, str] = Field(
        default_factory=dict, description="Several teachers by name (a path or a URL each); a prompt's metadata field "
        "teacher.field names its teacher (data.metadata_fields must carry it); prompts without one get teacher.path "
        "or teacher.url.")
    field: str = Field("teacher", description="The prompt metadata field naming a teacher of teacher.teachers.")
    timeout_s: float = Field(120.0, gt=0, description="Deadline of one scoring call (a batch of episodes); past it "
                             "the episodes fail (counted, never trained).")
    batch_tokens: int = Field(8192, ge=1, description="teacher.path: tokens the teacher forwards at once (episodes "
                              "ending together are scored in one forward up to this).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="teacher.path: where it runs.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="teacher.path: its weights' dtype.")

    @property
    def on(self) -> bool:
        return bool(self.path or self.url or self.teachers)
