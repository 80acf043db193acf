"""KV payloads: one tensor per pool, moved by batched index copies.

``gpu`` is ``[num_gpu_blocks, *block_shape]`` and ``cpu`` ``[num_cpu_blocks,
*block_shape]``. The content model: the KV data of a block whose tokens hash to ``h``
is ``expected_payload(h)``, a pure function of the hash text (so a test can compute
what any block must hold without asking the implementation).

* **Compute**: when the GPU pool registers a block under a key (vLLM hashes blocks at
  schedule time, for the tokens the step's forward computes), the block is queued to
  receive that key's payload; queued writes are applied in one batch before any copy
  reads the GPU tensor. A block that holds loaded data keeps it (the load, not the
  forward, filled it), so a wrong load stays visible.
* **Store** completion: ``cpu[cpu_ids] = gpu[gpu_ids]`` (``index_copy_``), executed when
  the last worker rank reports the event.
* **Load** completion: ``gpu[gpu_ids] = cpu[cpu_ids]``, executed at ``finished_recving``.

Copies go through ``copy_blocks``: long runs of consecutive ids on both sides become
slice copies (one pass over the bytes); otherwise a gather and an ``index_copy_``,
chunked so that the gathered rows are still in cache when they are written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvspec.impl.convert import int_tensor
from kvspec.impl.keys import seed_of

_MIX = (0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))
CHUNK_BYTES = 1 << 20
SMALL_COPY_BYTES = 64 << 10  # up to this many bytes a copy skips the search for runs


def _payload_from_seeds(seeds: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic pseudo-random values in [-1, 1) per (seed, element); splitmix-style mixing."""
    numel = 1
    for d in block_shape:
        numel *= d
    x = seeds.view(-1, 1) + _lanes(numel, seeds.device)
    x ^= x >> 30
    x *= _MIX[1]
    x ^= x >> 27
    x *= _MIX[2]
    x ^= x >> 31
    x >>= 40
    x &= 0xFFFF
    vals = x.to(torch.float32).mul_(1.0 / 32768.0).sub_(1.0)  # a power of two: exact, as a division
    return vals.view(-1, *block_shape).to(dtype)


_LANES: dict[tuple[int, str], torch.Tensor] = {}


def _lanes(numel: int, device: torch.device) -> torch.Tensor:
    """``[1, ..., numel] * _MIX[0]`` as a row (wrapping int64), computed once per size and device."""
    key = (numel, str(device))
    lanes = _LANES.get(key)
    if lanes is None:
        lanes = (torch.arange(1, numel + 1, dtype=torch.int64, device=device) * _MIX[0]).view(1, -1)
        _LANES[key] = lanes
    return lanes


