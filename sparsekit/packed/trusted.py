"""Shards whose sha256 checks passed before, remembered by the file's identity, so a second load does not hash
them again (issue 20: hashing is most of reading a packed model, ~0.1-0.5 s for the demo on the machines we
measure, and it grows with the model: ~4 GB of shards for a 7B model, ~40 GB for 70B).

``read_packed`` checks every tensor of a shard against the sha256 in the index the first time it reads it, then
records the shard's fingerprint (size, inode, device, modification and change times in nanoseconds) and a digest
of the index's checksums for it in one small JSON file per shard (named by a hash of its absolute path) under
``$SPARSEKIT_CACHE/verified/``. A later read whose shard and checksums still match skips the hashing.

Any write to a file moves its modification and change times, and a copy or a replacement gives it another inode,
so an edited, truncated or replaced shard is hashed again. A shard changed less than ``SETTLE_S`` seconds before
its check passed is not remembered (a same-size write within the file system's time resolution could leave its
times as they were; git calls such entries "racily clean"). Damage that moves no time, such as bit rot on the
disk, is what ``sparsekit verify`` is for: it hashes every time, as every load does under ``SPARSEKIT_REHASH=1``
(then nothing is remembered either). A cache file that cannot be read or written only means hashing again.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

SETTLE_S = 2.0
VERSION = 1


def checksums_digest(names: list[str], checksums: dict[str, str]) -> str:
    """One digest of the index's sha256 for the tensors ``names`` of a shard (an index re-written with other
    checksums is then another entry)."""
    return hashlib.sha256(json.dumps([[n, checksums.get(n)] for n in sorted(names)]).encode()).hexdigest()


def _fingerprint(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


def _entry_file(shard: Path) -> Path:
    from sparsekit.hf.models import cache_root

    key = hashlib.sha256(str(shard.resolve()).encode()).hexdigest()[:24]
    return cache_root() / "verified" / f"{key}.json"


def enabled() -> bool:
    """Whether loads may skip shards that passed before (not under ``SPARSEKIT_REHASH=1``)."""
    return os.environ.get("SPARSEKIT_REHASH", "") != "1"


def passed_before(shard: Path, digest: str) -> bool:
    """Whether ``shard`` passed its check against checksums with ``digest`` and has not changed since."""
    if not enabled():
        return False
    try:
        entry = json.loads(_entry_file(shard).read_text())
        return (entry.get("version") == VERSION and entry.get("digest") == digest
                and entry.get("fingerprint") == _fingerprint(shard.stat()))
    except (OSError, ValueError, AttributeError):   # no entry, unreadable, or not ours: hash again
        return False


def remember(shard: Path, digest: str) -> None:
    """Record that ``shard`` passed its check against ``digest``, unless it changed within ``SETTLE_S``."""
    from sparsekit.host.atomic import replace_file

    if not enabled():
        return
    try:
        st = shard.stat()
        if time.time() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 < SETTLE_S:
            return
        data = {"version": VERSION, "shard": str(shard.resolve()), "digest": digest, "fingerprint": _fingerprint(st)}
        replace_file(_entry_file(shard), json.dumps(data).encode())
    except OSError:   # a read-only cache: the next load hashes again, nothing is wrong
        pass
