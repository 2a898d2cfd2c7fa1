"""Where the trainer runs: its device (``trainer.device``), and FSDP2 data parallelism under
torchrun (``trainer.fsdp``).

``torchrun --nproc-per-node N -m relayrl.cli train ... trainer.fsdp=true`` starts N processes.
Rank 0 runs the whole pipeline as a single process does (data, rollout, engines, evaluation,
checkpoints, logs) and *leads* the trainer; the other ranks only hold a policy and a ``Trainer``
and *follow* it (``run_follower``, ``follow``): rank 0 broadcasts each call (train this batch,
gather the weights, gather or load the optimiser state, stop) and every rank takes part in it.
Each rank keeps a shard of the weights, gradients and optimiser state (``shard``:
``fully_shard`` on every decoder layer and on the root).

Exactness: every rank receives the whole batch, so the loss normalisers (the optimiser batch's
token and sequence counts) are the global ones. The batch's micro-batches are dealt round robin
(``Group.share``); a rank with one fewer runs a zero-loss pass instead, because every rank must
run as many FSDP forwards and backwards as the others. Gradients are summed over ranks, not
averaged, so the step is the unsharded step's (tested against it).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relayrl.models.devices import resolve_device  # noqa: F401 (the trainer's device, as the engine's)

LAUNCH = "torchrun --nproc-per-node N -m relayrl.cli train ... trainer.fsdp=true"


def check_launch(tcfg, rollout_device: str = "auto") -> None:
    """Input errors in the trainer's placement, before any work: a device this machine lacks (the
    trainer's or the engine's), ``trainer.fsdp=true`` outside torchrun, or several torchrun processes
    without it (each would run the whole pipeline into the same run directory)."""
    resolve_device(tcfg.device)
    resolve_device(rollout_device, "rollout.device")
    if tcfg.fsdp and "WORLD_SIZE" not in os.environ:
        raise ValueError(f"trainer.fsdp=true needs a torchrun launch ({LAUNCH}): RANK and WORLD_SIZE are not set")
    if not tcfg.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"launched as {os.environ['WORLD_SIZE']} processes (WORLD_SIZE), but trainer.fsdp=false: "
                         "each would run the whole run; set trainer.fsdp=true to shard the trainer over them")


def is_follower(tcfg) -> bool:
    """A torchrun rank other than 0 of an FSDP run: it only trains (``follow``)."""
    return bool(tcfg.fsdp) and int(os.environ.get("RANK", "0")) > 0


@dataclass
class Group:
    """This process's place in the data-parallel group, and the collectives the trainer needs.
    Tensors travel through ``device`` (NCCL moves only CUDA tensors) and come back where they were."""

    rank: int
    world: int
    device: torch.device

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def send(self, *command) -> tuple:
        """Rank 0's ``command`` (a tuple of picklable objects) on every rank."""
        box = [command if self.leads else None]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def receive(self) -> tuple:
        return self.send()

    def share(self, items: list) -> list:
        """This rank's items, dealt round robin, padded with None to as many as rank 0 gets."""
        mine = items[self.rank :: self.world]
        return mine + [None] * (-(-len(items) // self.world) - len(mine))

    def reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every rank's ``t`` added up (op='max': the largest)."""
        x = t.to(self.device, copy=True)
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return x.to(t.device)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank."""
        x = t.to(self.device, copy=True)
        dist.broadcast(x, src=0)
        return x.to(t.device)


def setup(device: torch.device) -> Group:
    """Join the torchrun group (NCCL on CUDA, gloo on the CPU), once per process; left at exit."""
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return Group(dist.get_rank(), dist.get_world_size(), device)


def shard(model: torch.nn.Module, unused: bool = False) -> torch.nn.Module:
    """FSDP2 in place, on the model already on its device: rank 0's weights on every rank first (a
    resumed rank 0 loaded the checkpoint, the others the base model), then ``fully_shard`` on each decoder layer (the
    model's ``_no_split_modules``) and on the root. Gradients are summed over ranks (the loss is
    normalised by global counts); bf16 weights are reduced in fp32. ``unused``: a pass may leave trainable
    parameters out (an adapter per role: each micro-batch runs under its role's, and two ranks' micro-batches
    may be of two roles), so every backward reduces every trainable parameter's gradient, zeros where it had
    none, or the ranks' reductions would not match."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    mp = MixedPrecisionPolicy()  # computed and reduced in the weights' own dtype
    if next(model.parameters()).dtype == torch.bfloat16:  # bf16 gradients are summed over ranks in fp32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for m in model.modules():
        if type(m).__name__ in layers:
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
            m.set_reduce_scatter_unused_params(unused, recurse=False)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its shards (the root keeps its parameters gathered after a
    forward: ``named_parameters`` would then give plain tensors, not this rank's DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on rank 0, on the CPU (for engines and checkpoints); {} on the other
    ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_parameters(model: torch.nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """The parameters ``names`` only, each gathered whole onto rank 0's CPU ({} on the other ranks): an
    adapter's few MB, where ``full_state_dict`` would gather the whole model to keep them. A collective,
    the parameters in the same order on every rank."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if name in names:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if dist.get_rank() == 0:
                out[name] = full.detach().cpu()
    return out


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """Rank 0's whole weights (``full_state_dict``), sharded onto every rank ({} on the others). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(model, opt) -> dict:
    """The optimiser state by parameter name, whole, on rank 0's CPU ({} elsewhere). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, state: dict) -> None:
    """Rank 0's whole optimiser state (``full_optimizer_state``), sharded onto every rank. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def run_follower(trainer) -> dict:
    """A follower rank's run (``run.loop.train`` on a torchrun rank > 0): ``trainer`` built as rank 0
    builds its own (its weights are replaced by rank 0's when the trainer shards them), then rank 0's
    commands until it stops."""
    return {"rank": trainer.dp.rank, "steps": follow(trainer)}


def follow(trainer) -> int:
    """Do what rank 0's trainer does, call for call, until it sends 'stop' (``Trainer.close``).
    Returns the number of steps trained."""
    steps = 0
    while True:
        command, *args = trainer.dp.receive()
        if command == "stop":
            return steps
        if command in ("step", "sft_step"):
            getattr(trainer, command)(*args)
            steps += 1
        elif command == "weights":
            trainer.full_state_dict()
        elif command == "state":
            trainer.state_dict()
        elif command == "load":
            trainer.load_state_dict(*args)
        else:
            raise RuntimeError(f"rank {trainer.dp.rank}: unknown command {command!r} from rank 0")
