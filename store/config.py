"""StoreConfig: the store's one frozen configuration, and the only place REVISIT_STORE_* variables are read."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from settings import EnvReader
from settings.redis_auth import RedisPasswordError, RedisURL, with_password
from store.errors import ConfigError

ENV_PREFIX = "REVISIT_STORE_"


class Tier(enum.StrEnum):
    """The store's tiers, one name each everywhere (store, policy, admin API, metrics). The design calls them L2
    and L3; L1, GPU memory inside each worker, is the worker's own."""

    DRAM = "dram"  # L2: shared-memory files, mapped (and pinned for the GPU) by every process of one host
    LMDB = "lmdb"  # L3: one LMDB environment on SSD
    MOONCAKE = "mooncake"  # shared by every host: a Mooncake Store cluster (store/mooncake_tier.py)


TIER_NAMES = tuple(tier.value for tier in Tier)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9_.-]+:[0-9]{1,5}$")
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the tiers live and how large they may grow. Policy (what goes where, eviction) is not here."""

    name: str = "default"
    tiers: tuple[str, ...] = (Tier.DRAM.value, Tier.LMDB.value)  # fastest first
    dram_dir: Path | None = None  # None: /dev/shm/revisit-store-<name>
    dram_limit_bytes: int = 0  # 0: unlimited; otherwise put() refuses past it (advisory across processes)
    pin_host_memory: bool = True  # cudaHostRegister mapped DRAM entries when CUDA is available
    dram_mapping_cache_bytes: int = 8 << 30  # per process: mappings kept for reuse by later reads (0: none)
    lmdb_dir: Path | None = None  # None: ~/.cache/revisit/store-<name>
    lmdb_map_size: int = GiB  # initial map size; grows geometrically on MapFullError
    lmdb_max_map_size: int = 1 << 40
    lmdb_growth_factor: float = 2.0
    lmdb_max_readers: int = 1024
    lmdb_grow_wait_s: float = 5.0  # how long a put waits for this process's read handles before growing the map
    lmdb_sync: bool = True  # fsync on commit; False trades crash durability of recent puts for write speed
    features_dir: Path | None = None  # None: beside the LMDB tier, <lmdb dir>-features (store/features.py)
    outcomes_dir: Path | None = None  # None: beside the DRAM tier, <dram dir>-outcomes (plan/outcome.py)
    # Outcomes through a Redis or Valkey server instead (redis://...), for gateways in front of other hosts' workers;
    # its password, if it asks for one, in outcomes_password_file (settings/redis_auth.py). The URL is shown with any
    # password in it masked.
    outcomes_url: str = ""
    outcomes_password_file: Path | None = None
    # The mooncake tier: the cluster's master (host:port), its metadata server and admin endpoint (defaults: the
    # master's own, http://<master host>:8080/metadata and http://<master host>:9003), and this process's address
    # as its peers reach it (default: the local address on the route to the master).
    mooncake_master: str = ""
    mooncake_metadata_server: str = ""
    mooncake_admin_url: str = ""
    mooncake_local_hostname: str = ""
    mooncake_protocol: str = "tcp"  # or "rdma" (with mooncake_device_names)
    mooncake_device_names: str = ""
    mooncake_read_buffer_bytes: int = 1 << 30  # per process: read buffers kept for later reads (0: none)
    # The deployment secret every gateway and worker shares (settings/secret.py): entries are sealed under it
    # (store/seal.py), and plans and shared books are authenticated with it. None: public keys, integrity only.
    secret_file: Path | None = None

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"store name must match {_NAME_RE.pattern}, got {self.name!r}")
        if not self.tiers or len(set(self.tiers)) != len(self.tiers) or set(self.tiers) - set(TIER_NAMES):
            raise ConfigError(f"tiers must be distinct names from {TIER_NAMES}, got {self.tiers!r}")
        if self.dram_limit_bytes < 0:
            raise ConfigError("dram_limit_bytes must be >= 0")
        if self.dram_mapping_cache_bytes < 0:
            raise ConfigError("dram_mapping_cache_bytes must be >= 0")
        if not 0 < self.lmdb_map_size <= self.lmdb_max_map_size:
            raise ConfigError("need 0 < lmdb_map_size <= lmdb_max_map_size")
        if self.lmdb_growth_factor <= 1.0:
            raise ConfigError("lmdb_growth_factor must be > 1")
        if self.lmdb_max_readers < 1 or self.lmdb_grow_wait_s < 0:
            raise ConfigError("lmdb_max_readers must be >= 1 and lmdb_grow_wait_s >= 0")
        if Tier.MOONCAKE in self.tiers and not _ADDRESS_RE.match(self.mooncake_master):
            raise ConfigError(f"the mooncake tier needs mooncake_master as host:port, got {self.mooncake_master!r}")
        object.__setattr__(self, "outcomes_url", RedisURL(self.outcomes_url))  # shown with its password masked
        if self.outcomes_url and not self.outcomes_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"outcomes_url must be a redis://, rediss:// or unix:// URL, got {self.outcomes_url!r}")
        if self.outcomes_password_file is not None and not self.outcomes_url:
            raise ConfigError("outcomes_password_file is set without outcomes_url")
        if self.mooncake_read_buffer_bytes < 0:
            raise ConfigError("mooncake_read_buffer_bytes must be >= 0")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake_protocol must be tcp or rdma, got {self.mooncake_protocol!r}")

    @property
    def mooncake_metadata_url(self) -> str:
        if self.mooncake_metadata_server:
            return self.mooncake_metadata_server
        return f"http://{self.mooncake_master.rpartition(':')[0]}:8080/metadata"

    @property
    def mooncake_admin(self) -> str:
        if self.mooncake_admin_url:
            return self.mooncake_admin_url
        return f"http://{self.mooncake_master.rpartition(':')[0]}:9003"

    @property
    def outcomes_address(self) -> str:
        """The outcomes' server as this process connects to it: outcomes_url with the password of
        outcomes_password_file in it (read now), shown masked; "" without one. Raises ConfigError for an unusable
        file."""
        if not self.outcomes_url:
            return ""
        try:
            return with_password(self.outcomes_url, self.outcomes_password_file)
        except RedisPasswordError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def dram_path(self) -> Path:
        return self.dram_dir if self.dram_dir is not None else Path("/dev/shm") / f"revisit-store-{self.name}"

    @property
    def lmdb_path(self) -> Path:
        if self.lmdb_dir is not None:
            return self.lmdb_dir
        return Path.home() / ".cache" / "revisit" / f"store-{self.name}"

    @property
    def features_path(self) -> Path:
        if self.features_dir is not None:
            return self.features_dir
        return self.lmdb_path.with_name(self.lmdb_path.name + "-features")

    @property
    def outcomes_path(self) -> Path:
        """Where workers leave what they ran for each request, for the gateway (plan.outcome): shared memory on
        the host the gateway and its workers share."""
        if self.outcomes_dir is not None:
            return self.outcomes_dir
        return self.dram_path.with_name(self.dram_path.name + "-outcomes")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """Build from REVISIT_STORE_<FIELD> variables (e.g. REVISIT_STORE_LMDB_MAP_SIZE); unknown ones are errors."""
        return cls(**EnvReader(environ, error=ConfigError).fields(cls, ENV_PREFIX))
