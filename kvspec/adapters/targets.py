"""Named target factories: everything the harness, the fuzzer and ``replay`` can drive.

A factory takes an ``OffloadConfig`` and returns an ``OffloadTarget``. Names:
``model`` (the executable specification, any policy), ``impl`` (the torch
implementation), ``vllm`` (real vLLM 0.33.0 through its adapter; ``baseline`` only),
``vllm@VERSION`` (another release), ``raw:vllm`` and ``raw:vllm@VERSION`` (the same with the
model's rules left to vLLM, ``kvspec.adapters.vllm``), and ``bug:<name>`` for each variant
of the known-bug catalogue. Factories import their modules lazily, so kvspec works
without torch-heavy or vLLM imports until a target is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError
from kvspec.contract.offloading import OffloadingFactory
from kvspec.contract.types import OffloadTarget

TargetFactory = Callable[[OffloadConfig], OffloadTarget]

_FACTORIES: dict[str, str] = {
    "model": "kvspec.model:make_scheduler",
    "impl": "kvspec.impl:make_scheduler",
    "vllm": "kvspec.adapters.vllm:make_vllm_target",
    "vllm+pr47235": "kvspec.adapters.vllm_patched:make_vllm_pr47235_target",
    "vllm+repair": "kvspec.adapters.vllm_patched:make_vllm_repair_target",
    "raw:vllm": "kvspec.adapters.vllm:make_raw_vllm_target",
}
# The second manager's targets (kvspec.contract.offloading.OffloadingManagerTarget): its model, its
# torch implementation and vLLM 0.33.0's own CPUOffloadingManager; bug:<name> for its variants
# (kvspec.model.offloading.bugs).
_OFFLOADING_FACTORIES: dict[str, str] = {
    "offloading": "kvspec.model.offloading:make_offloading_manager",
    "offloading-impl": "kvspec.impl.offloading:make_offloading_impl",
    "vllm-offloading": "kvspec.adapters.vllm_offloading:make_vllm_offloading_target",
}
RAW_PREFIX = "raw:"  # raw:vllm, raw:vllm@VERSION: real vLLM with the model's rules left to vLLM


def raw_target(name: str) -> str:
    """The raw form of a real-vLLM target name (``vllm`` or ``vllm@VERSION``); ``ConfigError`` for
    any other target (only real vLLM has code of its own to judge on the calls the model refuses)."""
    base = name.removeprefix(RAW_PREFIX)
    if base != "vllm" and not base.startswith("vllm@"):
        raise ConfigError(f"--raw needs a real vLLM target (vllm or vllm@VERSION), not {name!r}")
    return RAW_PREFIX + base


def target_names() -> list[str]:
    from kvspec.model.bugs import BUGS

    return [*_FACTORIES, *(f"bug:{name}" for name in BUGS)]


def get_factory(name: str) -> TargetFactory:
    """The factory for ``name``; ``ConfigError`` with the known names when unknown."""
    if name.startswith("bug:"):
        from kvspec.model.bugs import BUGS, make_bug_target

        bug = name[4:]
        if bug not in BUGS:
            raise ConfigError(f"unknown bug variant {bug!r}; known: {', '.join(BUGS)}")
        return lambda cfg: make_bug_target(bug, cfg)
    raw = name.startswith(RAW_PREFIX + "vllm@")
    if name.startswith("vllm@") or raw:  # [raw:]vllm@VERSION: one real release (kvspec.adapters.vllm_compat)
        from kvspec.adapters.vllm import release_factory

        return release_factory(name.partition("@")[2], raw)
    spec = _FACTORIES.get(name)
    if spec is None:
        raise ConfigError(f"unknown target {name!r}; known: {', '.join(target_names())}; "
                          "also offloading, vllm-offloading")
    factory: TargetFactory = _load(name, spec)
    return factory


def _load(name: str, spec: str) -> Any:
    """The attribute a ``module:attribute`` spec names, imported now; ``ConfigError`` if the module
    cannot be imported here."""
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"target {name!r} is not available here: {exc}") from None
    return getattr(mod, attr)


def offloading_target_names() -> list[str]:
    from kvspec.model.offloading.bugs import OFFLOADING_BUGS

    return [*_OFFLOADING_FACTORIES, *(f"bug:{name}" for name in OFFLOADING_BUGS)]


def is_offloading_target(name: str) -> bool:
    """Whether ``name`` is a target of the second manager (``OffloadingManagerTarget``), with
    ``vllm-offloading@VERSION`` for a release's own manager (run in that release's venv)."""
    return name in offloading_target_names() or name.startswith("vllm-offloading@")


def get_offloading_factory(name: str) -> OffloadingFactory:
    """The second manager's factory for ``name``; ``ConfigError`` with the known names when unknown."""
    if name.startswith("bug:"):
        from kvspec.model.offloading.bugs import OFFLOADING_BUGS

        if name[4:] in OFFLOADING_BUGS:
            return OFFLOADING_BUGS[name[4:]].manager
    if name.startswith("vllm-offloading@"):
        from kvspec.adapters.vllm_offloading import release_factory

        return release_factory(name.partition("@")[2])
    spec = _OFFLOADING_FACTORIES.get(name)
    if spec is None:
        raise ConfigError(f"unknown offloading target {name!r}; known: {', '.join(offloading_target_names())}")
    factory: OffloadingFactory = _load(name, spec)
    return factory
