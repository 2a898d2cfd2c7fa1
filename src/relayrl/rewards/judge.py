"""Judges: a model that scores responses where no verifier exists (open answers, agent tasks), or beside one.

Two modes (``reward.judge.mode``):

- ``pointwise``: each response alone, against a rubric; its reply ends with a score in [0, 1].
- ``ranking``: one call sees a whole group and scores each member (OpenPipe ART's RULER): GRPO needs only the
  order within a group, and a judge compares better than it calibrates. A reply that cannot be read fails
  every episode of the group (counted, never a 0).

Served by relayrl's own engine (``reward.judge.path``: ``HFEngine`` on the judge's weights, greedy), or by
any OpenAI-compatible server (``reward.judge.url``: ``/chat/completions``, greedy, key from an environment
variable, retried with backoff on transient errors: ``relayrl.rewards.remote``). Calls run at most
``reward.judge.max_concurrency`` at once, each under ``reward.judge.timeout_s``; scores are cached by
(judge, rendered prompt), which holds the template, the prompt, the response(s), the answer and metadata.

A reply that cannot be parsed, or a call that still fails after its retries, is a ``JudgeFailure``: the
episode fails (kind ``judge``; ``judge_timeout`` past the deadline), its record keeps the first 200
characters of the reply, and ``run.max_failure_frac`` decides when the run stops. Judges can be fooled
("One Token to Fool LLM-as-a-Judge", arXiv 2507.08794): a reference answer in the template, a strict
score line and a judge from another family than the policy help; the default templates ask for a score
line the parser reads from the end of the reply only.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import threading
from pathlib import Path

from relayrl.records import Prompt
from relayrl.rewards.remote import RemoteError, api_key, call, served_models

POINTWISE = """You are grading a response to a task.

Task:
{prompt}

Reference answer (empty if there is none): {answer}

Response to grade:
{response}

Grade how well the response accomplishes the task: 1 if it is correct and complete, 0 if it is wrong or does \
not answer, partial credit in between. Write at most two sentences of reasoning, then a last line \
"Score: X" with X a number from 0 to 1."""

RANKING = """You are comparing {n} responses to the same task, to rank them against each other.

Task:
{prompt}

Reference answer (empty if there is none): {answer}

{responses}

Score each response from 0 to 1: a response that achieves the task scores far above one that does not; \
among those, better reasoning and fewer mistakes score higher; responses of similar quality get similar \
scores, and partial progress gets partial credit. Write at most one sentence per response, then a last line \
"Scores: " followed by the {n} scores in the responses' order, separated by commas."""

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCORE = re.compile(rf"score\s*[:=]?\s*\**\s*({_NUMBER})\s*(?:/\s*({_NUMBER})|out of\s*({_NUMBER}))?", re.I)


class JudgeFailure(RuntimeError):
    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


def parse_score(reply: str) -> float:
    """The score a pointwise reply gives on its score line: 'Score: 0.8', 'Score: 8/10', 'Score: 8 out of 10'
    (divided; the last such line counts), or a reply that is a number and nothing else ('0.8'). Strict: the
    last number of a longer reply is not taken for its score (an untrained judge's reasoning ends in numbers
    that are not scores: 14 of 38 replies in one run). ``JudgeFailure`` quoting the reply where there is no score
    line, or the score is outside [0, 1]."""
    text = reply.strip()
    found = list(_SCORE.finditer(text))
    if found:
        m = found[-1]
        value, over = float(m.group(1)), m.group(2) or m.group(3)
    else:
        alone = re.fullmatch(rf"\**({_NUMBER})\**\.?", text)
        if alone is None:
            raise JudgeFailure(f"no score in the judge's reply (a 'Score: X' line, X in [0, 1], or a reply that is "
                               f"only a number): {reply[:200]!r}")
        value, over = float(alone.group(1)), None
    if over is not None:
        if float(over) <= 0:
            raise JudgeFailure(f"a score out of {over} in the judge's reply: {reply[:200]!r}")
        value /= float(over)
    if not 0.0 <= value <= 1.0:
        raise JudgeFailure(f"the judge's score {value:g} is outside [0, 1]: {reply[:200]!r}")
    return value


