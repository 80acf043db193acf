"""PR #47235's four tests, written from the PR's description as vLLM-style tests: each drives
vLLM's ``SimpleCPUOffloadScheduler`` directly (vLLM ``Request``s with vLLM's block hasher, a
real GPU ``BlockPool``, vLLM ``SchedulerOutput`` and ``KVConnectorOutput`` objects).

They run in whichever vLLM 0.33.0 the interpreter imports: unpatched, ``pr47235`` or
``repair`` (the patched modules name their patch in ``CPU_EVICTION_RESTORE``). The manager is
built by kvspec's adapter for that vLLM; everything after construction is vLLM's own API.

* ``test_eviction_signal_set_and_consumed``: an eviction from the CPU pool is reported to its
  consumer once, and nothing is reported while allocations take fresh blocks. The two patches
  expose this differently: pr47235 as a flag (``consume_eviction_signal()``), repair as the
  evicted entries (``take_evicted_block_hashes()``). Unpatched vLLM reports nothing: a strict
  expected failure there.
* ``test_phase1a_restore_enables_cache_hit``: a request whose CPU entries another request's
  store evicted gets them re-stored at its next step, so a new request with the same prompt
  has the full CPU hit. The evicting request finishes first, so its entries stop being live:
  repair re-stores only into entries no active request still needs (its no-thrash rule),
  pr47235 into whatever the LRU order gives. Unpatched vLLM never re-stores (the FIXME): a
  strict expected failure there.
* ``test_in_flight_store_protected``: the CPU blocks of a store not yet completed are not
  handed to another request's store; they hold A's entries once it completes.
* ``test_active_request_blocks_can_be_evicted``: a completed store's CPU entries can be
  evicted while their request is still active: CPU and GPU reference counts are independent.

Outside a vLLM venv the module is skipped (marker ``vllm``). ``scripts/vllm-own-tests.sh`` runs
it next to vLLM's own ``tests/v1/simple_kv_offload/``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33.0 (scripts/setup-vllm-venv.sh)")

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload import manager as manager_module
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

from kvspec.adapters.targets import get_factory
from kvspec.contract.config import OffloadConfig

pytestmark = pytest.mark.vllm

BLOCK = 16
PATCH: str | None = getattr(manager_module, "CPU_EVICTION_RESTORE", None)
# the running vLLM -> (kvspec target that builds its manager, the policy it implements)
TARGET = {None: ("vllm", "baseline"), "pr47235": ("vllm+pr47235", "signal-rescan"),
          "repair": ("vllm+repair", "repair")}[PATCH]

# Unpatched vLLM 0.33.0 neither reports evictions nor re-stores (the FIXME): there the two tests
# that need a patch are strict expected failures, so they still run and must fail.
NEEDS_PATCH = pytest.mark.xfail(PATCH is None, strict=True,
                                reason="vLLM 0.33.0 without a patch never re-stores evicted CPU entries (the FIXME)")

init_none_hash(sha256)


def make_manager(num_cpu_blocks: int, num_gpu_blocks: int = 16) -> Any:
    """vLLM's SimpleCPUOffloadScheduler (eager stores, one full-attention group, block size 16)
    bound to a real GPU BlockPool; ``num_cpu_blocks`` counts the CPU pool's null block."""
    target, policy = TARGET
    config = OffloadConfig(block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                           policy=policy)
    return get_factory(target)(config).manager


def request_of(rid: str, tokens: list[int]) -> Request:
    """A vLLM request for the prompt ``tokens``, hashed by vLLM's block hasher."""
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def make_request(rid: str, num_blocks: int, first_token: int) -> Request:
    """A request of ``num_blocks`` full blocks plus one token; prompts differ by ``first_token``."""
    return request_of(rid, list(range(first_token, first_token + num_blocks * BLOCK + 1)))


def allocate(mgr: Any, request: Request) -> list[int]:
    """GPU blocks for the whole prompt, the full ones cached under the request's hashes (as the
    KV cache manager does), the prompt confirmed computed, the manager told. Returns the ids."""
    pool = mgr._gpu_block_pool
    blocks = pool.get_new_blocks(len(request.block_hashes) + 1)
    pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=0,
                           num_full_blocks=len(request.block_hashes), block_size=BLOCK, kv_cache_group_id=0)
    mgr.update_state_after_alloc(request, KVCacheBlocks(blocks=(blocks,)), num_external_tokens=0)
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in blocks]


def step(mgr: Any, new: dict[str, list[int]] | None = None, cached: tuple[str, ...] = (),
         finished: tuple[str, ...] = ()) -> Any:
    """``build_connector_meta`` for one scheduler step: ``new`` requests with their block ids,
    ``cached`` requests scheduled again without new blocks, ``finished`` ones."""
    new = new or {}
    new_reqs = [NewRequestData(req_id=rid, prompt_token_ids=None, mm_features=[], sampling_params=None,
                               pooling_params=None, block_ids=(ids,), num_computed_tokens=0, lora_request=None)
                for rid, ids in new.items()]
    cached_reqs = CachedRequestData(req_ids=list(cached), resumed_req_ids=set(), new_token_ids=[[] for _ in cached],
                                    all_token_ids={}, new_block_ids=[None for _ in cached],
                                    num_computed_tokens=[0] * len(cached), num_output_tokens=[0] * len(cached))
    scheduled = {rid: 1 for rid in (*new, *cached)}
    out = SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                          num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                          scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, preempted_req_ids=set(),
                          finished_req_ids=set(finished), free_encoder_mm_hashes=[])
    return mgr.build_connector_meta(out)


