"""What each target claims: the oracle that judges a run of a policy or a known-bug variant.

By default a run is judged by what the policy under test claims (its class's
``claims(config)``, found through the policy registry); for a known-bug variant, by the claims
of the policy the variant derives from, or by the property the change claimed to restore when
the bug catalogue says so (``Bug.oracle``). This lives with the targets because it reads them;
the oracle layer (``kvspec.oracle``) only names and parses sets of invariant ids.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec.contract.config import OffloadConfig
from kvspec.oracle.oracles import Oracle, catalogue_ids, parse_ids


def claims(config: OffloadConfig) -> Oracle:
    """What ``config.policy`` guarantees under ``config``."""
    from kvspec.model import POLICY_CLASSES

    return Oracle(f"claims of {config.policy}", tuple(POLICY_CLASSES[config.policy].claims(config)))


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
