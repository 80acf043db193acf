"""Semantic mutations of the model and the specs, and the layer that catches each.

A ``Mutation`` replaces one exact text (which must occur once) in one file of the repository.
``scripts/mutants.py`` applies each to a scratch copy of the repository (``scratch_copy``) and
runs the checking layers on it; ``specs/PROOFS.md`` keeps the table of what each layer said.
``caught_by`` is the layer that caught the mutation when the table was last measured (the
first, in ``LAYERS`` order, that failed); ``crosshair`` names the contract (``module.function``)
CrossHair must refute when the mutation is a planted bug of the CrossHair list
(``tests/test_crosshair.py``: ``PLANTED`` at the default budget, ``PLANTED_NIGHTLY`` only at
the nightly one).

The layers (``LAYERS``): ``refinement`` (every model step admitted by the transitions:
tests/test_refinement.py's random traces and the stateful refinement machines), ``obligation``
(``kvspec prove`` and the counterexample replays), ``agreement`` (tests/test_spec_agreement.py),
``crosshair`` (the contracts of the pure rules and wrappers, tests/test_crosshair.py), ``tests``
(the invariant, hazard, trace and impl-vs-model tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LAYERS: dict[str, list[str]] = {
    "refinement": ["-m", "pytest", "-x", "-q", "tests/test_refinement.py", "-k",
                   "every_model_step", "tests/test_stateful.py::TestRefineBaseline",
                   "tests/test_stateful.py::TestRefineSignalRescan", "tests/test_stateful.py::TestRefineRepair"],
    "obligation": ["-c", "import sys; from kvspec.cli import main; sys.exit(main(['prove']))"],
    "agreement": ["-m", "pytest", "-x", "-q", "tests/test_spec_agreement.py"],
    "crosshair": ["-m", "pytest", "-x", "-q", "tests/test_crosshair.py", "-k", "no_counterexample"],
    "tests": ["-m", "pytest", "-x", "-q", "tests/test_invariants.py", "tests/test_hazards.py",
              "tests/test_traces_t1_t8.py", "tests/test_regressions.py", "tests/test_spec_counterexamples.py",
              "tests/test_stateful.py", "-k", "not Refine"],
}


@dataclass(frozen=True)
class Mutation:
    """One semantic change: in ``path``, ``old`` (occurring exactly once) becomes ``new``."""

    name: str
    path: str
    old: str
    new: str
    what: str
    caught_by: str
    crosshair: str = ""  # a contract CrossHair must refute (planted-bug list), or ""
    nightly: bool = False  # CrossHair refutes it only at the nightly budget, not the default one


MUTATIONS: tuple[Mutation, ...] = (
    # -- model/rules.py: the pure scan rules ------------------------------------------------------
    Mutation("scan-overselects", "model/rules.py", "            if taken + len(picked) >= free:",
             "            if taken + len(picked) > free:",
             "the positional scan selects one block more than the free count", "refinement",
             "kvspec.model.rules.scan_group"),
    Mutation("scan-passes-its-stop", "model/rules.py", "                return GroupScan(picked, advance, True)",
             "                return GroupScan(picked, advance + 1, True)",
             "out of space, the scan passes the READY position it stopped at", "refinement",
             "kvspec.model.rules.scan_group"),
    Mutation("ready-ignores-placeholders", "model/rules.py", "max(0, computed - placeholders) // block_size",
             "max(0, computed) // block_size",
             "confirmed blocks count output placeholders", "crosshair", "kvspec.model.rules.ready_blocks"),
    Mutation("window-floor-off-by-one", "model/rules.py",
             "    return max(0, computed - placeholders - window + 1) // block_size",
             "    return max(0, computed - placeholders - window + 2) // block_size",
             "the sliding-window floor lets one block too many go", "crosshair",
             "kvspec.model.rules.window_floor"),
    Mutation("cached-before-in-flight", "model/rules.py",
             "    if in_flight:\n        return IN_FLIGHT\n    if cached:\n        return ALREADY_CACHED",
             "    if cached:\n        return ALREADY_CACHED\n    if in_flight:\n        return IN_FLIGHT",
             "a block both cached and in flight is classed 'already cached'", "crosshair",
             "kvspec.model.rules.classify_store_candidate"),
    Mutation("rescan-end-uncapped", "model/rules.py", "    return min(cursor, ready if cap_at_ready else num_ids)",
             "    return min(cursor, num_ids)",
             "Phase 1a rescans past the confirmed blocks", "agreement", "kvspec.model.rules.rescan_end"),
    Mutation("phase-1a-oos-always-stops", "model/rules.py", "    if phase_1a.stopped and oos_stops_scan:",
             "    if phase_1a.stopped:",
             "Phase 1a out of space always skips Phase 1b (the option ignored)", "agreement",
             "kvspec.model.rules.rescan_group"),
    Mutation("pins-never-stop", "model/rules.py",
             "        return STOP if entry_free and free - 1 < taken else PIN", "        return PIN",
             "repair pins an already-cached entry even when the pin starves the selection", "refinement",
             "kvspec.model.rules.repair_step"),
    Mutation("duplicate-key-selected", "model/rules.py", "    if kind in SELECTABLE and not duplicate:",
             "    if kind in SELECTABLE:",
             "repair selects a key already selected in the group (a second transfer of one key)", "crosshair",
             "kvspec.model.rules.repair_step"),
    Mutation("pins-keep-free-count", "model/rules.py",
             "        elif step == PIN and free_entry:\n            free -= 1\n", "",
             "the repair scan's pins of free entries do not lower the free count", "refinement",
             "kvspec.model.rules.repair_scan", nightly=True),
    # -- model/repair.py: records, ownership, in-flight keys ---------------------------------------
    Mutation("first-owner-only", "model/repair.py",
             "            for pos in self.owners[key]:\n                self.lost.setdefault(pos, key)",
             "            for pos in list(self.owners[key])[:1]:\n                self.lost.setdefault(pos, key)",
             "only the first owner of an evicted key gets a lost record", "refinement"),
    Mutation("record-at-0-dropped", "model/repair.py", "            if b is None or self._covered(key):",
             "            if b is None or self._covered(key) or p == 0:",
             "a pending record at position 0 is dropped while still owned and uncovered", "refinement"),
    Mutation("ownership-without-ref-count", "model/repair.py",
             "gpu.block_hash[b] != (hashes[p], g) or gpu.ref_cnt[b] < 1:",
             "gpu.block_hash[b] != (hashes[p], g):",
             "a block the request no longer references still counts as owned", "agreement"),
    Mutation("window-floor-counts-drafts", "model/repair.py",
             "            if p < window_floor(r.num_computed_tokens, r.num_output_placeholders, spec.sliding_window,",
             "            if p < window_floor(r.num_computed_tokens, 0, spec.sliding_window,",
             "the sliding-window ownership floor counts placeholders (speculative drafts) as confirmed", "tests"),
    Mutation("retained-referenced", "model/repair.py",
             "        return b if gpu.ref_cnt[b] == 0 else None",
             "        return b",
             "a referenced block the request does not own counts as a retained copy", "tests"),
    Mutation("live-includes-cursor", "model/repair.py",
             "            if (st is None or st.finished or p >= st.num_stored_blocks[g]",
             "            if (st is None or st.finished or p > st.num_stored_blocks[g]",
             "a key owned at the cursor (not yet passed) counts as live", "agreement"),
    Mutation("completion-keeps-in-flight", "model/repair.py",
             "            self._unmark_key(self.sched.gpu_pool.block_hash[g])", "            pass",
             "a completed store leaves its key counted in flight", "obligation"),
    Mutation("preempted-keep-records", "model/repair.py",
             "        for rid in out.preempted_req_ids:\n            self._drop_request(rid)\n",
             "",
             "a preempted request keeps its lost records and owner index", "tests"),
    # -- model/signal_rescan.py -------------------------------------------------------------------
    Mutation("evictions-clear-flag", "model/signal_rescan.py",
             "        if evicted:\n            self.eviction_flag = True",
             "        if evicted:\n            self.eviction_flag = False",
             "an eviction never sets the signal-rescan flag", "refinement"),
    Mutation("flag-never-consumed", "model/signal_rescan.py",
             "        self.rescan = self.consume_eviction_signal()", "        self.rescan = self.eviction_flag",
             "the planning step reads the flag without consuming it", "obligation"),
    # -- model/free_queue.py, block_pool.py, hit_search.py ----------------------------------------
    Mutation("queue-pops-newest", "model/free_queue.py", "self._order.popitem(last=False)[0]",
             "self._order.popitem(last=True)[0]",
             "allocation takes the most recently freed block (queue order)", "obligation",
             "kvspec.specs.contracts.queue_pop"),
    Mutation("fresh-to-tail", "model/block_pool.py", "        self.free_queue.prepend_n(fresh)",
             "        self.free_queue.append_n(fresh)",
             "unhashed freed blocks join the tail instead of the head", "tests"),
    Mutation("evictions-unreported", "model/block_pool.py", "            self._evicted.append((b, key))",
             "            pass",
             "the pool does not report the entries an allocation evicts", "refinement"),
    Mutation("full-hit-skips-miss", "model/hit_search.py", "        if got is None:\n            break",
             "        if got is None:\n            continue",
             "the full-attention hit search skips a miss", "crosshair", "kvspec.specs.contracts.full_hit"),
    Mutation("window-need-off-by-one", "model/hit_search.py", "    need = -(-(window - 1) // block_size)",
             "    need = -(-window // block_size)",
             "the sliding-window hit needs one block more than the window", "crosshair",
             "kvspec.specs.contracts.window_hit"),
    Mutation("window-hit-drops-leading-run", "model/hit_search.py", "    return [h[:run] for h in hits]",
             "    return [[] for h in hits]",
             "with no full window run, the sliding-window hit is empty (the run from index 0 dropped)",
             "crosshair", "kvspec.specs.contracts.window_hit"),
    # -- specs/transitions.py ------------------------------------------------------------------------
    Mutation("spec-complete-caches-lost", "specs/transitions.py",
             "cached=enc.table(lambda p, g=g, d=done: z3.Or(enc.v(s, g, \"cached\", p), enc.at(d, p))))",
             "cached=enc.table(lambda p, g=g, d=done: z3.Or(enc.v(s, g, \"cached\", p), enc.at(d, p),\n"
             "                                                       enc.v(s, g, \"lost\", p))))",
             "a completion also caches every lost position", "refinement"),
    Mutation("spec-evict-no-records", "specs/transitions.py",
             "                z3.And(enc.at(ev, p), s.active, enc.below(s, g, p), enc.ownh(s, g, p),\n"
             "                       enc.v(s, g, \"reg\", p))))",
             "                z3.BoolVal(False)))",
             "an eviction makes no lost record", "refinement"),
    Mutation("spec-repair-never-restores", "specs/transitions.py",
             "        cons.append(z3.Implies(room, every))", "        cons.append(z3.Not(enc.at(rest, 0)))",
             "the repair phase never re-stores the first position", "obligation"),
    Mutation("spec-flag-not-consumed", "specs/transitions.py",
             "    return Step(_keep(s, flag=z3.BoolVal(False)), [])", "    return Step(_keep(s), [])",
             "a build leaves the signal-rescan flag set", "refinement"),
    Mutation("spec-preempt-keeps-cursor", "specs/transitions.py",
             "        upd: dict[str, Any] = {\"n\": z3.IntVal(0), \"cur\": z3.IntVal(0),",
             "        upd: dict[str, Any] = {\"n\": z3.IntVal(0), \"cur\": s.groups[g].cur,",
             "preemption keeps the cursor", "refinement"),
    Mutation("spec-confirmed-may-shrink", "specs/transitions.py",
             "    cons: list[z3.BoolRef] = [conf2 >= s.conf]", "    cons: list[z3.BoolRef] = [conf2 >= 0]",
             "a GPU step may lower the confirmed count", "obligation"),
    Mutation("spec-reset-keeps-in-flight", "specs/transitions.py",
             "                               infl=enc.table(lambda p: z3.BoolVal(False)),\n", "",
             "reset keeps in-flight marks", "agreement"),
    Mutation("spec-sliding-keeps-owned", "specs/transitions.py",
             "owned=enc.table(lambda p, g=g, edge=edge: z3.And(enc.v(s, g, \"owned\", p), p >= edge)))",
             "owned=enc.table(lambda p, g=g, edge=edge: enc.v(s, g, \"owned\", p)))",
             "positions that left the window stay owned", "refinement"),
    Mutation("spec-env-drops-in-flight", "specs/transitions.py",
             "        cons.append(enc.forall(lambda p, g=g, i2=infl2: z3.Implies(enc.v(s, g, \"infl\", p), "
             "enc.at(i2, p))))",
             "        cons.append(enc.forall(lambda p, g=g, i2=infl2: z3.Implies(enc.at(i2, p), "
             "enc.v(s, g, \"infl\", p))))",
             "other requests may drop the focal request's in-flight marks but never add one", "refinement"),
    Mutation("spec-c2-without-index", "specs/transitions.py",
             "        parts += [registered(enc, s), c2(enc, s)]", "        parts += [c2(enc, s)]",
             "C2's invariant without the owner index", "obligation"),
    # -- specs/encoding.py, keylevel.py ---------------------------------------------------------------
    Mutation("spec-scan-none-above-8", "specs/encoding.py",
             "        return Scan(cons, curs, sels, resels, axioms)\n\n\nclass Unrolled",
             "        cons.append(z3.Implies(s.groups[0].n > 8, z3.BoolVal(False)))\n"
             "        return Scan(cons, curs, sels, resels, axioms)\n\n\nclass Unrolled",
             "the quantified scan has no successor for N > 8", "obligation"),
    Mutation("spec-keylevel-first-owner", "specs/keylevel.py", "FIRST_OWNER_ONLY = False", "FIRST_OWNER_ONLY = True",
             "key level: R1 gives a record to one owner per key", "obligation"),
)

PLANTED = tuple(m for m in MUTATIONS if m.crosshair and not m.nightly)  # found at the default budget
PLANTED_NIGHTLY = tuple(m for m in MUTATIONS if m.crosshair and m.nightly)  # found at the nightly budget


def by_name(name: str) -> Mutation:
    for m in MUTATIONS:
        if m.name == name:
            return m
    raise KeyError(name)


def apply(root: Path, m: Mutation) -> None:
    """Replace ``m.old`` by ``m.new`` in ``root / m.path``; the text must occur exactly once."""
    path = root / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise ValueError(f"{m.name}: the text to replace occurs {text.count(m.old)} times in {m.path}")
    path.write_text(text.replace(m.old, m.new))


def scratch_copy(repo: Path, dest: Path) -> Path:
    """The repository's tracked and untracked-not-ignored files copied under ``dest``, with
    ``kvspec/{model,impl,specs}`` linked to the top-level directories (the installed layout), so
    that ``PYTHONPATH=dest`` imports the copy. A ``repo`` that is not a git checkout (a scratch
    copy itself, as in a mutation pass whose tests make scratch copies) is copied whole, but for
    virtual environments and byte-code caches. O(files)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                                check=True, capture_output=True).stdout.decode().split("\0")
    except (subprocess.CalledProcessError, FileNotFoundError):
        shutil.copytree(repo, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv*", ".vllm-*", "__pycache__", "*.pyc"))
        return installed_layout(dest)
    for rel in filter(None, listed):
        src = repo / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return installed_layout(dest)


def installed_layout(dest: Path) -> Path:
    """Link ``kvspec/{model,impl,specs}`` in a copy of the repository at ``dest`` to its top-level
    directories (the installed layout), so that ``PYTHONPATH=dest`` imports that copy."""
    for sub in ("model", "impl", "specs"):
        link = dest / "kvspec" / sub
        if not link.exists():
            os.symlink(Path("..") / sub, link)
    return dest


def scratch_env(root: Path) -> dict[str, str]:
    """The environment that makes Python (and subprocesses such as CrossHair) import ``root``'s copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    return env
