"""Every difference between the vLLM releases kvspec drives, in one place.

``kvspec.adapters.vllm`` is written against vLLM 0.33.0; the targets ``vllm@VERSION`` run the
same adapter on an older release (one venv per release, ``scripts/setup-vllm-release.sh``).
What differs, read off each release's own sources:

* **The manager's constructor.** Up to 0.21 the block size comes from
  ``vllm_config.cache_config.block_size``; from 0.22 it is passed as
  ``scheduler_block_size``/``hash_block_size``; ``disk_capacity_bytes`` exists from 0.29,
  ``use_page_cache`` from 0.31; an explicit ``num_cpu_blocks`` only from 0.33.
* **CPU-pool sizing** before 0.33: ``max(1, gpu_blocks * cpu_capacity_bytes // gpu_total)``,
  where ``gpu_total`` is the sum of the KV tensors' sizes while tensors are per-layer
  (``shared_by``) and the first tensor's size once they describe one backing allocation
  (``layers``, from 0.29). The capacity handed over is chosen so that the formula gives
  exactly the configured count, and the count is checked after construction.
* **``KVCacheTensor``:** ``(size, shared_by)`` up to 0.28, ``(size, layers, layer_stride,
  block_stride)`` from 0.29.
* **Config attributes read:** ``prefill_context_parallel_size`` (up to 0.24),
  ``speculative_config``/``max_in_flight_tokens`` (0.29), ``num_prefill_lookahead_tokens``
  (0.32): the duck-typed config carries all of them.
* **``SchedulerOutput.num_common_prefix_blocks``** is a required field up to 0.31 (detected
  from the dataclass itself).
* **``reset()``** exists from 0.24. Before that the connector has no reset: kvspec's reset
  operation returns False (refused) and changes nothing in the manager.
* **Lookup pins** (``_pending_cpu_hits``) exist from 0.22; up to 0.29 a pin is
  ``(blocks, hit_len)``, from 0.30 ``(blocks, hit_len, num_computed_tokens)``. For the older
  shape the target remembers the computed-token count it passed to the lookup.
* **The OffloadingConnector** (``kvspec.adapters.vllm_offloading_connector``) runs on the
  releases of ``CONNECTOR_RELEASES``. A transfer job is ``transfer_spec=(src, dst)`` in 0.23,
  ``src_spec``/``dst_spec`` from 0.29, with ``sync`` (a load inside the step) only from 0.33;
  a chunk is ``block_size_factor`` GPU blocks in 0.23, ``blocks_per_chunk`` from 0.29; the
  ``CPUOffloadingManager`` counts ``_num_blocks`` up to 0.29, ``_num_chunks`` from 0.31, and
  keeps a ``_cache_generation`` (bumped by each reset) only from 0.31.
* **Manager state** added over time (abandoned transfers from 0.24, in-flight store blocks
  from 0.22, pending finished stores from 0.30): absent state reads as empty.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as metadata
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError

#: The releases with a setup recipe and a target (``vllm@VERSION``); 0.33.0 is ``.vllm-venv`` too.
RELEASES = ("0.19.1", "0.23.0", "0.29.0", "0.31.0", "0.33.0")
#: The releases the OffloadingConnector harness runs on: 0.19.1's connector predates the job
#: protocol (``load_jobs``/``store_jobs``/``jobs_to_flush``) the harness plays the workers of.
CONNECTOR_RELEASES = ("0.23.0", "0.29.0", "0.31.0", "0.33.0")
FIRST_WITH_MANAGER = (0, 19)
TARGET_PREFIX = "vllm@"


@dataclass(frozen=True)
class Release:
    """One vLLM release, as a comparable (major, minor, patch)."""

    version: str

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.version.split("."))

    def at_least(self, version: str) -> bool:
        return self.key >= Release(version).key

    @property
    def block_size_from_config(self) -> bool:
        return not self.at_least("0.22.0")

    @property
    def has_reset(self) -> bool:
        return self.at_least("0.24.0")

    @property
    def has_pins(self) -> bool:
        return self.at_least("0.22.0")

    @property
    def explicit_cpu_blocks(self) -> bool:
        return self.at_least("0.33.0")


def parse_release(text: str) -> Release:
    """``0.23.0`` as a ``Release``; ``ConfigError`` for anything else or a release before 0.19."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", text or ""):
        raise ConfigError(f"{text[:40]!r} is not a vLLM release number like 0.23.0")
    rel = Release(text)
    if rel.key[:2] < FIRST_WITH_MANAGER:
        raise ConfigError(f"vLLM {text} has no simple_kv_offload manager (it ships from 0.19.0)")
    return rel


