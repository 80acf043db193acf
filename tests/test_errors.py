"""Bad input is rejected with a ``KVSpecError`` subclass and a clear message, and changes nothing.

The error contract (``contract_kit.ErrorContract``: every entry point of a target, of its GPU
pool and of the engine, each case with its error class, message pattern and the proof that the
state is unchanged) runs here on the model and on the implementation, for every policy; the vLLM
stage runs it on real vLLM (tests/test_vllm_conformance.py). Construction errors (pool sizes,
configurations) are checked beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from contract_kit import CASES, ErrorContract

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, InvalidCountError, KVSpecError
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler as make_model
from kvspec.model.block_pool import BlockPool


class TestModelBaseline(ErrorContract):
    factory = make_model
    policy = "baseline"


class TestModelSignalRescan(ErrorContract):
    factory = make_model
    policy = "signal-rescan"


class TestModelRepair(ErrorContract):
    factory = make_model
    policy = "repair"


class TestImplBaseline(ErrorContract):
    factory = make_impl
    policy = "baseline"


class TestImplSignalRescan(ErrorContract):
    factory = make_impl
    policy = "signal-rescan"


class TestImplRepair(ErrorContract):
    factory = make_impl
    policy = "repair"


def test_the_corpus_is_whole() -> None:
    """Every case has its own name and a proper ``KVSpecError`` subclass."""
    assert len({c.name for c in CASES}) == len(CASES) >= 150
    assert all(issubclass(c.error, KVSpecError) and c.error is not KVSpecError for c in CASES)


def _impl_pool(n: Any) -> Any:
    import torch

    from kvspec.impl.block_pool import TensorBlockPool
    from kvspec.impl.keys import KeyTable

    return TensorBlockPool(n, "cpu", KeyTable(1, torch.device("cpu")), torch.device("cpu"))


@pytest.mark.parametrize("pool", [lambda n: BlockPool(n, "cpu"), _impl_pool], ids=["model", "impl"])
def test_pool_size_must_be_a_positive_int(pool: Callable[[Any], Any]) -> None:
    """A pool of one block (the null block alone) is the smallest; anything else that is not an int
    >= 1, a bool included, is refused."""
    assert pool(1).num_blocks == 1
    for bad in (0, -3, True, False, 2.0, "8", None):
        with pytest.raises(InvalidCountError, match=r"cpu: num_blocks must be an int >= 1, got "):
            pool(bad)


@pytest.mark.parametrize("factory", [make_model, make_impl], ids=["model", "impl"])
@pytest.mark.parametrize(("cfg", "match"), [
    ({"policy": "nope"}, r"unknown policy 'nope'; known: baseline, signal-rescan, repair"),
    ({"policy": "repair", "lazy_offload": True}, r"lazy offload has no per-request store state"),
    ({"num_cpu_blocks": 1}, r"each pool needs at least 2 blocks"),
    ({"block_size": 0}, r"block_size must be >= 1, got 0"),
    ({"world_size": 0}, r"world_size must be >= 1, got 0"),
])
def test_config_rejected(factory: Callable[[OffloadConfig], Any], cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        factory(OffloadConfig(**cfg))
