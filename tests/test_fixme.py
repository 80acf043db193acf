"""The FIXME of vLLM 0.33.0 (docs/vllm-semantics.md §8 T2, §10.15), through the engine model.

Under ``baseline`` a decoding request's own store evicts its first two CPU entries;
the cursor has passed them, so nothing stores them again. The completeness property
C1 names the hole by request, group and position, and a new request with the same
prompt gets a CPU hit of 0 tokens (the missing first block breaks the chain).
"""

from __future__ import annotations

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import check


def _t2(policy: str) -> Engine:
    e = Engine(make_scheduler(OffloadConfig(num_cpu_blocks=5, policy=policy, async_scheduling=False)))
    e.op_add("R", family=1, prompt_len=97, max_tokens=8)
    e.op_step(admit=["R"], chunk=64)  # t1: 4 blocks prefilled
    m = e.op_step(chunk=64)  # t2: confirmed 64 -> g1..g4 -> c1..c4
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [1, 2, 3, 4], [1, 2, 3, 4])
    e.op_report(0)
    m = e.op_step()  # t3: confirmed 97 -> g5, g6 -> pops c1, c2, evicting H1, H2
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (1, [5, 6], [1, 2])
    e.op_report(1)
    return e


def test_t2_hole_is_reported_by_c1_with_request_and_position() -> None:
    e = _t2("baseline")
    r = e.requests["R"]
    snap = e.snapshot()
    assert snap["scheduler"]["reqs_to_store"]["R"]["num_stored_blocks"] == [6]
    holes = check(snap, ["C1"])
    assert [(v.id, v.requests, v.blocks) for v in holes] == [("C1", ("R",), (1,)), ("C1", ("R",), (2,))]
    assert "group 0 position 0" in holes[0].message and "group 0 position 1" in holes[1].message
    assert f"{r.block_hashes[0]}:0" in holes[0].message
    # the rest of the catalogue is quiet: the FIXME breaks only completeness
    assert [v.id for v in check(snap) if v.id not in ("C1", "C2")] == []


def test_t2_same_prompt_gets_no_cpu_hit() -> None:
    e = _t2("baseline")
    hashes = list(e.requests["R"].block_hashes)  # a finished request nothing names is retired
    e.op_finish("R")  # the flush scans [6, 6): nothing
    assert e.target.pending_finished_stores == []
    e.op_add("R2", family=1, prompt_len=97)
    assert e.target.get_num_new_matched_tokens(e.requests["R2"], 0) == (0, False)
    assert e.target.pending_cpu_hits == {}
    # H3..H6 are still on the CPU: the chain breaks at H1 only
    cached = {k.partition(":")[0] for k in e.snapshot()["cpu_pool"]["cached"]}
    assert cached == set(hashes[2:6])
