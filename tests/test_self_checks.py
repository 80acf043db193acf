"""The model's structures check themselves (``_check``); the stateful harness calls it after
every step. Each check must fire on a corrupted structure."""

import pytest
from scenario_kit import SYNC

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import QueueCorruptionError
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.model.block_pool import BlockPool
from kvspec.model.free_queue import FreeBlockQueue
from kvspec.model.prefix_map import PrefixMap


def test_free_queue_refuses_null_and_out_of_range():
    pool = BlockPool(5)
    pool._check()
    pool.free_queue._order[0] = None  # corrupt: the null block queued
    with pytest.raises(AssertionError):
        pool.free_queue._check(pool.num_blocks)


@pytest.mark.parametrize("corrupt", ["referenced", "queued", "hashed"])
def test_pool_check_guards_the_null_block(corrupt):
    pool = BlockPool(5)
    pool._check()
    if corrupt == "referenced":
        pool.ref_cnt[0] = 1
    elif corrupt == "queued":
        pool.free_queue.append_n([0])
    else:
        pool.block_hash[0] = ("h", 0)
    with pytest.raises(AssertionError):
        pool._check()


@pytest.mark.parametrize("bad", [5, 6, -1, "3"])
def test_free_queue_check_finds_ids_out_of_range(bad):
    pool = BlockPool(5)
    pool.free_queue._order[bad] = None  # corrupt: not a usable block id 1..4
    with pytest.raises(AssertionError, match="free queue holds"):
        pool.free_queue._check(pool.num_blocks)


@pytest.mark.parametrize("insert", ["append_n", "prepend_n"])
def test_free_queue_refuses_a_block_twice(insert):
    """vLLM's linked list would be corrupted by a block linked twice; the model's queue refuses it,
    whether the block is queued already or listed twice in one call, and changes nothing."""
    queue = FreeBlockQueue([1, 2])
    for ids in ([2], [3, 3], [4, 1]):
        with pytest.raises(QueueCorruptionError, match="in the free queue twice"):
            getattr(queue, insert)(ids)
        assert list(queue) == [1, 2]


def test_prefix_map_pop_removes_only_what_is_there():
    """``PrefixMap.pop``: True iff the block was listed under the key; anything else changes nothing."""
    m = PrefixMap()
    m.insert(("h", 0), 3)
    m.insert(("h", 0), 4)
    assert m.pop(("g", 0), 3) is False and m.pop(("h", 0), 5) is False
    assert list(m.items()) == [(("h", 0), [3, 4])]
    assert m.pop(("h", 0), 3) is True and list(m.items()) == [(("h", 0), [4])]
    assert m.pop(("h", 0), 4) is True and list(m.items()) == []


def test_pool_check_finds_ref_queue_mismatch():
    pool = BlockPool(5)
    (b,) = pool.get_new_blocks(1)
    pool.ref_cnt[b] = 0  # corrupt: ref 0 but not queued
    with pytest.raises(AssertionError, match="I1"):
        pool._check()


def test_scheduler_check_runs_the_local_catalogue():
    sched = make_scheduler(OffloadConfig(policy="repair", **SYNC))
    eng = Engine(sched)
    eng.apply({"op": "add", "rid": "a", "family": 0, "prompt_len": 40})
    eng.apply({"op": "step", "admit": ["a"]})
    eng.apply({"op": "step"})
    sched._check()
    sched.in_flight_store_gpu_blocks.add(sched.gpu_pool.num_blocks - 1)  # corrupt: I7
    with pytest.raises(AssertionError, match="I7"):
        sched._check()
