"""Block hashes and keys.

Rule (vLLM §1.1): the hash of hash-block i of a request is a chained hash of its
tokens and the hash of block i-1, so hash i identifies the whole prefix
``[0, (i+1)*block_size)``. A cache key is the pair (hash, KV-group id), vLLM's
``BlockHashWithGroupId``. Hashes are 16 hex digits of BLAKE2b: deterministic
across runs and processes, so traces and snapshots are reproducible.
"""

import hashlib
from functools import lru_cache

BlockHash = str
BlockKey = tuple[BlockHash, int]

ROOT_HASH: BlockHash = "0" * 16


def chain_hash(parent: BlockHash, tokens: tuple[int, ...]) -> BlockHash:
    """Hash of one full block of ``tokens`` whose prefix hashes to ``parent``. O(block size)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.hexdigest()


def block_hashes(tokens: list[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens``. O(len(tokens))."""
    out: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(tokens[start : start + block_size]))
        out.append(parent)
    return out


@lru_cache(maxsize=1 << 16)
def key_str(key: BlockKey) -> str:
    """Canonical text of a key in snapshots: ``"<hash>:<group>"``. Memoized (a key's text is a
    pure function of the key; snapshots format every hashed block's key each time)."""
    return f"{key[0]}:{key[1]}"

