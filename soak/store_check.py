"""Does the store open, and what does every entry in it read as? ``python -m soak.store_check`` with the store's
REVISIT_STORE_* variables set; prints one JSON object: entries per tier, how many read back verified, how many
read as damaged (reads verify checksums), and the temporary files of puts whose process is gone.

A process of its own, since LMDB opens one environment once per process.
"""

from __future__ import annotations

import json
import os
import sys

from store.config import StoreConfig
from store.dram import TEMP_PREFIX
from store.tiered import TieredStore, open_tier


def check(config: StoreConfig) -> dict:
    store = TieredStore([open_tier(name, config) for name in config.tiers])
    try:
        entries: dict[str, int] = {}
        listed: set[str] = set()
        verified = damaged = 0
        for tier in store.tiers:
            keys = list(tier.keys())
            entries[tier.name] = len(keys)
            listed.update(keys)
            for key in keys:
                view = tier.get(key)
                if view is None:
                    damaged += tier.contains(key)  # still listed, yet does not read: damaged
                    continue
                with view:
                    verified += 1
        orphans = []
        for child in config.dram_path.iterdir():
            if child.name.startswith(TEMP_PREFIX):
                pid = child.name[len(TEMP_PREFIX):].split(".", 1)[0]
                if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
                    orphans.append(child.name)
        return {"opened": True, "entries": entries, "verified": verified, "damaged": damaged,
                "orphan_temp_files": orphans,
                "keys": sorted(listed)}
    finally:
        store.close()


def main() -> int:
    try:
        print(json.dumps(check(StoreConfig.from_env())))
    except Exception as exc:  # the point: report that the store does not open, and why
        print(json.dumps({"opened": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
