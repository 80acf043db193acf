"""What one operation did, in the engine's terms, read off the snapshots before and after it.

Every sentence here is computed from two engine snapshots (``Engine.snapshot()``, which carries
the engine's measured ``last_plan``) and the operation's own arguments; nothing is taken from
what the target says about itself beyond the state it exposes. ``describe(op, before, after)``
returns the sentences in a fixed order: the operation's own effect (arrivals, preemptions,
admissions with their prefix hits, tokens computed and sampled, window frees, finishes, reset
results), then transfers (stores planned, queued or completed, loads planned or completed),
CPU evictions with the request positions each one hit, cursor moves, lost records, and the
plan the engine measured. Each describer is O(size of the snapshots).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvspec.report.positions import CPU, EMPTY, GPU, LOST, NULL, RECORDED, STORING, Position, SnapshotView

Snapshot = dict[str, Any]
WAITING_STATES = ("waiting", "preempted")

AFTER_EVICTION = {
    LOST: "now a hole below the cursor",
    RECORDED: "now lost, recorded for repair",
    STORING: "being stored again",
    GPU: "still on GPU, not stored",
    CPU: "still cached on CPU",
    NULL: "outside the window",
    EMPTY: "no longer held",
}


def count(n: int, word: str, plural: str = "") -> str:
    """``1 block``, ``2 blocks`` (``plural`` for irregular words)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def span(first: int, last: int) -> str:
    """``p3`` or ``p0-p2``: a run of positions."""
    return f"p{first}" if first == last else f"p{first}-p{last}"


class Observed:
    """One snapshot with the indexes the sentences need: request positions by GPU block and by
    key, and the position states (``SnapshotView``). Building is O(requests x positions)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.view = SnapshotView(snap)
        self.requests: dict[str, dict[str, Any]] = snap["engine"]["requests"]
        self.by_block: dict[int, list[Position]] = {}
        self.by_key: dict[str, list[Position]] = {}
        for rid, r in self.requests.items():
            for g, table in enumerate(r["table"]):
                for p, b in enumerate(table):
                    if b != 0:
                        self.by_block.setdefault(b, []).append(Position(rid, g, p))
                for p, h in enumerate(r["block_hashes"]):
                    self.by_key.setdefault(f"{h}:{g}", []).append(Position(rid, g, p))

    def holders(self, gpu_block: int) -> str:
        """``r3 g0 p1`` for each request position holding ``gpu_block``; ``no request`` if none."""
        return ", ".join(map(str, self.by_block.get(gpu_block, []))) or "no request"

    def gpu_key(self, gpu_block: int) -> str | None:
        key: str | None = self.snap["gpu_pool"]["block_hash"][gpu_block]
        return key

    def state(self, pos: Position) -> str:
        """The position's cell state here (EMPTY when the request is not listed)."""
        if pos.rid not in self.requests:
            return EMPTY
        lane = self.view.lane(pos.rid, pos.group)
        return lane.cells[pos.index] if pos.index < len(lane.cells) else EMPTY


