"""Campaigns on every core, or on a Ray cluster: the same jobs in N processes, findings deduplicated.

A campaign is a picklable function applied to a list of items, results in item order
(``map_jobs``): in this process (one worker), in N spawned processes, or, with a Ray address,
as Ray tasks on that cluster (``kvspec[ray]``; the driver gathers every result). ``kvspec
fuzz`` maps one job over N seeds: worker ``i`` of ``n`` runs with seed ``seed * n + i``
(distinct for every worker and, for one worker, the campaign's own seed), for the whole
budget or until its first finding; ``kvspec bugs`` and ``verify`` map over their hunts and
stages, so their results do not depend on N. Two findings are the same when they break the
same invariant (or crash the same way) with the same shrunk trace up to renaming the
requests (``dedupe_key``).

Every worker runs torch with one intra-op thread (``single_threaded``): a campaign's tensors
are tiny, and on a busy machine a parallel region of a few microseconds of work can wait
milliseconds for a descheduled helper thread (measured: ``repeat_interleave`` of 6 elements,
28 ms with 2 threads on 2 loaded cores, 5 us with 1). Parallelism comes from the workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Generic, TypeVar, cast

from kvspec.contract.errors import ConfigError

R = TypeVar("R")
MAX_WORKERS = 256


def worker_seeds(seed: int, workers: int) -> list[int]:
    """The distinct seed of each worker (worker 0 of 1 keeps ``seed``)."""
    return [seed * workers + i for i in range(workers)]


AUTO_WORKERS = "auto"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it), at most
    ``MAX_WORKERS``."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_WORKERS))


def check_workers(workers: object, ray: object = None) -> int:
    """``--workers``: an integer in 1..MAX_WORKERS, or ``auto``, one per usable core of this
    machine (``usable_cores``; refused with ``--ray``, whose cluster is not this machine)."""
    if workers == AUTO_WORKERS:
        if ray is not None:
            raise ConfigError("--workers auto counts this machine's cores; with --ray give the number of workers")
        return usable_cores()
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"--workers must be an integer in 1..{MAX_WORKERS} or auto, got {str(workers)[:20]!r}")
    return workers


def check_ray(address: object) -> str | None:
    """``--ray``: None (no Ray), ``auto`` or ``HOST:PORT``; Ray must be importable, and a
    ``HOST:PORT`` must accept a connection (``_reach_ray``), before any work starts."""
    if address is None:
        return None
    if not isinstance(address, str) or not (address == "auto" or _host_port(address)):
        raise ConfigError(f"--ray must be auto or HOST:PORT, got {str(address)[:60]!r}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'kvspec[ray]'") from None
    if address != "auto":
        _reach_ray(address)
    return address


def _host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def single_threaded() -> None:
    """One torch intra-op thread in this process (module docstring); a no-op without torch."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


class Partial(KeyboardInterrupt, Generic[R]):
    """Raised by a job that Ctrl-C stopped but that has something to show for it (a stage's row
    saying how far it got): ``map_jobs`` keeps ``result`` as the item's result."""

    def __init__(self, result: R) -> None:
        super().__init__(result)  # the one argument, so that it crosses a process boundary
        self.result = result


class JobsInterrupted(KeyboardInterrupt, Generic[R]):
    """Ctrl-C stopped a campaign: ``results[i]`` is item ``i``'s result (or a ``Partial``'s), or
    None where its job never ran or was stopped with nothing to show."""

    def __init__(self, results: list[R | None]) -> None:
        super().__init__()
        self.results = results

    def done(self) -> list[R]:
        return [r for r in self.results if r is not None]


# Worker processes: SIGINT stops the job running (KeyboardInterrupt, once) and every job not yet
# started (refused at once), so that a campaign stops as soon as its parent forwards Ctrl-C.
_stopping = False
_busy = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _stopping
    if _stopping:
        return  # a second SIGINT (the terminal's and the parent's): the job is already stopping
    _stopping = True
    if _busy:
        raise KeyboardInterrupt


def _worker_start() -> None:
    single_threaded()
    signal.signal(signal.SIGINT, _on_sigint)


def _in_worker(job: Callable[[Any], R], item: Any) -> R:
    single_threaded()
    return job(item)


def _in_pool_worker(job: Callable[[Any], R], item: Any) -> R:
    global _busy
    if _stopping:
        raise KeyboardInterrupt
    _busy = True
    try:
        return job(item)
    finally:
        _busy = False


def map_jobs(job: Callable[[Any], R], items: Sequence[Any], workers: int, ray: str | None = None) -> list[R]:
    """``job(item)`` for each item, results in item order: as Ray tasks on the cluster at ``ray``
    (one CPU each), else in ``workers`` spawned processes, else (one worker) in this one.

    Ctrl-C, whether the terminal sends it to every process or only this one gets it, stops the
    jobs running (the parent forwards SIGINT to its workers) and those not yet started, then
    raises ``JobsInterrupted`` with the results there are: a job that handles Ctrl-C itself (the
    fuzzer returns its statistics so far) or raises ``Partial`` has one."""
    if ray is not None:
        return _on_ray(job, items, ray)
    if check_workers(workers) == 1 or len(items) <= 1:
        out: list[R] = []
        try:
            for x in items:
                out.append(_in_worker(job, x))
        except Partial as stop:
            raise JobsInterrupted([*out, stop.result, *[None] * (len(items) - len(out) - 1)]) from None
        except KeyboardInterrupt:
            raise JobsInterrupted([*out, *[None] * (len(items) - len(out))]) from None
        return out
    return _in_processes(job, items, min(workers, len(items)))