def expected_payload(block_hash: str, block_shape: tuple[int, ...] = (2, 8),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The KV data of a block whose tokens hash to ``block_hash`` (CPU tensor)."""
    return _payload_from_seeds(torch.tensor([seed_of(block_hash)], dtype=torch.int64), block_shape, dtype)[0]


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes, one row per block, in the widest element type that divides a row."""
    rows = t.view(t.shape[0], -1)
    nbytes = rows.shape[1] * rows.element_size()
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and rows.element_size() <= size:
            try:
                return rows.view(dt)
            except RuntimeError:
                break
    return rows


def copy_blocks(dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor, src_ids: torch.Tensor) -> None:
    """``dst[dst_ids] = src[src_ids]`` for distinct ``dst_ids``, in as few passes over the bytes as possible.

    A copy of at most ``SMALL_COPY_BYTES`` between tensors on one device is one gather and
    one scatter (finding runs would cost more than it saves). Otherwise runs of consecutive
    ids on both sides become slice copies. What remains is copied
    block by block when a block is large (one memcpy each, so one pass over the bytes;
    on CPU this beats a gather plus a scatter from 16 KiB per block up), else gathered
    and scattered as 64-bit words in cache-sized chunks.
    """
    n = dst_ids.numel()
    if n == 0:
        return
    row = src[0].numel() * src.element_size()
    same_device = src.device == dst.device
    if n * row <= SMALL_COPY_BYTES and same_device:  # too few bytes for runs to pay: one gather, one scatter
        dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))
        return
    if n > 1:
        step = torch.ones(n, dtype=torch.bool, device=dst_ids.device)
        sid = src_ids.to(dst_ids.device)
        step[1:] = (dst_ids[1:] != dst_ids[:-1] + 1) | (sid[1:] != sid[:-1] + 1)
        starts = step.nonzero().flatten()
        runs = starts.numel()
    else:
        starts, runs = None, 1
    per_block = same_device and src.device.type == "cpu" and row >= (16 << 10)
    if runs * 8 <= n or per_block:
        if starts is None:
            starts = torch.zeros(1, dtype=torch.int64)
        ends = torch.cat([starts[1:], starts.new_tensor([n])]).tolist()
        lens = [e - s for s, e in zip(starts.tolist(), ends, strict=True)]
        d0s, s0s = dst_ids[starts].tolist(), src_ids[starts].tolist()
        torch._foreach_copy_([dst[d : d + m] for d, m in zip(d0s, lens, strict=True)],
                             [src[s : s + m] for s, m in zip(s0s, lens, strict=True)], non_blocking=True)
        return
    dw, sw = _as_words(dst), _as_words(src)
    per = max(1, CHUNK_BYTES // max(1, row))
    for s in range(0, n, per):
        rows = sw.index_select(0, src_ids[s : s + per].to(src.device))
        dw.index_copy_(0, dst_ids[s : s + per].to(dst.device), rows.to(dst.device, non_blocking=True))


class PayloadStore:
    """The KV data of both pools and the pending compute writes."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device,
                 seeds_of_keys: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.gpu = torch.zeros((num_gpu_blocks, *self.block_shape), dtype=dtype, device=device)
        cpu_device = torch.device("cpu")
        pin = device.type == "cuda"
        self.cpu = torch.zeros((num_cpu_blocks, *self.block_shape), dtype=dtype, device=cpu_device,
                               pin_memory=pin)
        self._seeds_of_keys = seeds_of_keys
        self._pending: dict[int, int] = {}  # GPU block -> key id whose payload it is to receive
        self.loaded = torch.zeros(num_gpu_blocks, dtype=torch.bool, device=device)
        self.bytes_copied = 0

    def on_gpu_register(self, kids: torch.Tensor, blocks: torch.Tensor) -> None:
        self._pending.update(zip(blocks.tolist(), kids.tolist(), strict=True))

    def on_gpu_alloc(self, blocks: torch.Tensor) -> None:
        if blocks.numel():
            self.loaded[blocks] = False

    def flush(self) -> None:
        """Apply the queued compute writes (skipping blocks that hold loaded data)."""
        if not self._pending:
            return
        blocks = int_tensor(list(self._pending), self.gpu.device)
        kids = torch.tensor(list(self._pending.values()), dtype=torch.int64, device=self.gpu.device)
        self._pending.clear()
        keep = ~self.loaded[blocks]
        blocks, kids = blocks[keep], kids[keep]
        if blocks.numel():
            data = _payload_from_seeds(self._seeds_of_keys(kids), self.block_shape, self.dtype)
            self.gpu.index_copy_(0, blocks, data)

    def store(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor) -> None:
        self.flush()
        copy_blocks(self.cpu, cpu_ids.cpu(), self.gpu, gpu_ids)
        self.bytes_copied += cpu_ids.numel() * self.cpu[0].numel() * self.cpu.element_size()

    def load(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor) -> None:
        self.flush()
        copy_blocks(self.gpu, gpu_ids, self.cpu, cpu_ids.cpu())
        self.loaded[gpu_ids] = True
        self.bytes_copied += gpu_ids.numel() * self.gpu[0].numel() * self.gpu.element_size()