def venv_for(version: str, root: Path | None = None) -> Path:
    """The venv that holds ``version`` (``.vllm-venvs/VERSION``; 0.33.0 may also be ``.vllm-venv``)."""
    base = root or Path(__file__).resolve().parents[2]
    own = base / ".vllm-venvs" / version
    if version == "0.33.0" and not own.exists() and (base / ".vllm-venv").exists():
        return base / ".vllm-venv"
    return own


@functools.cache
def installed_version() -> str:
    """The installed vLLM's version (``PackageNotFoundError`` when there is none). Looked up once
    per process (reading the package metadata costs about a millisecond, and a fuzzer builds a
    target per trace); a failed lookup is not kept."""
    return metadata.version("vllm")


def installed_release(wanted: str) -> Release:
    """The installed vLLM, which must be ``wanted``: else ``ConfigError`` naming the venv to use."""
    try:
        found: str | None = installed_version()
    except metadata.PackageNotFoundError:
        found = None
    if found != wanted:
        here = f"vLLM {found} is installed here" if found else "vLLM is not installed here"
        raise ConfigError(
            f"target vllm@{wanted} needs vLLM {wanted}, but {here}; build its venv with "
            f"scripts/setup-vllm-release.sh {wanted} and run kvspec from {venv_for(wanted)}/bin/python"
        )
    return parse_release(found)


def vllm_config(config: OffloadConfig, max_model_len: int) -> SimpleNamespace:
    """The duck-typed ``vllm_config``: every attribute any supported release's manager reads."""
    return SimpleNamespace(
        kv_events_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                        world_size=config.world_size),
        cache_config=SimpleNamespace(block_size=config.block_size),
        speculative_config=None,
        model_config=SimpleNamespace(max_model_len=max_model_len),
        max_in_flight_tokens=config.max_num_batched_tokens,
        num_prefill_lookahead_tokens=0,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=config.max_num_batched_tokens),
    )


def _tensor_fields(tensor_cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(tensor_cls)}


def kv_cache_tensor(tensor_cls: Any, page_bytes: int, num_gpu_blocks: int, layer: str) -> Any:
    """One group's ``KVCacheTensor`` in the release's own shape."""
    size = page_bytes * num_gpu_blocks
    if "layers" in _tensor_fields(tensor_cls):
        return tensor_cls(size=size, layers=[layer], layer_stride=size, block_stride=page_bytes)
    return tensor_cls(size=size, shared_by=[layer])


def cpu_capacity_bytes(rel: Release, tensor_cls: Any, page_bytes: int, num_groups: int,
                       num_cpu_blocks: int) -> int:
    """The byte capacity for which the release's sizing formula yields ``num_cpu_blocks``."""
    if rel.explicit_cpu_blocks or "layers" in _tensor_fields(tensor_cls):
        return page_bytes * num_cpu_blocks  # gpu_total is one tensor: page * gpu blocks
    return page_bytes * num_groups * num_cpu_blocks  # gpu_total sums the per-group tensors


def manager_kwargs(rel: Release, config: OffloadConfig, capacity: int) -> dict[str, Any]:
    """Keyword arguments of ``SimpleCPUOffloadScheduler(vllm_config, kv_cache_config, **kw)``."""
    kw: dict[str, Any] = {"cpu_capacity_bytes": capacity, "lazy_offload": config.lazy_offload}
    if not rel.block_size_from_config:
        kw.update(scheduler_block_size=config.block_size, hash_block_size=config.block_size)
    if rel.explicit_cpu_blocks:
        kw["num_cpu_blocks"] = config.num_cpu_blocks
    return kw


def check_cpu_blocks(rel: Release, manager: Any, wanted: int) -> None:
    got = int(manager.cpu_block_pool.num_gpu_blocks)
    if got != wanted:
        raise ConfigError(f"vLLM {rel.version} sized its CPU pool to {got} blocks, not {wanted}")


