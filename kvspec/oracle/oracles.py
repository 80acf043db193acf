"""Oracles: named sets of catalogue ids, and how a user names one.

An *oracle* is a named set of invariant ids from the catalogue. A user names one as
``claims`` (what the target under test claims: resolved by ``kvspec.adapters.claims``, which
knows the policies and the bug variants), ``all`` (the whole catalogue) or a comma-separated
list of ids (exactly those). Every report names the oracle it used, so a verdict is never read
against the wrong yardstick.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.contract.errors import ConfigError, echo


@dataclass(frozen=True)
class Oracle:
    """``name`` is how reports print it (``claims of repair``, ``all``, ``C1,I9``)."""

    name: str
    ids: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "ids": list(self.ids)}


def catalogue_ids(manager: str | None = "simple") -> tuple[str, ...]:
    """The ids of ``manager``'s catalogue (``simple``: the first manager's; ``offloading``: the
    second's); None: every manager's, the first manager's first."""
    from kvspec.oracle.catalogue import CATALOGUES

    if manager is None:
        return tuple(i for cat in CATALOGUES.values() for i in cat)
    return tuple(CATALOGUES[manager])


def parse_ids(text: str, what: str = "--oracle", manager: str | None = "simple") -> tuple[str, ...]:
    """Comma-separated ids of ``manager``'s catalogue (None: of any manager's), each known;
    ``ConfigError`` naming the unknown ones."""
    known = catalogue_ids(manager)
    ids = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [i for i in ids if i not in known]
    if not ids or unknown:
        other = [u for u in unknown if manager is not None and u in catalogue_ids(None)]
        if other:
            why = f"{', '.join(other[:5])} belong(s) to the other manager's catalogue, not the {manager} manager's"
        elif unknown:
            why = f"unknown invariant id(s) {', '.join(echo(u, 20) for u in unknown[:5])}"
        else:
            why = "no ids given"
        raise ConfigError(f"{what}: {why}; known: claims, all, or ids among {', '.join(known)}")
    return ids


def check_spec(spec: str | None) -> None:
    """Validate an ``--oracle`` value before any work is done (``ConfigError`` if bad)."""
    if spec is not None and spec not in ("claims", "all"):
        parse_ids(spec)