def parse_scores(reply: str, n: int) -> list[float]:
    """The ``n`` scores a ranking reply ends with ('Scores: 0.2, 1, 0.5'), each in [0, 1]."""
    found = list(re.finditer(r"scores\s*[:=]\s*(.+)$", reply.strip(), re.I | re.M))
    if not found:
        raise JudgeFailure(f"no 'Scores:' line in the judge's reply: {reply[:200]!r}")
    values = [float(x) for x in re.findall(_NUMBER, found[-1].group(1))]
    if len(values) != n:
        raise JudgeFailure(f"{len(values)} scores for {n} responses in the judge's reply: {reply[:200]!r}")
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise JudgeFailure(f"a score outside [0, 1] in the judge's reply: {reply[:200]!r}")
    return values


def prompt_text(messages: list[dict]) -> str:
    """A prompt's messages as text for the judge (one message: its content)."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class LocalJudge:
    """The judge's weights in relayrl's own engine (``HFEngine``), greedy; one batch of calls at a time."""

    def __init__(self, path: str, device: str, max_new_tokens: int):
        from relayrl.engine.hf import HFEngine
        from relayrl.models import load_tokenizer, resolve_model_path
        from relayrl.models.devices import resolve_device
        from relayrl.train.lora import load_model

        self.name = f"reward.judge.path={path}"
        local = resolve_model_path(path, log=lambda *a, **k: None, field="reward.judge.path")
        self.tokenizer = load_tokenizer(local, "chat", field="reward.judge.path")
        model = load_model(path, "float32", "reward.judge.path").to(resolve_device(device, "reward.judge.device"))
        self.engine = HFEngine(model, self.tokenizer, max_batch=64)
        self.max_new_tokens = max_new_tokens
        self._lock = threading.Lock()  # (Engine.generate: one consumer at a time)
        self._n = 0

    def complete(self, texts: list[str], timeout_s: float) -> list[str]:
        from relayrl.models.prompts import encode_prompt
        from relayrl.records import GenRequest, SamplingParams

        params = SamplingParams(self.max_new_tokens, temperature=0.0)
        with self._lock:
            reqs = []
            for text in texts:
                self._n += 1
                reqs.append(GenRequest(f"judge-{self._n}", encode_prompt(self.tokenizer, [{"role": "user",
                                                                                           "content": text}]), params))
            done = self.engine.generate(reqs)
        return [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in done]

    def close(self) -> None:
        self.engine.close()


class RemoteJudge:
    """An OpenAI-compatible server's ``/chat/completions``, greedy."""

    def __init__(self, url: str, model: str | None, key_env: str | None, retries: int, max_new_tokens: int):
        self.url, self.name = url.rstrip("/"), f"reward.judge.url={url}"
        self.key = api_key(key_env, "reward.judge.api_key_env")
        self.model = model or served_models(self.url, self.key, "reward.judge.url")[0]
        self.retries, self.max_new_tokens = retries, max_new_tokens

    def _one(self, text: str, timeout_s: float) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_new_tokens}
        try:
            reply = call(self.url + "/chat/completions", body, self.key, timeout_s, self.retries)
        except RemoteError as e:
            raise JudgeFailure(str(e), timeout="timed out" in str(e) or "TimeoutError" in str(e)) from None
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise JudgeFailure(f"{self.url}/chat/completions: no choices[0].message.content in the reply: "
                               f"{json.dumps(reply)[:200]}") from None

    def complete(self, texts: list[str], timeout_s: float) -> list[str | JudgeFailure]:
        out: list = [None] * len(texts)
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(texts), 64))) as pool:
            futs = {pool.submit(self._one, t, timeout_s): i for i, t in enumerate(texts)}
            for f, i in futs.items():
                try:
                    out[i] = f.result()
                except JudgeFailure as e:
                    out[i] = e
        return out

    def close(self) -> None:
        pass