def scheduler_output_extra(output_cls: Any, num_groups: int) -> dict[str, Any]:
    """Fields the release's ``SchedulerOutput`` requires beyond 0.33.0's."""
    names = {f.name for f in dataclasses.fields(output_cls)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {"num_common_prefix_blocks": [0] * num_groups} if "num_common_prefix_blocks" in names else {}


_ABSENT_STATE: dict[str, Callable[[], Any]] = {
    "_pending_cpu_hits": dict,
    "_abandoned_reqs_to_load": dict,
    "_abandoned_store_event_to_blocks": dict,
    "_pending_finished_stores": list,
    "_in_flight_store_gpu_blocks": set,
}


def fill_absent_state(manager: Any) -> None:
    """Give a release's manager the (empty) state it never had, so one adapter reads every release.
    The release's own code never reads these names, so they stay empty."""
    for name, make in _ABSENT_STATE.items():
        if not hasattr(manager, name):
            setattr(manager, name, make())


def pending_hit(pin: tuple[Any, ...], local: int) -> tuple[Any, int, int]:
    """A lookup pin as ``(blocks, hit_len, num_computed_tokens)``; ``local`` for the 2-tuple shape."""
    if len(pin) == 3:
        return pin[0], int(pin[1]), int(pin[2])
    return pin[0], int(pin[1]), local


def pending_hits(manager: Any, lookup_local: Mapping[str, int]) -> Iterator[tuple[str, tuple[Any, int, int]]]:
    for rid, pin in manager._pending_cpu_hits.items():
        yield rid, pending_hit(pin, lookup_local.get(rid, 0))


def free_blocks_in(queue: Any, limit: int) -> Iterator[Any]:
    """A free queue's blocks, head to tail, walked on its links between the two sentinels as every
    release's own iteration walks them, but at most ``limit``: a block linked in twice can make
    the links loop (vLLM #42571), and then vLLM's own walk never ends. O(min(len, limit))."""
    tail = queue.fake_free_list_tail
    block = queue.fake_free_list_head.next_free_block
    for _ in range(limit):
        if block is None or block is tail:
            return
        yield block
        block = block.next_free_block


def insert_block_hash(pool: Any, key: bytes, block: Any) -> None:
    """Register a full block under ``key``: the pool's ``_insert_block_hash`` from 0.24; before,
    what ``cache_full_blocks`` does for each block (stamp the hash, add it to the prefix map)."""
    if hasattr(pool, "_insert_block_hash"):
        pool._insert_block_hash(key, block, num_tokens=None)
        return
    block.block_hash = key
    pool.cached_block_hash_to_block.insert(key, block)


def unclaimed(rel: Release) -> tuple[str, ...]:
    """Invariants of 0.33.0's claims about state a release does not have, so it never claimed them:
    reset semantics (I15) before ``reset()`` exists (0.24), in-flight store marks (I7) before the
    manager tracks in-flight store blocks (0.22)."""
    out: list[str] = []
    if not rel.has_reset:
        out.append("I15")
    if not rel.at_least("0.22.0"):
        out.append("I7")
    return tuple(out)


# -- the OffloadingConnector ------------------------------------------------------------------


def connector_release() -> Release:
    """The installed vLLM, which must be one of ``CONNECTOR_RELEASES``; else ``ConfigError``."""
    try:
        found = installed_version()
    except metadata.PackageNotFoundError:
        raise ConfigError("the OffloadingConnector harness needs vLLM (one of "
                          f"{', '.join(CONNECTOR_RELEASES)}), which is not installed here") from None
    if found not in CONNECTOR_RELEASES:
        raise ConfigError(f"the OffloadingConnector harness runs on vLLM {', '.join(CONNECTOR_RELEASES)}, "
                          f"not {found}")
    return Release(found)


def job_specs(job: Any) -> tuple[Any, Any]:
    """A ``TransferJob``'s (source, destination) specs in either shape."""
    if hasattr(job, "transfer_spec"):
        src, dst = job.transfer_spec
        return src, dst
    return job.src_spec, job.dst_spec


def blocks_per_chunk(connector_config: Any) -> int:
    """GPU blocks per CPU chunk of the connector's scheduler config."""
    value = getattr(connector_config, "blocks_per_chunk", None)
    return int(value if value is not None else connector_config.block_size_factor)


def num_chunks(manager: Any) -> int:
    """The ``CPUOffloadingManager``'s chunk count."""
    return int(getattr(manager, "_num_chunks", None) or manager._num_blocks)