def complete_store(mgr: Any, meta: Any) -> None:
    """The workers report the step's store event done."""
    assert meta.store_event >= 0
    report = SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: mgr._expected_worker_count})
    mgr.update_connector_output(KVConnectorOutput(finished_recving=set(), kv_connector_worker_meta=report))


def cpu_block_of(mgr: Any, request: Request, position: int) -> int | None:
    """The CPU block caching the request's block at ``position``, if any."""
    key = make_block_hash_with_group_id(request.block_hashes[position], 0)
    block = mgr.cpu_block_pool.cached_block_hash_to_block.get_one_block(key)
    return None if block is None else int(block.block_id)


def store_whole_prompt(mgr: Any, request: Request) -> list[int]:
    """Allocate ``request``, store its full blocks in one step and complete the store."""
    ids = allocate(mgr, request)
    meta = step(mgr, new={request.request_id: ids})
    assert meta.store_gpu_blocks == ids[:len(request.block_hashes)]
    complete_store(mgr, meta)
    return ids


def eviction_reported(pool: Any) -> bool:
    """Whether the CPU pool reports an eviction since the last call, by the patch's own API."""
    if PATCH == "pr47235":
        return bool(pool.consume_eviction_signal())
    if PATCH == "repair":
        return bool(pool.take_evicted_block_hashes())
    pytest.fail("this vLLM's BlockPool reports no evictions to the offload manager (vLLM 0.33.0's FIXME)")


@NEEDS_PATCH
def test_eviction_signal_set_and_consumed() -> None:
    mgr = make_manager(num_cpu_blocks=5)
    pool = mgr.cpu_block_pool
    a, b = make_request("A", 2, 1_000), make_request("B", 2, 2_000)
    store_whole_prompt(mgr, a)
    store_whole_prompt(mgr, b)
    assert pool.get_num_free_blocks() == 4  # completed stores leave their entries cached, free
    assert not eviction_reported(pool)  # four fresh blocks taken: nothing evicted
    pool.get_new_blocks(2)  # what a third store would allocate: A's two entries are the LRU head
    assert cpu_block_of(mgr, a, 0) is None and cpu_block_of(mgr, a, 1) is None
    assert eviction_reported(pool)
    assert not eviction_reported(pool)  # reported once


@NEEDS_PATCH
def test_phase1a_restore_enables_cache_hit() -> None:
    mgr = make_manager(num_cpu_blocks=5)
    a, b, c = make_request("A", 2, 1_000), make_request("B", 2, 2_000), make_request("C", 2, 3_000)
    ids_a = store_whole_prompt(mgr, a)
    store_whole_prompt(mgr, b)
    ids_c = store_whole_prompt(mgr, c)  # evicts A's entries while A is active
    assert cpu_block_of(mgr, a, 0) is None and cpu_block_of(mgr, a, 1) is None
    mgr.request_finished(c, block_ids=[])
    mgr._gpu_block_pool.free_blocks(mgr._gpu_block_pool.blocks[i] for i in reversed(ids_c))
    meta = step(mgr, cached=("A",), finished=("C",))  # A's next step
    assert meta.store_gpu_blocks == ids_a[:2]  # A's two blocks, stored again
    complete_store(mgr, meta)
    same = request_of("A2", list(a.prompt_token_ids or []))
    assert mgr.get_num_new_matched_tokens(same, 0) == (2 * BLOCK, True)  # a full CPU hit: no re-prefill


def test_in_flight_store_protected() -> None:
    mgr = make_manager(num_cpu_blocks=5)
    a, b = make_request("A", 2, 1_000), make_request("B", 3, 2_000)
    ids_a = allocate(mgr, a)
    meta_a = step(mgr, new={"A": ids_a})  # planned, not completed
    assert len(meta_a.store_cpu_blocks) == 2
    ids_b = allocate(mgr, b)
    meta_b = step(mgr, new={"B": ids_b})
    # only the two CPU blocks A's store does not hold are free: B stores two, elsewhere
    assert len(meta_b.store_cpu_blocks) == 2
    assert set(meta_b.store_cpu_blocks).isdisjoint(meta_a.store_cpu_blocks)
    assert [mgr.cpu_block_pool.blocks[i].ref_cnt for i in meta_a.store_cpu_blocks] == [1, 1]
    complete_store(mgr, meta_a)
    assert [cpu_block_of(mgr, a, 0), cpu_block_of(mgr, a, 1)] == list(meta_a.store_cpu_blocks)


def test_active_request_blocks_can_be_evicted() -> None:
    mgr = make_manager(num_cpu_blocks=3)
    a, b = make_request("A", 2, 1_000), make_request("B", 2, 2_000)
    ids_a = store_whole_prompt(mgr, a)
    cpu_a = [cpu_block_of(mgr, a, 0), cpu_block_of(mgr, a, 1)]
    assert None not in cpu_a
    ids_b = allocate(mgr, b)
    meta = step(mgr, new={"B": ids_b}, cached=("A",))  # A is still running
    assert sorted(meta.store_cpu_blocks) == sorted(cpu_a)  # B's store takes A's CPU blocks
    assert cpu_block_of(mgr, a, 0) is None and cpu_block_of(mgr, a, 1) is None
    gpu = mgr._gpu_block_pool
    assert [gpu.blocks[i].ref_cnt for i in ids_a] == [1, 1, 1]  # A's GPU side is untouched
    assert all(gpu.blocks[i].block_hash is not None for i in ids_a[:2])