class Judge:
    """``reward.judge``: scores (``score_pointwise``, ``score_groups``), each a float or a ``JudgeFailure``."""

    def __init__(self, cfg):
        self.cfg, self.mode = cfg, cfg.mode
        if cfg.template is not None:
            p = Path(cfg.template)
            try:
                # (less the file's final newline, as Jinja reads a template: an editor adds it, and a judge
                # fine-tuned on prompts without it reads one more token than it learned on)
                self.template = p.read_text(encoding="utf-8").removesuffix("\n")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"reward.judge.template={cfg.template!r}: cannot read it: {e}") from None
        else:
            self.template = POINTWISE if cfg.mode == "pointwise" else RANKING
        need = "{response}" if cfg.mode == "pointwise" else "{responses}"
        if need not in self.template:
            raise ValueError(f"reward.judge.template={cfg.template!r}: a {cfg.mode} template must contain {need}")
        # filled once now with placeholders: a field it names that a judge does not have fails at start, not at the
        # first scored episode (nor, in ranking mode, outside the failure accounting)
        self._render(Prompt("p", [{"role": "user", "content": "x"}], "a"),
                     **({"response": "r"} if cfg.mode == "pointwise" else {"responses": "r", "n": 1}))
        self.backend = LocalJudge(cfg.path, cfg.device, cfg.max_new_tokens) if cfg.path else \
            RemoteJudge(cfg.url, cfg.model, cfg.api_key_env, cfg.retries, cfg.max_new_tokens)
        self.name = self.backend.name
        self._slots = threading.Semaphore(cfg.max_concurrency)
        self._cache: dict[str, float | list[float]] = {}
        self._cache_lock = threading.Lock()

    def _render(self, prompt, **parts) -> str:
        fields = {"prompt": prompt_text(prompt.messages), "answer": prompt.answer or "",
                  "metadata": json.dumps(prompt.metadata, default=str, ensure_ascii=False), **parts}
        try:
            return self.template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"reward.judge.template={self.cfg.template!r}: cannot fill it ({type(e).__name__}: "
                             f"{e}); its fields are {', '.join(fields)} (a literal brace is written {{{{ or }}}})") from None

    def _run(self, texts: list[str], parsers: list) -> list:
        """Scores of rendered ``texts``, each reply read by its parser (cached, else asked for ``max_concurrency``
        at a time); a ``JudgeFailure`` where the call or the parser failed."""
        out: list = [None] * len(texts)
        keys = [hashlib.sha256(f"{self.name}\0{t}".encode()).hexdigest() for t in texts]
        todo = []
        with self._cache_lock:
            for i, k in enumerate(keys):
                if self.cfg.cache and k in self._cache:
                    out[i] = self._cache[k]
                else:
                    todo.append(i)
        for start in range(0, len(todo), self.cfg.max_concurrency):
            part = todo[start : start + self.cfg.max_concurrency]
            with self._slots:
                replies = self.backend.complete([texts[i] for i in part], self.cfg.timeout_s)
            for i, reply in zip(part, replies):
                if isinstance(reply, JudgeFailure):
                    out[i] = reply
                    continue
                try:
                    out[i] = parsers[i](reply)
                except JudgeFailure as e:
                    out[i] = e
                    continue
                if self.cfg.cache:
                    with self._cache_lock:
                        self._cache[keys[i]] = out[i]
        return out

    def score_pointwise(self, items: list[tuple[object, str]]) -> list:
        """(prompt, response) -> a score in [0, 1] or a JudgeFailure, per item."""
        return self._run([self._render(p, response=r) for p, r in items], [parse_score] * len(items))

    def score_groups(self, items: list[tuple[object, list[str]]]) -> list:
        """(prompt, the group's responses) -> the list of their scores or a JudgeFailure, per group."""
        texts = [self._render(p, responses="\n\n".join(f"Response {i + 1}:\n{r}" for i, r in enumerate(rs)),
                              n=len(rs)) for p, rs in items]
        return self._run(texts, [lambda reply, n=len(rs): parse_scores(reply, n) for _, rs in items])

    def close(self) -> None:
        self.backend.close()
