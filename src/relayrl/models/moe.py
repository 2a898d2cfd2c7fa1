"""Mixture-of-experts policies: their routers found, the experts each token was sent to recorded, and replayed.

An engine and a trainer route a token to different experts when their numbers differ by a rounding (another
dtype, batch shape or kernel): top-k is discontinuous, so a near tie flips, and the trainer's log-prob is then
not the sampling policy's. Routing replay (R3, arXiv 2510.11370) records the experts the engine chose for every
token it fed forward (``Recorder``) and makes the trainer's forwards use them (``replay``): only the discrete
selection is replayed; the gate weights are recomputed from the live router's logits at those experts with the
family's own formula, so the router still gets a gradient through them.

Routes are ``[tokens, moe_layers, top_k]`` uint8 (≤ 255 experts; 255 = "no route recorded: route live"), keyed by
the MoE layers in model order (dense layers have no router). A route at position i is the expert choice for the
token fed at i; the last sampled token is never fed, so a sequence of n tokens has n - 1 routes.

Families (transformers 5.19's router modules, ``forward(hidden [T, H])``): the output's order and how the gate
weights follow from the logits at the chosen experts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

NO_ROUTE = 255  # a position with no recorded route (padding, or a token the engine never fed): routed live


def _softmax_gather(renorm: Callable[[torch.nn.Module], bool]):
    def weights(router, logits, idx, like):
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        if renorm(router):
            w = w / w.sum(-1, keepdim=True)
        return w.to(like.dtype)
    return weights


def _topk_softmax(router, logits, idx, like):  # granitemoe: softmax over the k chosen logits
    return torch.softmax(logits.float().gather(1, idx), dim=-1).to(like.dtype)


def _sigmoid_gather(router, logits, idx, like):  # deepseek_v3: the group top-k's bias never enters the weights
    w = logits.float().sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * router.routed_scaling_factor).to(like.dtype)


@dataclass(frozen=True)
class Family:
    order: tuple[int, int, int]  # where (logits, weights, indices) sit in the router's output
    weights: Callable  # (router, logits [T, E], indices [T, k], the live weights) -> weights [T, k]


_QWEN = Family((0, 1, 2), _softmax_gather(lambda r: bool(getattr(r, "norm_topk_prob", False))))
FAMILIES = {
    "Qwen3MoeTopKRouter": _QWEN,
    "Qwen2MoeTopKRouter": _QWEN,
    "OlmoeTopKRouter": _QWEN,
    "MixtralTopKRouter": Family((0, 1, 2), _softmax_gather(lambda r: True)),
    "GraniteMoeTopKRouter": Family((2, 1, 0), _topk_softmax),
    "GptOssTopKRouter": Family((0, 1, 2), _topk_softmax),  # (its logits carry the router's bias)
    "DeepseekV3TopkRouter": Family((0, 1, 2), _sigmoid_gather),  # (only the final top-k is replayed)
}


class MoEError(ValueError):
    pass


def routers(model) -> list[tuple[torch.nn.Module, Family]]:
    """The model's MoE routers in model order (its first MoE layer's first; dense layers have none); [] for a dense
    model. A router relayrl has no recipe for raises (replayed with the wrong weight formula, it would train
    another model)."""
    found = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls.endswith(("TopKRouter", "TopkRouter")):
            if cls not in FAMILIES:
                raise MoEError(f"routing: {cls} ({name}) is a router relayrl has no recipe for; supported: "
                               f"{', '.join(sorted(FAMILIES))}")
            found.append((m, FAMILIES[cls]))
    return found


def is_moe(model) -> bool:
    return any(type(m).__name__.endswith(("TopKRouter", "TopkRouter")) for m in model.modules())


def replayable(model) -> bool:
    """A mixture of experts whose routers relayrl can record and replay (``FAMILIES``)."""
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))}
    return bool(names) and names <= set(FAMILIES)


def no_jitter(model) -> None:
    """Mixtral's router jitter (its inputs times uniform noise in train mode) off: it would route a training
    forward differently from the engine's, whatever is replayed."""
    for m in model.modules():
        if getattr(m, "jitter_noise", 0):
            m.jitter_noise = 0.0


