"""Time per operation of the second manager's targets at scale: the implementation on tensors
(``impl``) against the model (``model``), and vLLM 0.33.0's own ``CPUOffloadingManager``
(``vllm``, through kvspec's adapter, which adds the contract's input checks) when vLLM is
importable.

    python scripts/bench_offloading.py [--chunks 100000] [--batch 64] [--rounds 30] [--runs 3]
                                       [--policy lru,arc] [--targets model,impl,vllm]

With vLLM, from this checkout: ``PYTHONPATH=$PWD /work/main/.vllm-venv/bin/python scripts/bench_offloading.py``.

Workload, per run and target (a fresh target each time, one torch thread): the pool is first
filled (untimed) by requests that each store ``batch`` new keys with declared positions and
complete them. Then each timed round is what vLLM's connector does for one request: a new
request declares the positions of its keys; it looks up 16 keys of a request stored a few
rounds ago, one ``lookup`` per key, and loads the hits (``prepare_load``); it offers
``batch`` new keys (``prepare_store``: the pool is full, so each store evicts ``batch``
chunks, never the ones being loaded); the store and the load complete; the request finishes.
Every target gets the same calls, and the script checks that they answer them alike.

Printed: per operation kind, the median time per call of each target and the ratios to the
model (target / model: below 1 is faster than the model), for the first run and as medians of
the per-run ratios over all runs. Absolute times are printed only next to their ratios, and
only describe this machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def _use_this_checkout() -> None:
    """Under a venv where kvspec is installed editable from another checkout (the vLLM venv),
    ``PYTHONPATH`` brings this checkout's ``kvspec`` but the installed mapping still sends
    ``kvspec.impl`` elsewhere: point it here too."""
    import kvspec.impl

    here = str(REPO / "impl")
    if here not in list(kvspec.impl.__path__):
        kvspec.impl.__path__.insert(0, here)


_use_this_checkout()

from kvspec.contract.errors import ConfigError  # noqa: E402
from kvspec.contract.offloading import OffloadingConfig, OffloadingManagerTarget, OffloadKey  # noqa: E402
from kvspec.impl.offloading import make_offloading_impl  # noqa: E402
from kvspec.model.offloading import make_offloading_manager  # noqa: E402

OPS = ("positions", "lookup", "load", "store", "store_done", "load_done", "finish")
LOOKUPS = 16
BLOCK = 16


def _factories(names: list[str]) -> dict[str, Callable[[OffloadingConfig], OffloadingManagerTarget]]:
    out: dict[str, Callable[[OffloadingConfig], OffloadingManagerTarget]] = {}
    for name in names:
        if name == "model":
            out[name] = make_offloading_manager
        elif name == "impl":
            out[name] = make_offloading_impl
        elif name == "vllm":
            try:
                from kvspec.adapters.vllm_offloading import _import_vllm, make_vllm_offloading_target

                _import_vllm(None)
            except ConfigError as exc:
                print(f"vllm: skipped ({exc})")
                continue
            out[name] = make_vllm_offloading_target
        else:
            raise SystemExit(f"unknown target {name!r}: model, impl, vllm")
    return out


def _keys(first: int, n: int) -> list[OffloadKey]:
    return [(f"{i:016x}", 0) for i in range(first, first + n)]


class Workload:
    """The same calls for every target; ``answers`` keeps what each call returned."""

    def __init__(self, target: OffloadingManagerTarget, batch: int) -> None:
        self.t = target
        self.batch = batch
        self.serial = 0
        self.next_key = 0
        self.stored: list[list[OffloadKey]] = []  # each request's keys, in order
        self.times: dict[str, list[int]] = defaultdict(list)
        self.answers: list[Any] = []

    def _timed(self, kind: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter_ns()
        out = call()
        self.times[kind].append(time.perf_counter_ns() - start)
        self.answers.append(out)
        return out

    def _request(self) -> tuple[str, list[OffloadKey]]:
        self.serial += 1
        rid = f"r{self.serial}"
        keys = _keys(self.next_key, self.batch)
        self.next_key += self.batch
        self.t.on_new_request(rid)
        return rid, keys

    def fill(self) -> None:
        """Untimed: store until the pool is full."""
        while self.next_key + self.batch <= self.t.config.num_chunks:
            rid, keys = self._request()
            self.t.set_key_positions(rid, [(k, (i + 1) * BLOCK) for i, k in enumerate(keys)])
            out = self.t.prepare_store(rid, keys)
            assert out is not None and not out.evicted_keys
            self.t.complete_store(rid, out.keys_to_store)
            self.t.on_request_finished(rid)
            self.stored.append(keys)
        self.times.clear()

    def round(self) -> None:
        rid, keys = self._request()
        t = self.t
        self._timed("positions", lambda: t.set_key_positions(rid, [(k, (i + 1) * BLOCK) for i, k in enumerate(keys)]))
        earlier = self.stored[-4][:LOOKUPS] if len(self.stored) >= 4 else []
        hits: list[OffloadKey] = []
        for key in earlier:
            if self._timed("lookup", lambda key=key: t.lookup(rid, key)) != "HIT":  # type: ignore[misc]
                break
            hits.append(key)
        if hits:
            self._timed("load", lambda: t.prepare_load(rid, hits))
        out = self._timed("store", lambda: t.prepare_store(rid, keys))
        if out is not None:
            self._timed("store_done", lambda: t.complete_store(rid, out.keys_to_store))
        if hits:
            self._timed("load_done", lambda: t.complete_load(rid, hits))
        self._timed("finish", lambda: t.on_request_finished(rid))
        self.stored.append(keys)


def _normalise(answer: Any) -> Any:
    if hasattr(answer, "keys_to_store"):
        return (list(answer.keys_to_store), list(answer.chunk_ids), list(answer.evicted_keys))
    return answer


def run_once(factories: dict[str, Callable[[OffloadingConfig], OffloadingManagerTarget]], config: OffloadingConfig,
             batch: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per target, per operation kind: the median nanoseconds per call; plus ``round``, the
    median total of one round."""
    medians: dict[str, dict[str, float]] = {}
    answers: dict[str, list[Any]] = {}
    for name, factory in factories.items():
        gc.collect()
        w = Workload(factory(config), batch)
        w.fill()
        totals = []
        for _ in range(rounds):
            before = sum(sum(v) for v in w.times.values())
            w.round()
            totals.append(sum(sum(v) for v in w.times.values()) - before)
        medians[name] = {op: statistics.median(w.times[op]) for op in OPS if w.times[op]}
        medians[name]["round"] = statistics.median(totals)
        answers[name] = [_normalise(a) for a in w.answers]
    names = list(answers)
    for name in names[1:]:
        if answers[name] != answers[names[0]]:
            raise SystemExit(f"{name} answered the workload differently from {names[0]}")
    return medians