def _in_processes(job: Callable[[Any], R], items: Sequence[Any], workers: int) -> list[R]:
    ctx = multiprocessing.get_context("spawn")  # no state shared with the parent beyond the job
    stopped = False
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_start) as pool:
        futures: list[Future[R]] = [pool.submit(_in_pool_worker, job, x) for x in items]
        try:
            wait(futures)
        except KeyboardInterrupt:
            stopped = True
            for f in futures:
                f.cancel()
            _signal_workers(signal.SIGINT)
            try:
                wait(futures)
            except KeyboardInterrupt:  # a second Ctrl-C: no waiting for the workers' statistics
                _signal_workers(signal.SIGKILL)
    results: list[R | None] = [None] * len(items)
    for i, f in enumerate(futures):
        if f.cancelled():
            continue
        exc = f.exception()
        if exc is None:
            results[i] = f.result()
        elif isinstance(exc, Partial):
            stopped, results[i] = True, exc.result
        elif isinstance(exc, KeyboardInterrupt) or (stopped and isinstance(exc, BrokenProcessPool)):
            stopped = True
        else:
            raise exc
    if stopped:
        raise JobsInterrupted(results)
    return cast(list[R], results)


def _signal_workers(signum: int) -> None:
    """Send ``signum`` to every live worker process of this one."""
    for p in multiprocessing.active_children():
        if p.pid is not None:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


RAY_CONNECT_TIMEOUT_S = 10.0  # how long a --ray HOST:PORT may take to accept a connection


def _reach_ray(address: str) -> None:
    """Refuse (``ConfigError``, naming the address) a ``HOST:PORT`` where nothing accepts a
    connection within ``RAY_CONNECT_TIMEOUT_S``: ``ray.init`` would wait for it far longer."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        why = f"no answer within {RAY_CONNECT_TIMEOUT_S:.0f} s" if isinstance(exc, TimeoutError) \
            else exc.strerror or type(exc).__name__
        raise ConfigError(f"--ray {address}: no Ray cluster reachable there ({why}); start one on that machine "
                          f"with `ray start --head --port {port}`, or check the address") from None


def _on_ray(job: Callable[[Any], R], items: Sequence[Any], address: str) -> list[R]:
    import logging

    import ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:  # Ray's "could not find any running Ray instance", among others
        if address == "auto":
            raise ConfigError("--ray auto: no running Ray cluster found on this machine (start one with "
                              "`ray start --head`, set RAY_ADDRESS to a cluster's address, or pass --ray "
                              "HOST:PORT; without --ray the workers run here)") from None
        raise ConfigError(f"--ray {address}: cannot join the Ray cluster there ({str(exc)[:200]})") from None
    try:
        task: Any = ray.remote(num_cpus=1)(_in_worker)
        return list(ray.get([task.remote(job, x) for x in items]))
    finally:
        ray.shutdown()


def run_workers(job: Callable[[int], R], seed: int, workers: int, ray: str | None = None) -> list[R]:
    """``job(worker_seed)`` for each of ``workers`` seeds (``map_jobs``)."""
    return map_jobs(job, worker_seeds(seed, check_workers(workers)), workers, ray)


def canonical_ops(ops: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ops`` with request ids renamed ``r0, r1, ...`` in order of first appearance."""
    names: dict[str, str] = {}

    def rename(rid: Any) -> Any:
        if not isinstance(rid, str):
            return rid
        return names.setdefault(rid, f"r{len(names)}")

    out = []
    for op in ops:
        new = dict(op)
        if "rid" in new:
            new["rid"] = rename(new["rid"])
        for key in ("admit", "preempt"):
            if isinstance(new.get(key), list):
                new[key] = [rename(r) for r in new[key]]
        out.append(new)
    return out


def dedupe_key(signature: tuple[str | None, str | None], config: dict[str, Any],
               ops: Iterable[dict[str, Any]]) -> str:
    """What makes two findings one: kind and invariant (or crash), configuration, shrunk trace
    up to renaming the requests."""
    import json

    return json.dumps([list(signature), config, canonical_ops(ops)], sort_keys=True)


@dataclass
class Distinct:
    """Findings by ``dedupe_key``: ``first`` keeps each key's first finding, ``count`` how many
    workers found it."""

    first: dict[str, Any] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, finding: Any) -> bool:
        """True when ``finding`` is new."""
        self.count[key] = self.count.get(key, 0) + 1
        if key in self.first:
            return False
        self.first[key] = finding
        return True
