"""Prefix-cache keys: a hash chain over full pages. Pure and torch-free.

A page's key is ``H(parent key, the page's token ids[, lookahead token ids])``; the
chain starts at :func:`root_key` of the extra keys (model fingerprint and version, a
request's ``cache_salt``), so two prompts share a page only when every token before
and in it, the model and the salt agree. ``lookahead`` tokens after the page are
part of its key when the KV of its last row depends on them (an MTP head's row ``i``
reads token ``i + 1``).

>>> root = root_key("model-abc", "1", None)
>>> a = page_keys([5, 6, 7, 8, 9], 2, root)
>>> len(a), a == page_keys([5, 6, 7, 8, 0], 2, root)   # the partial last page has no key
(2, True)
>>> page_keys([5, 6, 7, 8], 2, root_key("model-abc", "1", "salt"))[0] == a[0]
False
>>> page_keys([5, 6, 7, 8, 9], 2, root, lookahead=1)[1] == page_keys([5, 6, 7, 8, 0], 2, root, lookahead=1)[1]
False
"""
from __future__ import annotations

import hashlib
from array import array

KEY_BYTES = 16   # 128 bits: a collision would hand one prompt another's KV


def root_key(*extra_keys: object) -> bytes:
    """The chain's start for these extra keys (None and "" differ: repr of each)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for k in extra_keys:
        part = repr(k).encode()
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def page_key(parent: bytes, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def page_keys(token_ids: list[int], page_size: int, root: bytes, known: list[bytes] = (),
              lookahead: int = 0) -> list[bytes]:
    """Keys of every full page of ``token_ids`` that has ``lookahead`` tokens after it;
    ``known``: keys already computed for the first pages (extended, not recomputed)."""
    keys = list(known)
    parent = keys[-1] if keys else root
    for p in range(len(keys), (len(token_ids) - lookahead) // page_size):
        parent = page_key(parent, token_ids[p * page_size:(p + 1) * page_size + lookahead])
        keys.append(parent)
    return keys