def _table(title: str, per_target: dict[str, dict[str, float]], ratios: dict[str, dict[str, float]]) -> None:
    names = list(per_target)
    print(title)
    head = f"  {'operation':<11}" + "".join(f"{n + ' us':>12}" for n in names)
    head += "".join(f"{n + '/model':>13}" for n in names if n != "model")
    print(head)
    for op in (*OPS, "round"):
        if not all(op in per_target[n] for n in names):
            continue
        line = f"  {op:<11}" + "".join(f"{per_target[n][op] / 1000:>12.1f}" for n in names)
        line += "".join(f"{ratios[n][op]:>13.3f}" for n in names if n != "model")
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--policy", default="lru,arc")
    ap.add_argument("--targets", default="model,impl,vllm")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    factories = _factories(args.targets.split(","))
    if "model" not in factories:
        raise SystemExit("the ratios are to the model: include it in --targets")
    print(f"{args.chunks} chunks, {args.batch} keys per store (each evicting {args.batch} once full), "
          f"{LOOKUPS} lookups and a load per round, {args.rounds} rounds per run, {args.runs} runs; "
          f"torch {torch.__version__}, 1 thread; python {sys.version.split()[0]}")
    for policy in args.policy.split(","):
        config = OffloadingConfig(num_chunks=args.chunks, policy=policy)
        runs = [run_once(factories, config, args.batch, args.rounds) for _ in range(args.runs)]
        ratio_runs = [{n: {op: r[n][op] / r["model"][op] for op in r[n]} for n in r} for r in runs]
        _table(f"\n[{policy}] run 1: median per call, ratio to the model", runs[0], ratio_runs[0])
        med_times = {n: {op: statistics.median(r[n][op] for r in runs) for op in runs[0][n]} for n in runs[0]}
        med_ratios = {n: {op: statistics.median(r[n][op] for r in ratio_runs) for op in runs[0][n]}
                      for n in runs[0]}
        _table(f"[{policy}] medians over {args.runs} runs (of the per-run medians and of the per-run ratios)",
               med_times, med_ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
