"""The abstract states a counterexample may start from so that an engine trace can reach it.

The completeness counterexamples (T2, H1, H3) are asked for inside this fragment, so every
model Z3 returns is a state that ``kvspec.drivers.synthesis`` builds on the engine, position
for position (PROOFS.md, "Counterexamples become traces"). The focal request is active; with
several groups they are *twins* (every group equals group 0 in length, cursor and every array,
and a step leaves the same positions cached in each); with ``k`` group 0's cursor and ``c`` the
confirmed count (``1 <= k <= c <= MAX_CONF``):

* ``N`` is ``c`` or ``c + 1``; positions below ``c`` are hashed and owned, position ``c`` (when
  ``N = c + 1``) is a partial block: neither hashed nor owned, nor cached, nor in flight;
  ``N = c`` only with ``k < c``;
* below the cursor each position is one of ``statuses``: in flight (``I``), cached with its copy
  in the CPU free queue (``C``), a hole (``H``: neither), or (repair's convergence
  counterexamples) a hole with a lost record (``L``); from the cursor on, none of these;
* lost records only at ``L`` positions, no retained copies; the signal-rescan flag is set iff
  there is a hole (baseline, repair: never set);
* a planning step's free count is the number of cached copies in the free queue, over the
  groups (the synthesiser's CPU pool holds nothing else that is free).

What it leaves out: copies pinned out of the free queue, positions above the cursor that
other requests stored, groups that differ, sliding windows, repair's records other than
an evicted copy's (``L``). Size:
O(G x POSITIONS) constraints.
"""

from __future__ import annotations

import z3

from kvspec.specs.encoding import ARRAYS, Encoding, State
from kvspec.specs.transitions import Step

MAX_CONF = 6
POSITIONS = 8  # positions read from a model (>= MAX_CONF + 1)
STATUSES = ("I", "C", "H")  # in flight, cached and free, hole (the completeness counterexamples)


def status_bits(enc: Encoding, s: State, p: int) -> dict[str, z3.BoolRef]:
    """Position ``p`` of group 0 is in flight, cached-and-free, a hole without or with a lost
    record (exactly one holds below the cursor in the fragment)."""
    infl, cached, cfree, lost = (enc.v(s, 0, a, p) for a in ("infl", "cached", "cfree", "lost"))
    uncovered = z3.And(z3.Not(infl), z3.Not(cached), z3.Not(cfree))
    return {"I": z3.And(infl, z3.Not(cached), z3.Not(cfree), z3.Not(lost)),
            "C": z3.And(cached, cfree, z3.Not(infl), z3.Not(lost)),
            "H": z3.And(uncovered, z3.Not(lost)),
            "L": z3.And(uncovered, lost)}


def _twins(enc: Encoding, s: State, names: tuple[str, ...]) -> list[z3.BoolRef]:
    """Every group of ``s`` equals group 0 in length, cursor and the arrays ``names``."""
    out: list[z3.BoolRef] = []
    for g in range(1, enc.G):
        out += [s.groups[g].n == s.groups[0].n, s.groups[g].cur == s.groups[0].cur]
        out += [enc.v(s, g, a, p) == enc.v(s, 0, a, p) for a in names for p in range(POSITIONS)]
    return out


def realizable(enc: Encoding, policy: str, s: State, step: Step,
               statuses: tuple[str, ...] = STATUSES) -> list[z3.BoolRef]:
    """The fragment's constraints on pre-state ``s`` and the ``step`` taken from it, each
    position below the cursor of one of ``statuses``."""
    g, conf = s.groups[0], s.conf
    out: list[z3.BoolRef] = [s.active, 1 <= g.cur, g.cur <= conf, conf <= MAX_CONF,
                             z3.Or(g.n == conf + 1, z3.And(g.n == conf, g.cur < conf))]
    holes = []
    for p in range(POSITIONS):
        st = status_bits(enc, s, p)
        holes.append(z3.And(p < g.cur, st["H"]))
        out += [enc.v(s, 0, "hashed", p) == (p < conf), enc.v(s, 0, "owned", p) == (p < conf),
                z3.Not(enc.v(s, 0, "kept", p)),
                z3.If(p < g.cur, z3.Or([st[x] for x in statuses]), st["H"])]
    out.append(s.flag == z3.Or(holes) if policy == "signal-rescan" else z3.Not(s.flag))
    out += _twins(enc, s, ARRAYS) + _twins(enc, step.post, ("cached",))
    if "free" in step.inputs:
        copies = z3.Sum([z3.If(enc.v(s, 0, "cfree", p), 1, 0) for p in range(POSITIONS)])
        out.append(step.inputs["free"] == enc.G * copies)
    return out
