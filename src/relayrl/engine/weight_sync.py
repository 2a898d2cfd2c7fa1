"""Weight updates through a collective (``rollout.weight_sync=collective``): the trainer broadcasts the policy to
every engine worker in buckets, each received bucket loaded as it arrives.

    plan = plan_buckets(metas(state_dict), bucket_bytes)    # names, dtypes, shapes, grouped ≤ bucket_bytes
    store = Channel.store(world, timeout_s)                   # rank 0's TCP store, on a port the OS picks
    sender = Channel.host(store, world, timeout_s)            # rank 0 (each receiver: Channel.join(address, rank, ...))
    sender.send(state_dict, plan)                             # receivers: for name, t in channel.receive(plan)

The group is gloo's (CPU tensors over TCP; NCCL on GPUs is the same protocol on another backend, not wired yet).
It is formed from a store of its own, never torch.distributed's default group, so a trainer under torchrun keeps
its own. Every operation has a deadline (``timeout_s``): a receiver that dies mid-update fails the next broadcast
the socket notices it in ("connection closed by peer"; a small bucket may still be taken by the socket, so the
engine's side watches for it too: ``VLLMEngine._broadcast``), one that stalls fails it at the deadline — an update
fails, it never hangs. ``VLLMReceiver`` is the vLLM worker's side (vLLM's ``worker_extension_cls``)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MB = 1 << 20
ALIGN = 16  # each tensor starts at a multiple of this in a bucket: a view of any dtype needs its own alignment


class SyncError(RuntimeError):
    """A weight update through the collective failed (a peer gone, a deadline passed); the message says which."""


@dataclass(frozen=True)
class Meta:
    name: str
    dtype: str  # torch dtype's name, "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def span(self) -> int:
        """Its bytes in a bucket: ``nbytes`` rounded up to ``ALIGN``."""
        return -(-self.nbytes // ALIGN) * ALIGN


def metas(state_dict: dict[str, torch.Tensor]) -> list[Meta]:
    return [Meta(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state_dict.items()]


def plan_buckets(tensors: list[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """The tensors in order, grouped so that each group's bytes (``Meta.span``) are at most ``bucket_bytes`` (a new
    group starts where the next tensor would pass it). A tensor larger than a bucket is refused: it names the tensor
    and the size ``rollout.sync_bucket_mb`` needs."""
    buckets: list[list[Meta]] = []
    size = 0
    for m in tensors:
        if m.span > bucket_bytes:
            raise SyncError(f"rollout.sync_bucket_mb={bucket_bytes / MB:g} cannot hold {m.name} ({m.nbytes / MB:.1f} MB, "
                            f"{m.dtype} {list(m.shape)}): set rollout.sync_bucket_mb ≥ {-(-m.nbytes // MB)}")
        if not buckets or size + m.span > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(m)
        size += m.span
    return buckets


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat byte buffer holding the tensors' bytes one after another, each at a multiple of ``ALIGN``."""
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        parts += [raw, raw.new_zeros(-raw.numel() % ALIGN)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buffer: torch.Tensor, bucket: list[Meta]) -> list[tuple[str, torch.Tensor]]:
    """``pack``'s inverse: views of ``buffer`` as the bucket's tensors (no copy)."""
    out, at = [], 0
    for m in bucket:
        out.append((m.name, buffer[at:at + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)))
        at += m.span
    return out


class Channel:
    """One rank of a gloo group formed from a TCP store of its own (rank 0 hosts the store)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, address: tuple[str, int]):
        from torch._C._distributed_c10d import ProcessGroupGloo

        self.store, self.rank, self.world, self.address = store, rank, world, address
        self.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.group = ProcessGroupGloo(store, rank, world, self.timeout)
        except RuntimeError as e:
            raise SyncError(f"the weight-sync group ({world} ranks at {address[0]}:{address[1]}) could not be formed "
                            f"within {timeout_s:g} s (rollout.sync_timeout_s): {_first_line(e)}") from None

    @staticmethod
    def store(world: int, timeout_s: float, host: str = "127.0.0.1"):
        """Rank 0's store, on a port the OS picks: its address is what the other ranks join."""
        from torch.distributed import TCPStore

        return TCPStore(host, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    @classmethod
    def host(cls, store, world: int, timeout_s: float) -> Channel:
        return cls(store, 0, world, timeout_s, (store.host, store.port))

    @classmethod
    def join(cls, address: tuple[str, int], rank: int, world: int, timeout_s: float) -> Channel:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(address[0], address[1], world, False, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise SyncError(f"rank {rank} could not reach the weight-sync store at {address[0]}:{address[1]}: "
                            f"{_first_line(e)}") from None
        return cls(store, rank, world, timeout_s, address)

    def _broadcast(self, buffer: torch.Tensor, what: str) -> None:
        from torch._C._distributed_c10d import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        try:
            self.group.broadcast([buffer], opts).wait(self.timeout)
        except RuntimeError as e:
            raise SyncError(f"weight sync: {what} failed on rank {self.rank} of {self.world} "
                            f"({_first_line(e)})") from None

    def send(self, state_dict: dict[str, torch.Tensor], plan: list[list[Meta]]) -> None:
        """Rank 0: each bucket of ``plan``, packed from ``state_dict`` only when its turn comes (one bucket's copy
        in memory at a time)."""
        for i, bucket in enumerate(plan):
            self._broadcast(pack([state_dict[m.name] for m in bucket]), f"bucket {i + 1}/{len(plan)}")

    def receive(self, plan: list[list[Meta]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A receiving rank: the tensors of each bucket as it arrives."""
        for i, bucket in enumerate(plan):
            buffer = torch.empty(sum(m.span for m in bucket), dtype=torch.uint8)
            self._broadcast(buffer, f"bucket {i + 1}/{len(plan)}")
            yield from unpack(buffer, bucket)

    def close(self) -> None:
        try:
            self.group.shutdown()
        except (RuntimeError, AttributeError):
            pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


class VLLMReceiver:
    """vLLM's worker extension (``worker_extension_cls``): methods the engine calls on each worker through
    ``collective_rpc``. A worker is rank ``1 + its rank`` of the group; its buckets go straight into vLLM's
    in-place reload (``reload_weights(weights_iterator=...)``), loaded as each arrives."""

    def relayrl_join(self, host: str, port: int, world: int, timeout_s: float) -> None:
        self.relayrl_channel = Channel.join((host, port), 1 + int(getattr(self, "rank", 0)), world, timeout_s)

    def relayrl_receive(self, plan: list[list[tuple]]) -> None:
        buckets = [[Meta(n, d, tuple(s)) for n, d, s in b] for b in plan]
        self.reload_weights(weights_iterator=self.relayrl_channel.receive(buckets))

    def relayrl_leave(self) -> None:
        channel = getattr(self, "relayrl_channel", None)
        if channel is not None:
            channel.close()
            self.relayrl_channel = None