def shape(model) -> tuple[int, int]:
    """(MoE layers, experts per token)."""
    rs = routers(model)
    return len(rs), int(rs[0][0].top_k)


class Recorder:
    """Each forward's selected experts, per router, while ``capture()`` is open: ``[T, layers, k]`` uint8 in the
    order the forward's hidden states are flattened (rows of the batch, then positions)."""

    def __init__(self, model):
        self._routers = routers(model)
        if any(int(getattr(r, "num_experts", 0)) >= NO_ROUTE for r, _ in self._routers):
            raise MoEError(f"routing: a model with {NO_ROUTE} or more experts needs wider route ids than uint8")
        self._got: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def capture(self):
        self._got = {}

        def hook(i, fam):
            def record(module, args, out):
                self._got[i] = out[fam.order[2]].detach().to(torch.uint8)
            return record

        handles = [r.register_forward_hook(hook(i, fam)) for i, (r, fam) in enumerate(self._routers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def routes(self) -> torch.Tensor:
        """The last forward's routes, [T, layers, k] uint8 on the CPU."""
        return torch.stack([self._got[i] for i in range(len(self._routers))], dim=1).cpu()


@dataclass
class RouteStats:
    """What the trainer's forwards saw: tokens with a recorded route, those whose live expert set differs from
    the recorded one in at least one layer (``moe/routing_diff``), and the tokens each expert took."""

    tokens: int = 0
    differ: int = 0
    load: torch.Tensor | None = None  # [layers, experts]: tokens sent to each expert (the experts used)

    def take(self) -> dict[str, float]:
        out = {}
        if self.tokens:
            out["moe/routing_diff"] = self.differ / self.tokens
        if self.load is not None and self.load.sum():
            # load balance: the busiest expert's share over the mean share (1.0: even), averaged over the layers
            share = self.load / self.load.sum(-1, keepdim=True).clamp(min=1)
            out["moe/load_max_over_mean"] = float((share.max(-1).values * self.load.shape[-1]).mean())
        self.tokens, self.differ, self.load = 0, 0, None
        return out


class Replayer:
    """Hooks on every router of ``model``, installed once: a forward after ``use(routes)`` ([T, layers, k] uint8,
    ``NO_ROUTE`` where none was recorded; T: the forward's tokens, flattened as its hidden states are) routes by
    them where ``replace`` (``algo.routing_replay=r3``), and in any case compares the live choices with them
    (``stats``). The routes stay set until the next ``use``, so activation checkpointing's recompute in the
    backward pass replays the same ones (the hooks are keyed by router, whatever the recompute's order);
    ``use(None)``: route live, count nothing."""

    def __init__(self, model, replace: bool):
        self._routers = routers(model)
        self.replace, self.stats = replace, RouteStats()
        self.measuring = False  # (a forward routed live to measure, where the others replay: ``PolicyForward``)
        self.keep_logits = False  # algo.router_aux_coef: each router's logits and choice kept for ``aux_loss``
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.routes: torch.Tensor | None = None
        self._counted: set[int] = set()
        self._differ: torch.Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook(i, fam)) for i, (r, fam) in enumerate(self._routers)]

    def use(self, routes: torch.Tensor | None, count: bool = True) -> None:
        """``count=False``: the forward is not counted in ``stats`` (another model's weights in this one's place)."""
        if routes is not None and routes.shape[1] != len(self._routers):
            raise MoEError(f"routing replay: routes for {routes.shape[1]} MoE layers, the model has "
                           f"{len(self._routers)}")
        self.routes, self._differ, self.kept = routes, None, {}
        self._counted = set() if count else set(range(len(self._routers)))

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, i: int, fam: Family):
        def swap(module, args, out):
            logits, weights, live = (out[j] for j in fam.order)
            if self.routes is None:
                if self.keep_logits and torch.is_grad_enabled():
                    self.kept[i] = (logits, live)
                return None
            if live.shape[0] != self.routes.shape[0]:
                raise MoEError(f"routing replay: {live.shape[0]} tokens in the forward, {self.routes.shape[0]} routes")
            rec = self.routes[:, i].to(device=live.device, dtype=torch.long)
            has = (self.routes[:, i, 0] != NO_ROUTE).to(live.device)
            used = torch.where(has[:, None], rec, live) if self.replace else live
            if i not in self._counted:  # (once per forward: not again in a checkpointed layer's recompute)
                self._count(i, live, rec, has, used, logits.shape[-1])
            if self.keep_logits and torch.is_grad_enabled():
                self.kept[i] = (logits, used)
            if not self.replace:
                return None
            parts = [None, None, None]
            parts[fam.order[0]], parts[fam.order[2]] = logits, used
            parts[fam.order[1]] = fam.weights(module, logits, used, weights)
            return tuple(parts)
        return swap

    def _count(self, i, live, rec, has, used, experts) -> None:
        self._counted.add(i)
        with torch.no_grad():
            differ = (torch.sort(live, -1).values != torch.sort(rec, -1).values).any(-1) & has
            self._differ = differ if self._differ is None else self._differ | differ
            s = self.stats
            if s.load is None or s.load.shape != (len(self._routers), experts):
                s.load = torch.zeros(len(self._routers), experts)
            s.load[i] += torch.bincount(used[has].reshape(-1).cpu(), minlength=experts).float()
            if len(self._counted) == len(self._routers):
                s.tokens += int(has.sum())
                s.differ += int(self._differ.sum())


