"""The store's folders are this user's alone. The DRAM tier and the outcomes box live at predictable paths in
/dev/shm, which every local user may write to: they are created 0700 with 0600 files, and a folder someone else
could have made or planted entries in (another user's, a symbolic link, group- or world-writable) is refused. One of
ours that an earlier version left readable to others is tightened. The LMDB tier's folder is created 0700 too."""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from plan.outcome import PLANNED, Outcome, OutcomeBox
from store import DramTier, LmdbTier, StoreError
from store.entry import seal_entry
from store.seal import PUBLIC
from tests.store.entries import key_for, make_entry

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A unique, not yet existing path in shared memory (as the store's defaults are), removed afterwards with
    whatever was made beside it (name-*)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = root / f"revisit-security-{uuid.uuid4().hex[:12]}"
    yield path
    for made in [path, *root.glob(path.name + "-*")]:
        if made.is_symlink() or made.is_file():
            made.unlink()
        else:
            shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask, so that modes come from the store and not from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")


# --- the DRAM tier ---


def test_a_new_dram_folder_and_its_files_are_private(shm: Path, open_umask: None) -> None:
    tier = DramTier(shm, pin_host_memory=False)
    entry = make_entry(1)[0]
    tier.put(key_for(1), entry)
    assert tier.pin(key_for(1))
    assert mode(shm) == 0o700
    assert os.stat(shm).st_uid == os.geteuid()
    files = sorted(shm.iterdir())
    assert [p.name for p in files] == [key_for(1) + ".kv", key_for(1) + ".pin"]
    assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}
    with tier.get(key_for(1)) as view:
        assert bytes(view.buffer) == entry.data
    tier.close()


@pytest.mark.parametrize("loose", [0o777, 0o775, 0o757, 0o1777, 0o720])
def test_a_dram_folder_others_may_write_to_is_refused(shm: Path, loose: int) -> None:
    shm.mkdir()
    os.chmod(shm, loose)
    with pytest.raises(StoreError, match=f"{shm}.*writable by group or others"):
        DramTier(shm, pin_host_memory=False)
    assert mode(shm) == loose  # left as it was, for its owner to look at


def test_a_symlinked_dram_folder_is_refused(shm: Path) -> None:
    target = shm.with_name(shm.name + "-target")
    target.mkdir(mode=0o700)
    shm.symlink_to(target)
    with pytest.raises(StoreError, match=f"{shm} is a symbolic link"):
        DramTier(shm, pin_host_memory=False)
    assert list(target.iterdir()) == []


def test_a_dram_folder_of_another_user_is_refused(shm: Path) -> None:
    needs_root()
    shm.mkdir(mode=0o700)
    planted = shm / (key_for(1) + ".kv")
    planted.write_bytes(make_entry(1)[0].data)
    os.chown(shm, NOBODY, NOBODY)
    with pytest.raises(StoreError, match=f"{shm} is owned by uid {NOBODY}"):
        DramTier(shm, pin_host_memory=False)


def test_a_dram_file_in_place_of_the_folder_is_refused(shm: Path) -> None:
    shm.write_text("not a folder")
    with pytest.raises(StoreError, match="not a directory"):
        DramTier(shm, pin_host_memory=False)


def test_an_older_readable_dram_folder_of_ours_is_tightened(shm: Path) -> None:
    shm.mkdir()
    os.chmod(shm, 0o755)
    entry = make_entry(1)[0]
    seal_entry(entry.data, key_for(1), PUBLIC)  # as a tier without a secret seals what it puts
    old = shm / (key_for(1) + ".kv")
    old.write_bytes(entry.data)
    os.chmod(old, 0o644)
    tier = DramTier(shm, pin_host_memory=False)
    assert mode(shm) == 0o700 and mode(old) == 0o600
    with tier.get(key_for(1)) as view:  # what it held is still served
        assert bytes(view.buffer) == entry.data
    tier.close()
    DramTier(shm, pin_host_memory=False).close()  # and a private folder is opened as it is
    assert mode(shm) == 0o700


# --- the outcomes box beside it ---


def test_a_new_outcomes_folder_and_its_files_are_private(shm: Path, open_umask: None) -> None:
    box = OutcomeBox(shm)
    box.put("r1", {0: Outcome(PLANNED)})
    assert mode(shm) == 0o700 and mode(shm / "r1") == 0o600
    assert [p.name for p in shm.iterdir()] == ["r1"]  # no temporary left
    assert box.take("r1") == {0: Outcome(PLANNED)}


def test_an_outcomes_folder_others_may_write_to_is_refused(shm: Path) -> None:
    shm.mkdir()
    os.chmod(shm, 0o777)
    (shm / "planted").write_text('{"0": ["planted", null]}')
    box = OutcomeBox(shm)
    with pytest.raises(PermissionError, match="writable by group or others"):
        box.put("r1", {0: Outcome(PLANNED)})
    assert box.take("planted") is None  # the gateway does not believe what it holds either
    assert box.sweep(older_than_s=0) == 0 and (shm / "planted").exists()


def test_a_symlinked_or_foreign_outcomes_folder_is_refused(shm: Path) -> None:
    target = shm.with_name(shm.name + "-target")
    target.mkdir(mode=0o700)
    shm.symlink_to(target)
    with pytest.raises(PermissionError, match="symbolic link"):
        OutcomeBox(shm).put("r1", {0: Outcome(PLANNED)})
    assert list(target.iterdir()) == []
    needs_root()
    os.chown(target, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        OutcomeBox(target).put("r1", {0: Outcome(PLANNED)})


def test_an_older_readable_outcomes_folder_of_ours_is_tightened(shm: Path) -> None:
    shm.mkdir()
    os.chmod(shm, 0o755)
    (shm / "old").write_text('{"0": ["planned", null]}')
    os.chmod(shm / "old", 0o644)
    box = OutcomeBox(shm)
    box.put("r1", {0: Outcome(PLANNED)})
    assert mode(shm) == 0o700 and mode(shm / "old") == 0o600 and mode(shm / "r1") == 0o600
    assert box.take("old") == {0: Outcome(PLANNED)}


# --- the LMDB tier ---


def test_a_new_lmdb_folder_and_its_files_are_private(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "deep" / "lmdb"
    tier = LmdbTier(path, map_size=8 << 20, sync=False)
    tier.put(key_for(1), make_entry(1)[0])
    assert mode(path) == 0o700
    assert {p.name: mode(p) for p in path.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
    tier.close()


def test_an_older_readable_lmdb_folder_of_ours_is_tightened(tmp_path: Path) -> None:
    import lmdb

    path = tmp_path / "lmdb"
    lmdb.open(str(path), map_size=8 << 20, max_dbs=2, mode=0o755).close()  # as earlier versions made it
    os.chmod(path, 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(path / name, 0o644)
    entry = make_entry(1)[0]
    tier = LmdbTier(path, map_size=8 << 20, sync=False)
    tier.put(key_for(1), entry)
    assert mode(path) == 0o700
    assert {p.name: mode(p) for p in path.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
    with tier.get(key_for(1)) as view:
        assert bytes(view.buffer) == entry.data
    tier.close()


def test_a_new_feature_store_folder_and_its_files_are_private(tmp_path: Path, open_umask: None) -> None:
    from store import FeatureStore

    path = tmp_path / "lmdb-features"
    features = FeatureStore(path, sync=False)
    features.put(key_for(1), b"index", b"tokens")
    assert mode(path) == 0o700
    assert {p.name: mode(p) for p in path.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
    features.close()
