"""The implementation's batched rules against the scalar rules of ``kvspec.model.rules``.

The scalar paths of ``kvspec.impl`` call the rule functions; the batched paths compute the
same rules over tensors. Each test draws random inputs and compares element by element:
ready blocks and window floors (``kvspec.impl.batched_rules``), the classification of store
candidates and the positional scan (``kvspec.impl.planner``, one request).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvspec.impl.batched_rules import ready_blocks, window_floors
from kvspec.impl.planner import Candidates, PoolReads, candidate_layout, classify, decide
from kvspec.model import rules

SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_ready_blocks_batched_is_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    k, G, B = rng.randint(1, 6), rng.randint(1, 3), rng.choice([1, 4, 16])
    computed = [rng.randint(0, 200) for _ in range(k)]
    placeholders = [rng.randint(0, 40) for _ in range(k)]
    lengths = [[rng.randint(0, 20) for _ in range(G)] for _ in range(k)]
    done = torch.tensor([c - p for c, p in zip(computed, placeholders, strict=True)], dtype=torch.int64)
    got = ready_blocks(done, torch.tensor(lengths, dtype=torch.int64), B).tolist()
    want = [[rules.ready_blocks(computed[i], placeholders[i], lengths[i][g], B) for g in range(G)] for i in range(k)]
    assert got == want


@pytest.mark.parametrize("seed", SEEDS)
def test_window_floors_batched_is_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    n, B = rng.randint(1, 30), rng.choice([1, 4, 16])
    computed = [rng.randint(0, 300) for _ in range(n)]
    placeholders = [rng.randint(0, min(c, 4)) for c in computed]
    windows = [rng.randint(1, 64) for _ in range(n)]
    confirmed = torch.tensor([c - p for c, p in zip(computed, placeholders, strict=True)])
    got = window_floors(confirmed, torch.tensor(windows), B).tolist()
    assert got == [rules.window_floor(c, p, w, B) for c, p, w in zip(computed, placeholders, windows, strict=True)]


class _Pools:
    """Random pools for the planner: GPU keys (-1: unhashed), in-flight flags, CPU cache."""

    def __init__(self, rng: random.Random, num_gpu: int, num_keys: int) -> None:
        self.gpu_key = torch.tensor([-1] + [rng.choice([-1, *range(num_keys)]) for _ in range(num_gpu - 1)])
        self.in_flight = torch.tensor([False] + [rng.random() < 0.2 for _ in range(num_gpu - 1)])
        self.cached = {kid for kid in range(num_keys) if rng.random() < 0.3}
        self.cpu_free = rng.randint(0, 8)

    def first_of(self, kids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([0 if k in self.cached else -1 for k in kids.tolist()], dtype=torch.int64)

    def reads(self) -> PoolReads:
        empty = torch.empty(0, dtype=torch.int64)
        return PoolReads(self.gpu_key, self.in_flight, self.first_of, empty, lambda n: empty, self.cpu_free)

    def klass(self, src: int) -> str:
        """The rule's class of a source block (-1: a null entry that nothing recovered)."""
        key = int(self.gpu_key[src]) if src > 0 else -1
        return rules.classify_store_candidate(src <= 0, key >= 0, src > 0 and bool(self.in_flight[src]),
                                              key in self.cached)


@pytest.mark.parametrize("seed", SEEDS)
def test_classify_batched_is_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    pools = _Pools(rng, 12, 6)
    src = torch.tensor([rng.randint(-1, 11) for _ in range(rng.randint(1, 40))], dtype=torch.int64)
    classes = classify(src, True, pools.reads())
    want = [pools.klass(b) for b in src.tolist()]
    assert classes.ready.tolist() == [c == rules.READY for c in want]
    assert classes.already.tolist() == [c == rules.ALREADY_CACHED for c in want]


@pytest.mark.parametrize("seed", SEEDS)
def test_decide_one_request_is_scan_group_per_group(seed: int) -> None:
    """One request: each group scanned from its cursor with ``rules.scan_group`` on the READY
    flags, the selection carried across groups, no group scanned once the free count is used."""
    rng = random.Random(seed)
    G = rng.randint(1, 3)
    pools = _Pools(rng, 16, 8)
    cur = [rng.randint(0, 4) for _ in range(G)]
    ready = [rng.randint(0, 9) for _ in range(G)]
    table = [[rng.randint(1, 15) for _ in range(10)] for _ in range(G)]
    layout = candidate_layout(torch.tensor([cur]), torch.tensor([ready]), False)
    selected: list[int] = []
    advance = [0] * G
    for g in range(G):
        if len(selected) >= pools.cpu_free:
            break
        sources = table[g][cur[g]: ready[g]]
        scan = rules.scan_group([pools.klass(b) == rules.READY for b in sources], len(selected), pools.cpu_free)
        picked, advance[g] = scan[0], scan[1]
        selected += [sources[k] for k in picked]
    if layout is None:
        assert selected == [] and advance == [0] * G
        return
    src = torch.tensor(table)[layout.group, layout.position]
    d = decide(Candidates(layout, src, False), 1, G, pools.reads(), None)
    assert d.src.tolist() == selected
    assert d.advance.tolist() == [advance]
    assert d.cut == 1
