"""Snapshots that failed their checks, set aside under `root/quarantine/` for inspection.

A quarantined snapshot is out of the index and the budget and never offered for a restore again; its
directory is moved whole (manifest and blobs as found) with a `quarantine.json` saying whose it was and
why. Nothing reads it back but listings (`deltaserve cache ls --all`) and people.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from cache_svc.index import IndexEntry
    from cache_svc.store import SnapshotStore

log = structlog.get_logger("deltaserve.cache.quarantine")

QUARANTINE_DIR = "quarantine"
INFO_NAME = "quarantine.json"


@dataclass(slots=True, frozen=True)
class Quarantined:
    key: str
    tenant: str  # "" when neither the index nor the manifest said
    conversation_id: str
    size_bytes: int
    num_tokens: int
    reason: str
    quarantined_ns: int
    path: str = ""


def quarantine_root(store: SnapshotStore) -> str:
    return os.path.join(store.root, QUARANTINE_DIR)


def set_aside(
    store: SnapshotStore, key: str, entry: IndexEntry | None, reason: str, generation: str | None = None
) -> bool:
    """Moves the snapshot's directory under quarantine/ (the caller holds the index lock and drops the
    row when this returns True). With `generation`, only when the indexed snapshot is still that one:
    a put that replaced it since is not the bad one."""
    if generation is not None and (entry is None or entry.generation != generation):
        return False
    source = store.snapshot_dir(key)
    if not os.path.isdir(source):
        return entry is not None  # gone already: drop the row all the same
    now = time.time_ns()
    target = os.path.join(quarantine_root(store), f"{key}.{now}")
    os.makedirs(quarantine_root(store), exist_ok=True)
    info = Quarantined(
        key=key,
        tenant=entry.tenant if entry is not None else "",
        conversation_id=entry.conversation_id if entry is not None else "",
        size_bytes=entry.size_bytes if entry is not None else 0,
        num_tokens=entry.num_tokens if entry is not None else 0,
        reason=reason,
        quarantined_ns=now,
    )
    os.rename(source, target)
    with open(os.path.join(target, INFO_NAME), "w") as f:
        json.dump(asdict(info), f)
    log.warning("snapshot quarantined", key=key, tenant=info.tenant, path=target, reason=reason)
    return True


def quarantined(store: SnapshotStore, tenant: str) -> list[Quarantined]:
    """The tenant's quarantined snapshots, newest first (those of no known tenant go with the default's)."""
    from cache_svc.manifest import DEFAULT_TENANT

    root = quarantine_root(store)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        try:
            with open(os.path.join(root, name, INFO_NAME)) as f:
                fields = json.load(f)
            info = Quarantined(**{**fields, "path": os.path.join(root, name)})
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if info.tenant == tenant or (not info.tenant and tenant == DEFAULT_TENANT):
            found.append(info)
    return sorted(found, key=lambda q: q.quarantined_ns, reverse=True)
