"""A vLLM request's reuse scope: which other requests may share its blocks.

vLLM keeps tenants and adapters apart through the extra keys of its block
hashes (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``):
the LoRA adapter's name and path on every block, and the request's
``cache_salt`` on the first block, which the hash chain carries to all the
others. gpukv keeps them apart by scope: one tree root per ``ReuseScope``.
The two partitions are the same: requests share a scope exactly when vLLM
would give their blocks equal hashes (token ids aside).

- ``lora_id`` is the adapter's integer id (``lora_request.lora_int_id``), the
  id gpukv's events report.
- ``salt`` folds what vLLM hashes but a 64-bit id cannot hold: the cache salt
  string, and the adapter's name and path (re-pointing a name at another
  adapter must not reuse KV computed with the old one, as in vLLM). It is the
  first 8 bytes of a SHA-256 over those fields, so two different salts collide
  with probability 2**-64, the same order as vLLM's own 64-bit event hashes.
"""

from __future__ import annotations

import hashlib

from ..core.scope import ReuseScope

_DEFAULT = ReuseScope()


def _salt(cache_salt: str | None, lora_name: str | None, lora_path: str | None) -> int:
    h = hashlib.sha256()
    for part in (cache_salt, lora_name, lora_path):
        # Length-prefixed, with None distinct from "": no two field tuples
        # serialize alike.
        if part is None:
            h.update(b"\xff")
        else:
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)
    return int.from_bytes(h.digest()[:8], "little")


def scope_of(request) -> ReuseScope:
    """The ``ReuseScope`` of a vLLM ``Request`` (the default scope when it has
    neither a LoRA adapter nor a cache salt)."""
    lora = request.lora_request
    salt = request.cache_salt
    if lora is None and not salt:
        return _DEFAULT
    if lora is None:
        return ReuseScope(salt=_salt(salt, None, None))
    return ReuseScope(lora_id=int(lora.lora_int_id), salt=_salt(salt or None, lora.lora_name, lora.lora_path))
