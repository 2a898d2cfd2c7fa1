"""A trajectory's per-token fields are declared once (``records.TOKEN_FIELDS``, ``CONTEXT_FIELDS``): every path
that copies, clears, cuts, branches, checkpoints or batches a trajectory keeps each of them — a single turn, a
partial rollout carried by a checkpoint, an agent program's branches and roles (with a teacher, with a mixture of
experts' routes), records restored — and no module lists them by hand again (each new field was once added to
some lists and not others: agent programs lost their teacher's log-probs and their routes)."""

import ast
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.records import (CONTEXT_FIELDS, TOKEN_FIELDS, Completion, Group, Trajectory, clear_tokens, cut_tokens,
                             group_from_dict, group_to_dict, tokens_of)
from relayrl.rollout.groups import carried_copy, expand_branches
from relayrl.rollout.scoring import EpisodeScoring
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture
from tests.test_episodes import PROMPT, ScriptedEngine
from tests.test_package import parse
from tests.test_serve import TOOLS, add, calc_reply, run, served

SRC = Path(__file__).resolve().parents[1] / "src" / "relayrl"


def full(n: int = 3, prompt: int = 4) -> Trajectory:
    """A trajectory with every per-token field set, each to values of its own."""
    t = Trajectory(PROMPT, "g", 0, list(range(prompt)))
    for k, name in enumerate(TOKEN_FIELDS):
        setattr(t, name, [float(10 * k + i) if "logprobs" in name else 1 if name == "mask" else 10 * k + i
                          for i in range(n)])
    t.routes = torch.arange(prompt + n, dtype=torch.uint8).reshape(-1, 1, 1)
    t.images = ["/a.png", "data:image/png;base64,AA=="]  # (its context's images: an environment's screenshots)
    return t


def same_tokens(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", *TOKEN_FIELDS, "images"):
        assert getattr(a, name) == getattr(b, name), name
    for name in CONTEXT_FIELDS:
        assert torch.equal(torch.as_tensor(getattr(a, name)), torch.as_tensor(getattr(b, name))), name


def test_every_field_survives_copies_checkpoints_and_branches():
    t = full()
    same_tokens(Trajectory(PROMPT, "g", 0, **tokens_of(t)), t)  # a copy
    t.complete, t.mask = False, [1, 1, 1]
    same_tokens(carried_copy(Group(PROMPT, "g", [t])).trajectories[0], t)  # a partial rollout carried
    t.complete = True
    restored = group_from_dict(json.loads(json.dumps(group_to_dict(Group(PROMPT, "g", [t])))))  # a checkpoint
    same_tokens(restored.trajectories[0], t)
    owner = Trajectory(PROMPT, "g", 0, [9], info={"branch_tokens": [tokens_of(t, json_safe=True)
                                                                     | {"finish_reason": "stop"}]})
    json.dumps(owner.info)  # (what an episode carries in info is JSON: checkpoints write it)
    g = Group(PROMPT, "g", [owner])
    expand_branches(g)  # an agent program's branch
    same_tokens(g.trajectories[1], t)
    cut_tokens(t, 2)
    assert all(len(getattr(t, name)) == 2 for name in TOKEN_FIELDS) and len(t.routes) == 4 + 2
    clear_tokens(t)
    assert all(getattr(t, name) == [] for name in TOKEN_FIELDS) and t.routes is None and t.images is None


def test_no_module_lists_the_per_token_fields_by_hand():
    """A tuple or list of string literals naming two or more of the per-token fields, anywhere but records.py."""
    names = set(TOKEN_FIELDS) | set(CONTEXT_FIELDS)
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "records.py":
            continue
        tree = parse(path)
        slots = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)  # (a class's own attributes)
                 and any(getattr(x, "id", None) == "__slots__" for x in n.targets)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in slots:
                listed = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(listed & names) >= 2:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, f"per-token fields listed by hand (use records.TOKEN_FIELDS / tokens_of): {found}"


class RoutedEngine(ScriptedEngine):
    """A scripted engine that records routes, as a mixture of experts' engine does: for every token of the
    context it fed forward, here its position (one layer, top-1)."""

    def get(self, timeout=None):
        out = super().get(timeout)
        return [Completion(c.request_id, c.token_ids, c.logprobs, c.versions, c.finish_reason,
                           routes=None if c.finish_reason is None else self.context_routes(c)) for c in out]

    def context_routes(self, c):
        n = self.contexts.pop(c.request_id) + len(c.token_ids)
        return (np.arange(n) % 251).astype(np.uint8).reshape(n, 1, 1)

    def submit(self, requests):
        self.contexts = getattr(self, "contexts", {})
        for r in requests:
            self.contexts[r.request_id] = len(r.prompt_ids) + len(r.response_so_far)
        super().submit(requests)


async def rewrites(client, prompt):
    """An agent program whose second request rewrites its history: two branches."""
    first = await client.chat.completions.create(model="policy", messages=prompt.messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    await client.chat.completions.create(model="policy", messages=prompt.messages + [
        {"role": "user", "content": f"<tool_response>\n{add(**json.loads(call.function.arguments))}\n"}], tools=TOOLS)
    return 1.0


@pytest.fixture()
def branched(chatml_tokenizer):  # noqa: F811
    """One agent-program episode with a rewritten history, its engine recording routes."""
    runner = served(chatml_tokenizer, calc_reply, rewrites)
    runner.engine.engine = RoutedEngine(chatml_tokenizer, calc_reply)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.failure is None and t.info["branches"] == 1
    return t


def test_an_agent_programs_branches_keep_the_routes_the_engine_chose(branched):
    """algo.routing_replay=r3 with an agent program replayed nothing: the episode and its branches lost their
    routes (0% of trained tokens routed as the engine routed them)."""
    g = Group(PROMPT, "g", [branched])
    expand_branches(g)
    assert len(g.trajectories) == 2
    for t in g.trajectories:
        n = len(t.prompt_ids) + len(t.response_ids)
        assert t.routes is not None and len(t.routes) >= n - 1, t.request_id  # (the last token is never fed)
        assert torch.equal(torch.as_tensor(t.routes)[:n - 1, 0, 0], torch.arange(n - 1) % 251)


def test_an_agent_programs_branches_get_their_teachers_log_probs(branched):
    """On-policy distillation with an agent program whose history branches stopped the run ("every trajectory of
    a batch needs its teacher's log-probs"): each branch is taught as its episode is."""
    seen = []

    async def taught(teacher, ids):
        seen.append(ids)
        return [-float(i + 1) for i in range(len(ids[1]))]

    scoring = EpisodeScoring.__new__(EpisodeScoring)
    scoring._taught = taught
    asyncio.run(scoring._teach(branched, teacher=None))
    g = Group(PROMPT, "g", [branched])
    expand_branches(g)
    assert len(seen) == 2 and len(g.trajectories) == 2
    for t in g.trajectories:
        want = [-float(i + 1) if m else 0.0 for i, m in enumerate(t.mask or [1] * len(t.response_ids))]
        assert t.teacher_logprobs == want and len(want) == len(t.response_ids)
    from relayrl.config import AlgoCfg
    from relayrl.rollout.groups import training_batch

    batch, _ = training_batch([g], AlgoCfg(), 256, 0)  # (it refused a batch where a branch had none)
    assert batch.teacher_logp is not None
