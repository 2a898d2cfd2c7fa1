"""Teachers for on-policy distillation: the log-probs a teacher gives the tokens the student sampled.

The student samples; the teacher runs teacher-forced on the student's own token ids (one prefill, no
sampling, never re-tokenized text, which would merge tokens across the prompt/response boundary) and
returns log π_teacher of every response token, at temperature 1 (its own distribution). The trainer
turns them into the per-token advantage ``teacher.coef × (log π_teacher − log π_old)`` (``Trainer``).

Two kinds, one interface (``score(items) -> log-probs per item``, blocking; the episode runner calls it
off its event loop, in batches of the episodes that ended together, under ``teacher.timeout_s``):

- ``LocalTeacher`` (``teacher.path``): a model loaded here (a from_pretrained folder or hub id, a relayrl
  checkpoint, an adapter's merged in), its log-probs read through the trainer's own chunked head
  (``train.logprobs``: the model's map of its logits reproduced, float32 logits never held for more than
  1,024 tokens), episodes forwarded together up to ``teacher.batch_tokens``.
- ``RemoteTeacher`` (``teacher.url``): an OpenAI-compatible server's ``/completions`` with the token ids as
  the prompt, ``echo`` and ``logprobs`` (vLLM's, and any that returns the prompt's log-probs; hosted chat
  APIs return none for the prompt and cannot teach). Lengths are checked: a reply that does not cover
  every token is an error, not a shorter list.

Each teacher's tokenizer must be the student's: a teacher whose vocabulary differs scores other tokens than
the student sampled, so it is refused at start naming both (``check_tokenizer``).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

from relayrl.models import ModelError
from relayrl.rewards.remote import RemoteError, api_key, call, served_models

REMOTE = ("http://", "https://")


class TeacherError(RuntimeError):
    """A teacher that could not score (its episodes fail, counted under the failure policy)."""


class LocalTeacher:
    def __init__(self, path: str, field: str, device: str = "auto", dtype: str = "float32",
                 batch_tokens: int = 8192, chunk: int = 1024, sampling: tuple[float, int, float] = (1.0, 0, 1.0)):
        """``sampling``: (temperature, top_k, top_p) the student samples with; the teacher's log-probs are read
        under the same transform of its logits (the student's are: a student equal to its teacher has no gap)."""
        from relayrl.models.devices import resolve_device
        from relayrl.train.lora import load_model
        from relayrl.train.head_transform import HeadTransformError
        from relayrl.train.logprobs import Readout, check_head, install_head

        self.name, self.batch_tokens = f"{field}={path}", batch_tokens
        self.device = resolve_device(device, field.rsplit(".", 1)[0] + ".device")
        self.model = load_model(path, dtype, field).eval().requires_grad_(False)
        temperature, top_k, top_p = sampling
        self.readout = Readout(chunk, temperature, top_k, top_p)
        try:
            install_head(self.model, float32=False)
            check_head(self.model, self.readout)
        except HeadTransformError as e:  # (the trainer's advice, whole logits, is no teacher's: it has none)
            why = str(e).removeprefix("trainer.logprob_chunk_tokens: ").split(": set trainer.logprob_chunk_tokens=0")[0]
            raise HeadTransformError(f"{self.name}: {why}; a teacher's log-probs are read through the chunked head "
                                     "only, so this model cannot be a teacher") from None
        self.model.to(self.device)
        self.pad = 0
        self._lock = threading.Lock()  # (one forward at a time: the runner scores from several threads)

    @torch.no_grad()
    def _forward(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        n = max(len(p) + len(r) for p, r in items)
        ids = torch.full((len(items), n), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        keep = torch.zeros_like(ids, dtype=torch.bool)
        targets = torch.zeros_like(ids)
        for i, (p, r) in enumerate(items):
            seq = p + r
            ids[i, : len(seq)] = torch.tensor(seq)
            att[i, : len(seq)] = 1
            targets[i, : len(seq) - 1] = torch.tensor(seq[1:])
            keep[i, len(p) - 1 : len(seq) - 1] = True  # (position j predicts token j + 1: the response's)
        dev = self.device
        with self.readout.context(self.model, targets.to(dev), keep.to(dev), entropy=False):
            out = self.model(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False).logits[..., 0]
        out = out.float().cpu()
        return [out[i, len(p) - 1 : len(p) - 1 + len(r)].tolist() for i, (p, r) in enumerate(items)]

    def score(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """log π_teacher of each item's response tokens given its prompt and the response before them."""
        out: dict[int, list[float]] = {}
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]))
        with self._lock:
            batch: list[int] = []
            for i in order + [None]:
                longest = max([len(items[j][0]) + len(items[j][1]) for j in batch], default=0)
                if batch and (i is None or max(longest, len(items[i][0]) + len(items[i][1])) * (len(batch) + 1)
                              > self.batch_tokens):
                    for j, lp in zip(batch, self._forward([items[j] for j in batch])):
                        out[j] = lp
                    batch = []
                if i is not None:
                    batch.append(i)
        return [out[i] for i in range(len(items))]

    def close(self) -> None:
        self.model = None


class RemoteTeacher:
    def __init__(self, url: str, field: str, model: str | None = None, key_env: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3, concurrency: int = 16):
        self.url, self.name = url.rstrip("/"), f"{field}={url}"
        self.key = api_key(key_env, field.rsplit(".", 1)[0] + ".api_key_env")
        self.model = model or served_models(self.url, self.key, field)[0]
        self.timeout_s, self.retries, self.concurrency = timeout_s, retries, concurrency

    def _one(self, prompt: list[int], response: list[int]) -> list[float]:
        body = {"model": self.model, "prompt": prompt + response, "max_tokens": 1, "echo": True, "logprobs": 0,
                "temperature": 1.0}
        try:
            reply = call(self.url + "/completions", body, self.key, self.timeout_s, self.retries)
        except RemoteError as e:
            raise TeacherError(str(e)) from None
        try:
            lps = reply["choices"][0]["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise TeacherError(f"{self.url}/completions: the reply has no choices[0].logprobs.token_logprobs (does "
                               f"the server return the prompt's log-probs with echo?): {str(reply)[:200]}") from None
        got = lps[len(prompt) : len(prompt) + len(response)] if isinstance(lps, list) else []
        if len(got) != len(response) or any(not isinstance(x, (int, float)) for x in got):
            raise TeacherError(f"{self.url}/completions: log-probs for {len(got)} of the response's {len(response)} "
                               f"tokens (the prompt echoed with {len(lps) if isinstance(lps, list) else 0} entries)")
        return [float(x) for x in got]

    def score(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """A batch's calls at once (``concurrency`` of them: the server batches them as it batches generation),
        not one after the other while the batch's episodes wait (their deadline counts the wait)."""
        if len(items) <= 1:
            return [self._one(p, r) for p, r in items]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.concurrency, len(items)), thread_name_prefix="relayrl-teacher") as pool:
            return list(pool.map(lambda item: self._one(*item), items))

    def check_tokenizer(self, student, student_field: str, probes: int = 48) -> None:
        """The server's vocabulary must be the student's, as a local teacher's is (``check_tokenizer``): ``probes``
        token ids spread over the student's vocabulary, echoed back as the server's text of each; more than a
        tenth other text than the student's is another vocabulary (a renumbered one scored 1.26 nats off), one
        line naming both. A server that gives no token texts (``logprobs.tokens``) cannot be checked: refused."""
        special = set(student.all_special_ids)
        ids = [i for i in range(len(student)) if i not in special]
        probe = [ids[k * len(ids) // probes] for k in range(min(probes, len(ids)))]
        body = {"model": self.model, "prompt": probe, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 1.0}
        try:
            reply = call(self.url + "/completions", body, self.key, self.timeout_s, self.retries)
            texts = reply["choices"][0]["logprobs"]["tokens"][: len(probe)]
        except RemoteError as e:  # (at start: one line, before any work)
            raise ModelError(f"{self.name}: the request that checks its vocabulary failed: {e}") from None
        except (KeyError, IndexError, TypeError):
            raise ModelError(f"{self.name}: its /completions reply gives no token texts (choices[0].logprobs.tokens) "
                             "to check its vocabulary against the student's; a teacher must share the student's "
                             "vocabulary (vLLM's and SGLang's servers give them)") from None
        ours = [student.decode([i]) for i in probe]
        differ = [(i, a, b) for i, a, b in zip(probe, ours, texts) if a != b and b != f"token_id:{i}"]
        if len(texts) < len(probe) or len(differ) > len(probe) // 10:
            i, a, b = differ[0] if differ else (None, None, None)
            raise ModelError(f"{self.name}: its tokenizer is not the student's ({student_field}="
                             f"{getattr(student, 'name_or_path', '?')!r}): {len(differ)} of {len(probe)} token ids "
                             f"checked are other text there (id {i}: {a!r} here, {b!r} there); a teacher scores the "
                             "student's own token ids, so both must share one vocabulary (cross-tokenizer "
                             "distillation is not supported)")

    def close(self) -> None:
        pass


def check_tokenizer(teacher_path: str, field: str, student, student_field: str) -> None:
    """A local teacher's tokenizer must be the student's (the same vocabulary): one line naming both if not."""
    from relayrl.models import load_tokenizer, resolve_model_path
    from relayrl.train.lora import read_adapter

    path = resolve_model_path(teacher_path, log=lambda *a, **k: None, field=field)
    found = read_adapter(path, engine=False)
    own = found is None or any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = load_tokenizer(path if own else found[1], field=field)
    if tok.get_vocab() != student.get_vocab():
        raise ModelError(f"{field}={teacher_path!r}: its tokenizer ({len(tok)} tokens) is not the student's "
                         f"({student_field}={getattr(student, 'name_or_path', '?')!r}, {len(student)} tokens): a "
                         "teacher scores the student's own token ids, so both must share one vocabulary "
                         "(cross-tokenizer distillation is not supported)")


class Teachers:
    """The run's teachers (``teacher`` section): the default one (teacher.path or .url) and those of
    teacher.teachers by name, each prompt's chosen by its metadata field teacher.field."""

    def __init__(self, cfg, student_tokenizer, student_field: str = "model.path", prompts=(),
                 sampling: tuple[float, int, float] = (1.0, 0, 1.0)):
        self.field, self.by_name, self.default = cfg.field, {}, None
        made: list = []
        try:
            for name, where in [("", cfg.path or cfg.url), *cfg.teachers.items()]:
                if not where:
                    continue
                label = "teacher.path" if name == "" and cfg.path else "teacher.url" if name == "" else \
                    f"teacher.teachers.{name}"
                if where.startswith(REMOTE):
                    t = RemoteTeacher(where, label, cfg.model, cfg.api_key_env, cfg.timeout_s)
                    made.append(t)
                    t.check_tokenizer(student_tokenizer, student_field)
                    if sampling != (1.0, 0, 1.0):  # (a server's prompt log-probs are its raw distribution's)
                        warnings.warn(f"{label}: the server's log-probs are at temperature 1 over the whole vocabulary, "
                                      f"the student samples at (temperature, top_k, top_p) = {sampling}: the teacher's "
                                      "term then pushes even a student equal to its teacher; a local teacher "
                                      "(teacher.path) is read under the student's sampling", stacklevel=2)
                else:
                    check_tokenizer(where, label, student_tokenizer, student_field)
                    t = LocalTeacher(where, label, cfg.device, cfg.dtype, cfg.batch_tokens, sampling=sampling)
                    made.append(t)
                if name == "":
                    self.default = t
                else:
                    self.by_name[name] = t
        except BaseException:
            for t in made:
                t.close()
            raise
        for p in prompts:  # (a prompt naming no teacher there is a data error now, not a failure mid-run)
            self.for_prompt(p)

    def for_prompt(self, prompt):
        name = prompt.metadata.get(self.field) if self.by_name else None
        if name is None:
            if self.default is None:
                raise ValueError(f"prompt {prompt.id!r} has no metadata field {self.field!r} (teacher.field) naming a "
                                 f"teacher of teacher.teachers, and there is no default teacher (teacher.path or .url)")
            return self.default
        if str(name) not in self.by_name:
            raise ValueError(f"prompt {prompt.id!r}: teacher {name!r} (its metadata field {self.field!r}) is not one of "
                             f"teacher.teachers: {', '.join(self.by_name)}")
        return self.by_name[str(name)]

    def close(self) -> None:
        for t in [self.default, *self.by_name.values()]:
            if t is not None:
                t.close()