def describe(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """The sentences for one accepted operation (module docstring: their order)."""
    lines = OWN_EFFECT[op["op"]](op, before, after)
    for part in (_stores, _loads, _evictions, _cursor_moves, _lost_records, _plan):
        lines += part(op, before, after)
    return lines


# -- the operation's own effect ------------------------------------------------------------


def _add(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    r = after.requests.get(op["rid"])
    if r is None:
        return [f"request {op['rid']} arrives"]
    return [f"request {op['rid']} arrives: family {op['family']}, {count(r['num_tokens'], 'prompt token')} "
            f"({count(len(r['block_hashes']), 'full block')}), at most {count(op.get('max_tokens', 4), 'new token')}; "
            "waiting"]


def _step(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    asynchronous = after.snap["engine"]["config"].get("async_scheduling", False)
    what = ("schedule, build_connector_meta, forward; then the output of the oldest batch in flight is "
            "processed" if asynchronous else "schedule, build_connector_meta, forward, sample")
    lines = [f"engine step {before.snap['engine']['step']} ({what})"]
    for rid in op.get("preempt", []):
        lines.append(f"{rid} preempted: its GPU blocks are freed and its computed tokens reset to 0")
    for rid in op.get("admit", []):
        lines.append(_admission(rid, op, before, after))
    lines += _tokens(before, after)
    lines += _window_frees(before, after)
    lines += _stops(before, after)
    lines += _deferred(before, after)
    return lines


def _stops(before: Observed, after: Observed) -> list[str]:
    """Requests the step finished by itself (async scheduling: at ``max_tokens``)."""
    lines = []
    for rid, old in before.requests.items():
        r = after.requests.get(rid)
        if old["status"] != "finished" and (r is None or r["status"] == "finished"):
            lines.append(f"{rid} stopped at max_tokens when the batch that sampled its last token was processed: "
                         "request_finished_all_groups (finish flush), then its GPU blocks freed")
    return lines


def _deferred(before: Observed, after: Observed) -> list[str]:
    """GPU blocks set aside until the batch in flight is processed, and those returned to the pool."""
    old = [tuple(b) for b in before.snap["engine"].get("deferred_frees", [])]
    new = [tuple(b) for b in after.snap["engine"].get("deferred_frees", [])]
    lines = []
    returned = [b for blocks in old if blocks not in new for b in blocks]
    if returned:
        lines.append(f"GPU blocks {', '.join(map(str, returned))} returned to the pool (their batch was processed)")
    added = [b for blocks in new if blocks not in old for b in blocks]
    if added:
        lines.append(f"GPU blocks {', '.join(map(str, added))} set aside: a batch in flight still writes them "
                     "(freed when it is processed)")
    return lines


def _admission(rid: str, op: dict[str, Any], before: Observed, after: Observed) -> str:
    """How ``rid`` was admitted: its status, and its GPU prefix hit (``_hit_positions``)."""
    r = after.requests.get(rid)
    if r is None or r["status"] in WAITING_STATES:
        status = r["status"] if r is not None else "unknown"
        return (f"{rid} not admitted this step (the GPU pool was short for it or for an admission listed "
                f"before it): still {status}")
    earlier = [q for q, old in before.requests.items() if old["status"] == "running"]
    earlier += op["admit"][:op["admit"].index(rid)]
    hits = [(g, _hit_positions(rid, g, earlier, before, after)) for g in range(len(r["table"]))]
    hits = [(g, where) for g, where in hits if where]
    if not hits:
        where = "no GPU prefix hit"
    else:
        size = after.snap["engine"]["config"]["block_size"]
        tokens = max(where[-1] + 1 for _, where in hits) * size
        spans = [f"g{g} {span(where[0], where[-1])}" for g, where in hits]
        nulls = [f"g{g} {span(0, where[0] - 1)}" for g, where in hits if where[0] > 0]
        where = f"GPU prefix hit of {count(tokens, 'token')}: {', '.join(spans)}"
        if nulls:
            where += f"; {', '.join(nulls)} null, out of the window"
    waits = "; it waits for its CPU load" if r["status"] == "waiting_for_remote_kvs" else ""
    return f"{rid} admitted ({where}){waits}"


def _hit_positions(rid: str, g: int, earlier: list[str], before: Observed, after: Observed) -> list[int]:
    """The positions of group ``g`` that ``rid``'s GPU prefix hit gave it: its table's leading run of
    blocks carrying their position's key that were cached before the step, or that a request
    scheduled before ``rid`` in the step (``earlier``: the running ones, then the admissions listed
    before it) holds at the same position (hashed in this very step: only a hit shares a block),
    after the null positions a sliding window leaves at the start. O(positions x earlier)."""
    r = after.requests[rid]
    table, keys = r["table"][g], [f"{h}:{g}" for h in r["block_hashes"]]
    cached_before, cached_after = before.snap["gpu_pool"]["block_hash"], after.snap["gpu_pool"]["block_hash"]
    hits: list[int] = []
    for p, b in enumerate(table[:len(keys)]):
        if b == 0:
            if hits:
                break
            continue
        shared = any(p < len(t) and t[p] == b for q in earlier if q in after.requests
                     for t in [after.requests[q]["table"][g]])
        if not (cached_before[b] == keys[p] or (shared and cached_after[b] == keys[p])):
            break
        hits.append(p)
    return hits


def _tokens(before: Observed, after: Observed) -> list[str]:
    """Computed and sampled tokens per request that changed (preemptions excluded)."""
    lines = []
    for rid, r in after.requests.items():
        old = before.requests.get(rid)
        if old is None or r["status"] == "preempted":
            continue
        computed, sampled = r["num_computed_tokens"] - old["num_computed_tokens"], r["num_tokens"] - old["num_tokens"]
        if computed == 0 and sampled == 0:
            continue
        more = f", {count(sampled, 'token')} sampled" if sampled else ""
        if r["num_output_placeholders"]:
            more += f" ({count(r['num_output_placeholders'], 'placeholder')} for tokens still in flight)"
        lines.append(f"{rid}: computed tokens {old['num_computed_tokens']} -> {r['num_computed_tokens']} "
                     f"of {r['num_tokens']}{more}")
    return lines


def _window_frees(before: Observed, after: Observed) -> list[str]:
    """Sliding-window positions whose block became the null block (freed; the connector is not told)."""
    lines = []
    for rid, r in after.requests.items():
        old = before.requests.get(rid)
        if old is None:
            continue
        for g, (t_old, t_new) in enumerate(zip(old["table"], r["table"], strict=True)):
            freed = [p for p in range(min(len(t_old), len(t_new))) if t_old[p] != 0 and t_new[p] == 0]
            if freed:
                blocks = ", ".join(str(t_old[p]) for p in freed)
                lines.append(f"{rid} g{g}: {span(freed[0], freed[-1])} left the sliding window "
                             f"(GPU block{'s' if len(freed) > 1 else ''} {blocks} freed)")
    return lines


def _report(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    e = str(op["event"])
    world = after.snap["engine"]["config"]["world_size"]
    left = after.snap["engine"]["reports_left"].get(e)
    tail = f"{left} of {world} still to report" if left is not None else "all ranks have reported"
    return [f"{count(op.get('count', 1), 'worker rank')} report store event {e} done ({tail})"]


def _load_done(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    r = after.requests.get(op["rid"])
    status = r["status"] if r is not None else "retired"
    return [f"the workers report {op['rid']}'s load complete (finished_recving); {op['rid']} is {status}"]


def _finish(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    rid = op["rid"]
    old = before.requests.get(rid, {})
    shown = f" with {old['num_computed_tokens']}/{old['num_tokens']} tokens computed" if old else ""
    freed = "after its load" if after.requests.get(rid, {}).get("free_after_load") else "now"
    if len(after.snap["engine"].get("deferred_frees", [])) > len(before.snap["engine"].get("deferred_frees", [])):
        freed = "when the batch in flight that writes them is processed"
    return [f"{rid} finishes (it was {old.get('status', 'unknown')}{shown}): request_finished_all_groups, "
            f"its GPU blocks freed {freed}"]


def _reset(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    result = after.snap["engine"]["last_result"] or [None, None]
    return [f"reset_prefix_cache(reset_connector=True): GPU pool returned {result[0]}, connector returned "
            f"{result[1]}"]


OWN_EFFECT: dict[str, Callable[[dict[str, Any], Observed, Observed], list[str]]] = {
    "add": _add, "step": _step, "report": _report, "load_done": _load_done, "finish": _finish, "reset": _reset,
}


# -- transfers -------------------------------------------------------------------------------


def _pairs(obs: Observed, gpu: Iterable[int], cpu: Iterable[int], arrow: str) -> str:
    """``GPU 3 -> CPU 1 (84c6…:0 of r3 g0 p1)`` for each pair of a transfer."""
    parts = []
    for g, c in zip(gpu, cpu, strict=True):
        parts.append(f"GPU {g} {arrow} CPU {c} ({obs.gpu_key(g) or 'unhashed'} of {obs.holders(g)})")
    return "; ".join(parts)


def _stores(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """Store events planned, completed or abandoned, and finish flushes queued."""
    b, a = before.snap["scheduler"], after.snap["scheduler"]
    lines = []
    for e, t in a["store_events"].items():
        if e not in b["store_events"]:
            lines.append(f"store event {e} planned: {_pairs(after, t['gpu'], t['cpu'], '->')}")
    for e, t in b["store_events"].items():
        if e in a["store_events"]:
            continue
        if e in a["abandoned_store_events"]:
            lines.append(f"store event {e} abandoned: its blocks stay referenced until its reports arrive")
            continue
        outstanding = after.snap["engine"]["reports_left"].get(e)
        if outstanding is not None:
            lines.append(f"store event {e} dropped by the scheduler with {count(outstanding, 'rank report')} "
                         "still outstanding (its copy may not have landed)")
            continue
        cached = after.snap["cpu_pool"]["block_hash"]
        landed = ", ".join(f"CPU {c} = {cached[c] or 'unhashed'}" for c in t["cpu"])
        lines.append(f"store event {e} completed: {landed}")
    queued = a["pending_finished_stores"][len(b["pending_finished_stores"]):] if op["op"] == "finish" else []
    for t in queued:
        lines.append(f"finish flush queued: {_pairs(before, t['gpu'], t['cpu'], '->')}")
    return lines


def _loads(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """Loads planned (CPU to GPU), sent, completed or abandoned; CPU hits pinned or released."""
    b, a = before.snap["scheduler"], after.snap["scheduler"]
    lines = []
    for rid, ls in a["reqs_to_load"].items():
        old = b["reqs_to_load"].get(rid)
        if old is None or old["load_event"] != ls["load_event"]:
            event = "not sent yet" if ls["load_event"] is None else f"load event {ls['load_event']}"
            pairs = "; ".join(f"CPU {c} ({after.snap['cpu_pool']['block_hash'][c] or 'unhashed'}) -> GPU {g} "
                              f"({after.holders(g)})" for g, c in zip(ls["gpu"], ls["cpu"], strict=True))
            lines.append(f"load planned for {rid} ({event}): {pairs}")
    for rid in b["reqs_to_load"]:
        if rid not in a["reqs_to_load"]:
            fate = "abandoned" if rid in a["abandoned_reqs_to_load"] else "done"
            lines.append(f"load of {rid} {fate}")
    for rid, pin in a["pending_cpu_hits"].items():
        if rid not in b["pending_cpu_hits"]:
            n = sum(1 for g in pin["blocks"] for c in g if c != 0)
            lines.append(f"CPU hit of {rid} pinned: {n} CPU blocks, {pin['hit_len']} tokens")
    lines += [f"CPU pin of {rid} released" for rid in b["pending_cpu_hits"] if rid not in a["pending_cpu_hits"]]
    return lines


# -- the CPU map, cursors and records -----------------------------------------------------


def evicted_keys(before: Observed, after: Observed) -> dict[str, int]:
    """Keys cached on CPU before the operation and not after: key -> the CPU block it was in."""
    old, new = before.snap["cpu_pool"]["cached"], after.snap["cpu_pool"]["cached"]
    return {key: ids[0] for key, ids in old.items() if key not in new}


def _evictions(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """Each CPU entry that left the map, and what became of every request position with its key."""
    lines = []
    for key, c in evicted_keys(before, after).items():
        hits = [f"{pos} ({AFTER_EVICTION[after.state(pos)]})" for pos in after.by_key.get(key, [])]
        hit = "; it hit " + ", ".join(hits) if hits else "; no live request holds that key"
        lines.append(f"CPU block {c} evicted {key}{hit}")
    return lines


def _cursor_moves(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """Store cursors (``num_stored_blocks``) that moved, and store state that began or finished."""
    b, a = before.snap["scheduler"]["reqs_to_store"], after.snap["scheduler"]["reqs_to_store"]
    lines = []
    for rid, st in a.items():
        old = b.get(rid)
        if st["finished"]:
            if old is not None and not old["finished"]:
                lines.append(f"{rid}'s store state is marked finished "
                             f"({count(len(st['store_events']), 'event')} outstanding)")
            continue
        was = old["num_stored_blocks"] if old is not None else [0] * len(st["num_stored_blocks"])
        moves = [f"g{g} {x} -> {y}" for g, (x, y) in enumerate(zip(was, st["num_stored_blocks"], strict=True))
                 if x != y]
        if moves:
            lines.append(f"{rid} cursor: {', '.join(moves)}")
    return lines


def _lost_records(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    old, new = before.view.recorded, after.view.recorded
    lines = []
    if new - old:
        lines.append("lost records added: " + ", ".join(map(str, sorted(new - old, key=_order))))
    if old - new:
        lines.append("lost records cleared: " + ", ".join(map(str, sorted(old - new, key=_order))))
    return lines


def _order(pos: Position) -> tuple[str, int, int]:
    return pos.rid, pos.group, pos.index


def _plan(op: dict[str, Any], before: Observed, after: Observed) -> list[str]:
    """The facts the engine measured about this step's (or finish flush's) plan: C3, C5, C6 judge them."""
    plan = after.snap["engine"].get("last_plan")
    if op["op"] not in ("step", "finish") or not plan or (not plan["copies"] and not plan["lost_keys"]):
        return []
    line = (f"plan measured by the engine: {count(plan['copies'], 'store copy', 'store copies')} "
            f"({plan['new_work_copies']} new work, {count(plan['restore_copies'], 're-store')}) "
            f"for {count(plan['lost_keys'], 'lost key')}")
    for name, what in (("unlost_restores", "re-stored though not lost"),
                       ("judged_cached_evicted", "passed as cached, then evicted by the same step"),
                       ("live_useful_evicted", "live, reachable entries evicted")):
        if plan[name]:
            line += f"; {what}: {', '.join(plan[name])}"
    return [line]
