"""``copy_blocks`` moves exactly ``src[src_ids]`` into ``dst[dst_ids]`` on every path it takes."""

from __future__ import annotations

import pytest
import torch

from kvspec.impl.payload import copy_blocks, expected_payload


@pytest.mark.parametrize("shape", [(2, 8), (2, 16, 4, 128), (3, 5)])
@pytest.mark.parametrize("pattern", ["runs", "scattered", "single", "mixed"])
def test_copy_blocks_matches_advanced_indexing(shape: tuple[int, ...], pattern: str) -> None:
    g = torch.Generator().manual_seed(1)
    n = 64
    src = torch.randn((n, *shape), generator=g).to(torch.float16)
    dst = torch.zeros_like(src)
    if pattern == "runs":
        src_ids, dst_ids = torch.arange(10, 42), torch.arange(20, 52)
    elif pattern == "scattered":
        src_ids, dst_ids = torch.randperm(n, generator=g)[:40], torch.randperm(n, generator=g)[:40]
    elif pattern == "single":
        src_ids, dst_ids = torch.tensor([7]), torch.tensor([3])
    else:
        src_ids = torch.cat([torch.arange(0, 16), torch.tensor([40, 33, 33])])
        dst_ids = torch.cat([torch.arange(30, 46), torch.tensor([1, 2, 3])])
    want = dst.clone()
    want[dst_ids] = src[src_ids]
    copy_blocks(dst, dst_ids, src, src_ids)
    assert torch.equal(dst, want)


def test_expected_payload_is_a_function_of_the_hash() -> None:
    a, b = expected_payload("abc"), expected_payload("abc")
    assert torch.equal(a, b)
    assert not torch.equal(a, expected_payload("abd"))
    assert a.shape == (2, 8) and float(a.abs().max()) <= 1.0