def aux_loss(kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The load-balancing loss (Switch Transformer's, as transformers' MoE models compute it) of the routers' logits
    [T, E] and the experts each token used [T, k], per layer, averaged over the layers: E · Σ_e f_e · P_e, with f_e
    the share of tokens sent to expert e (summed over the k slots) and P_e the mean router probability of e. k when
    the load is even; it grows as the routers favour some experts."""
    losses = []
    for logits, used in kept.values():
        E = logits.shape[-1]
        f = torch.nn.functional.one_hot(used.long(), E).sum(1).float().mean(0)  # [E]
        p = torch.softmax(logits.float(), dim=-1).mean(0)  # [E]
        losses.append(E * (f * p).sum())
    return torch.stack(losses).mean()


def routes_tensor(trajs, n: int, layers: int, k: int) -> torch.Tensor:
    """[N, n, layers, k] uint8: each trajectory's recorded routes at its token positions (right-padded as the
    batch's ``input_ids``), ``NO_ROUTE`` where none (padding, the last token, a trajectory without routes)."""
    out = torch.full((len(trajs), n, layers, k), NO_ROUTE, dtype=torch.uint8)
    for i, t in enumerate(trajs):
        r = t.routes
        if r is not None and len(r):
            r = torch.as_tensor(r)
            if r.shape[1:] != (layers, k):
                raise MoEError(f"routing replay: trajectory {t.request_id} has routes of shape {tuple(r.shape)}, the "
                               f"model routes {layers} layers x {k} experts")
            m = min(len(r), n)
            out[i, :m] = r[:m]
    return out


def extend(old, new):
    """A trajectory's routes after a completion: the routes recorded before are kept (a partial rollout's tokens
    replay what was recorded when they were sampled, under an older version), the positions beyond them taken
    from the completion's (``new`` covers its whole context: the prompt, the response so far, its new tokens)."""
    if new is None:
        return old
    new = torch.as_tensor(new)  # (an engine's: a numpy array, which crosses processes as bytes)
    if old is None or not len(old):
        return new
    return torch.cat([torch.as_tensor(old), new[len(old):]])
