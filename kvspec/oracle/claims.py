"""Which invariants judge a run: one rule, used by every command, the harness and the tests.

An *oracle* is a named set of catalogue ids. By default it is what the policy under test
claims (``claims``: ``POLICY_CLASSES[policy].claims(config)``); for a known-bug variant,
the claims of the policy the variant derives from, or the property the change claimed to
restore when the catalogue says so (``Bug.oracle``). ``all`` is the whole catalogue; a
comma-separated list of ids is exactly those. Every report names the oracle it used, so
a verdict is never read against the wrong yardstick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, echo


@dataclass(frozen=True)
class Oracle:
    """``name`` is how reports print it (``claims of repair``, ``all``, ``C1,I9``)."""

    name: str
    ids: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "ids": list(self.ids)}


def catalogue_ids() -> tuple[str, ...]:
    from kvspec.oracle.catalogue import CATALOGUE

    return tuple(CATALOGUE)


def claims(config: OffloadConfig) -> Oracle:
    """What ``config.policy`` guarantees under ``config``."""
    from kvspec.model import POLICY_CLASSES

    return Oracle(f"claims of {config.policy}", tuple(POLICY_CLASSES[config.policy].claims(config)))


def parse_ids(text: str, what: str = "--oracle") -> tuple[str, ...]:
    """Comma-separated catalogue ids, each known; ``ConfigError`` naming the unknown ones."""
    known = catalogue_ids()
    ids = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [i for i in ids if i not in known]
    if not ids or unknown:
        why = f"unknown invariant id(s) {', '.join(echo(u, 20) for u in unknown[:5])}" if unknown else "no ids given"
        raise ConfigError(f"{what}: {why}; known: claims, all, or ids among {', '.join(known)}")
    return ids


def check_spec(spec: str | None) -> None:
    """Validate an ``--oracle`` value before any work is done (``ConfigError`` if bad)."""
    if spec is not None and spec not in ("claims", "all"):
        parse_ids(spec)


def resolve(spec: str | None, config: OffloadConfig, bug: str | None = None) -> Oracle:
    """The oracle ``spec`` names for a run under ``config``.

    ``None`` or ``claims``: the policy's claims, or for ``bug`` the catalogue's oracle of
    that variant (its derived policy's claims unless the catalogue names the property the
    change claimed). ``all``: the whole catalogue. Otherwise comma-separated ids.
    """
    if spec is None or spec == "claims":
        if bug is not None:
            from kvspec.model.bugs import BUGS

            entry = BUGS[bug]
            if entry.oracle is not None:
                return Oracle(f"bug:{bug} ({','.join(entry.oracle)})", entry.oracle)
            config = replace(config, policy=entry.policy, lazy_offload=False)
        return claims(config)
    if spec == "all":
        return Oracle("all", catalogue_ids())
    ids = parse_ids(spec)
    return Oracle(",".join(ids), ids)
