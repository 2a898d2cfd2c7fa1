"""The host allocator of a CPU trainer: a freed block of a few MB goes back to the system.

glibc's malloc serves a block from its heap unless it is larger than its mmap threshold, which starts
at 128 KB and *rises* to the size of each mmapped block freed, up to 32 MB. After the first large
tensor is freed, then, every tensor under 32 MB (a hidden state of a few thousand tokens: [8192, 896]
float32 is 29 MB) comes from the heap, and a freed one leaves a hole that stays resident while
anything above it lives. A training step interleaves such tensors: the hidden state each checkpointed
layer keeps, among the forward's temporaries of the same size. Measured on a Qwen2.5-0.5B-shaped
model cut to 8 layers (``benchmarks/trainer_memory.py``'s shape, two rows, every memory feature on,
AMD EPYC): the step's peak RSS grew 0.44 GiB per 1k tokens of row length from 1,024 to 4,096 with the
rising threshold and 0.28 GiB with a fixed threshold of 4 MB, the step no slower (146 s against 163 s
at 4,096, one run each); each layer then holds the 3.5 KB a token its saved hidden state takes (2 against 4
layers), several times less than with the rising threshold. The whole 0.5B shape: 0.91 → 0.39 GiB per 1k.

``release_large_blocks`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops it
rising): blocks from 4 MB up are mapped on their own and unmapped when freed. Smaller ones stay in the
heap (mapping each costs page faults: 256 KB made the same step 1.3x as long). Where glibc is not the
allocator, or ``MALLOC_MMAP_THRESHOLD_`` is set (the user's own choice), nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # (glibc's malloc.h)
THRESHOLD = 4 << 20


def release_large_blocks(threshold: int = THRESHOLD) -> bool:
    """Blocks of ``threshold`` bytes and more mapped apart and returned to the system when freed (glibc);
    whether the setting took."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # (not glibc: musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
