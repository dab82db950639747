"""The store: versioned sparse teacher distributions on Icechunk (transactional Zarr v3).

One store is one Icechunk repository plus the Parquet indexes beside it (`index.py`); the tree's paths
and arrays are spelled out in `format/layout.py`.

Every write adds new part groups and never touches existing ones, so concurrent writers (and Icechunk
forks in the distributed build) change disjoint Zarr paths. A version is an Icechunk snapshot whose
commit metadata names its sample index; the commit is the only moment a change becomes visible.
Versions are resolved as: tag, then branch, then snapshot id.
"""

from __future__ import annotations

import time
from pathlib import Path

import icechunk
import pyarrow as pa
import zarr

from logitstore.errors import (
    DamagedDataError,
    IncompatibleStoreError,
    LogitstoreError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from logitstore.format import layout
from logitstore.format.layout import root_attrs
from logitstore.storage.bounded import (
    BoundedRepository,
    create_repository,
    open_repository,
    repository_exists,
    storage_errors,
)
from logitstore.storage.location import Location, commit_lock
from logitstore.store import index
from logitstore.store.meta import DEFAULT_BRANCH, FORMAT_VERSION, NAME, SNAPSHOT_ID, WRITER, VersionInfo, now
from logitstore.store.version import StoreVersion
from logitstore.store.writer import StoreWriter


class Store:
    """A versioned store at one location. Cheap to open; reads and writes go through versions."""

    def __init__(self, location: Location, repo: BoundedRepository, blobs):
        self.location = location
        self.repo = repo
        self.blobs = blobs

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, uri: str, *, create: bool = False) -> Store:
        """Open the store at `uri`; with `create`, create it first if missing. Creation is idempotent:
        several processes creating one store at once all end up with the same, initialised store."""
        location = Location.parse(uri)
        if not create and location.scheme == "file" and not Path(location.path).exists():
            raise StoreNotFoundError(f"{location.uri} is not a logitstore store (no such folder)")  # and creates none
        storage, blobs = location.storage_and_blobs()
        with storage_errors(f"cannot open store {location.uri}"):
            repo = _open_or_create(storage, location) if create else _open_existing(storage, location)
            if create and _is_bare(repo):  # also finishes a creation killed between its two steps
                _initialise(repo, location)
        store = cls(location, repo, blobs)
        store._check_format()
        return store

    @classmethod
    def open_if_exists(cls, uri: str) -> Store | None:
        """The store at `uri`, or None where there is none yet (a location `open(create=True)` would
        create one in). A location holding something else is refused now, not at creation. For a job
        that creates its store with its first commit, so that failing before leaves nothing behind."""
        location = Location.parse(uri)
        if location.scheme == "file" and not Path(location.path).exists():
            return None  # before Icechunk's local storage, which makes the folder when opened
        storage, _ = location.storage_and_blobs()
        with storage_errors(f"cannot open store {location.uri}"):
            exists = repository_exists(storage, where=location.uri)
        if not exists:
            if not _only_repository_files(location):
                raise StoreNotFoundError(
                    f"{location.uri} exists and is not a logitstore store; refusing to write there"
                )
            return None
        return cls.open(uri, create=True)  # create=True also finishes a creation killed half-way

    def _check_format(self) -> None:
        try:
            with storage_errors(f"cannot read store {self.location.uri}"):
                tip = self.repo.lookup_branch(DEFAULT_BRANCH)
                self.repo.lookup_snapshot(tip)  # a damaged snapshot raises here; a zarr read would see no group
                meta = root_attrs(self.repo.readonly_session(snapshot_id=tip)).get("logitstore")
        except DamagedDataError:
            return  # main's tip is damaged; tags and older versions may be whole, and reading main says so
        if meta is None:
            raise StoreNotFoundError(f"{self.location.uri} is an Icechunk repository but not a logitstore store")
        if meta.get("format", 0) > FORMAT_VERSION:
            raise IncompatibleStoreError(
                f"{self.location.uri} has store format {meta['format']}; this logitstore reads up to {FORMAT_VERSION}"
            )

    # -- versions ----------------------------------------------------------------------------------

    def resolve(self, version: str | None = None) -> str:
        """Snapshot id for a tag, a branch or a snapshot id; None means the tip of `main`."""
        version = version or DEFAULT_BRANCH
        with storage_errors(f"store {self.location.uri}"):
            tags = self.repo.list_tags()
            if version in tags and version in self.repo.list_branches():  # a store whose names were made unchecked
                raise VersionNotFoundError(
                    f"{version!r} is both a tag and a branch of {self.location.uri}; remove the "
                    f"tag with `logitstore tag {self.location.uri} {version} --delete`"
                )
            if version in tags:
                return self.repo.lookup_tag(version)
            if version in self.repo.list_branches():
                return self.repo.lookup_branch(version)
            if SNAPSHOT_ID.fullmatch(version):
                try:
                    return self.repo.lookup_snapshot(version).id
                except icechunk.IcechunkError:
                    pass
        with storage_errors(f"store {self.location.uri}"):
            branches, tags = sorted(self.repo.list_branches()), sorted(self.repo.list_tags())
        raise VersionNotFoundError(
            f"{self.location.uri} has no version, tag or branch {version!r} "
            f"(branches: {', '.join(branches)}; tags: {', '.join(tags) or 'none'})"
        )

    def log(self, version: str | None = None) -> list[VersionInfo]:
        """Versions reachable from `version` (default: the tip of main), newest first, with their tags."""
        tip = self.resolve(version)
        tags_at: dict[str, list[str]] = {}
        with storage_errors(f"store {self.location.uri}"):
            for tag in sorted(self.repo.list_tags()):
                tags_at.setdefault(self.repo.lookup_tag(tag), []).append(tag)
            history = [snap for snap in self.repo.ancestry(snapshot_id=tip) if snap.parent_id is not None]
            return [_version_info(snap, tags_at.get(snap.id, [])) for snap in history]

    def tag(self, name: str, *, version: str | None = None) -> str:
        snapshot = self.resolve(version)
        self._check_ref_name(name, kind="tag")
        with storage_errors(f"cannot create tag {name!r}"), commit_lock(self.location):
            try:
                self.repo.create_tag(name, snapshot)
            except icechunk.IcechunkError as e:
                if "already exists" not in str(e):
                    raise
                # Icechunk keeps a deleted tag's name reserved, so a name never points at two versions.
                raise LogitstoreError(
                    f"tag {name!r} was deleted and its name cannot be reused; choose another"
                ) from None
        return snapshot

    def delete_tag(self, name: str) -> str:
        """Remove a tag (the version it named stays, reachable by id or other names). Returns that id."""
        with storage_errors(f"cannot delete tag {name!r}"):
            if name not in self.repo.list_tags():
                raise VersionNotFoundError(
                    f"{self.location.uri} has no tag {name!r} "
                    f"(tags: {', '.join(sorted(self.repo.list_tags())) or 'none'})"
                )
            snapshot = self.repo.lookup_tag(name)
            with commit_lock(self.location):
                self.repo.delete_tag(name)
        return snapshot

    def create_branch(self, name: str, *, version: str | None = None) -> str:
        snapshot = self.resolve(version)
        self._check_ref_name(name, kind="branch")
        with storage_errors(f"cannot create branch {name!r}"), commit_lock(self.location):
            self.repo.create_branch(name, snapshot)
        return snapshot

    def _check_ref_name(self, name: str, *, kind: str) -> None:
        """Tags, branches and snapshot ids share one namespace in `resolve`: a new name must not shadow
        (or be shadowed by) another, or `train --version X` and `build --branch X` would read and
        write different things under one name."""
        if not NAME.fullmatch(name):
            raise LogitstoreError(f"{kind} name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)")
        if SNAPSHOT_ID.fullmatch(name):
            raise LogitstoreError(f"{kind} name {name!r} looks like a version id; choose another")
        with storage_errors(f"store {self.location.uri}"):
            tags, branches = self.repo.list_tags(), self.repo.list_branches()
        if name in tags:
            with storage_errors(f"store {self.location.uri}"):
                at = self.repo.lookup_tag(name)
            raise LogitstoreError(
                f"tag {name!r} already exists (at {at}); tags never move"
                if kind == "tag"
                else f"{name!r} is already a tag (at {at}); a branch cannot have a tag's name"
            )
        if name in branches:
            raise LogitstoreError(
                f"branch {name!r} already exists"
                if kind == "branch"
                else f"{name!r} is a branch; a tag cannot have a branch's name"
            )

    def branches(self) -> dict[str, str]:
        with storage_errors(f"store {self.location.uri}"):
            return {b: self.repo.lookup_branch(b) for b in sorted(self.repo.list_branches())}

    # -- reading and writing -------------------------------------------------------------------

    def read(self, version: str | None = None) -> StoreVersion:
        return StoreVersion(self, self.resolve(version))

    def writer(
        self, *, branch: str = DEFAULT_BRANCH, on_duplicate: str = "error", on_changed: str = "error"
    ) -> StoreWriter:
        with storage_errors(f"cannot write to {self.location.uri}"):
            branches = self.repo.list_branches()
        if branch not in branches:
            raise VersionNotFoundError(f"{self.location.uri} has no branch {branch!r}; create it first")
        return StoreWriter(self, branch=branch, on_duplicate=on_duplicate, on_changed=on_changed)

    def index_key(self, snapshot_id: str) -> str | None:
        with storage_errors(f"store {self.location.uri}"):
            meta = self.repo.lookup_snapshot(snapshot_id).metadata or {}
        return meta.get("logitstore", {}).get("index")

    def read_index(self, snapshot_id: str) -> pa.Table:
        return index.read_index(self.blobs, self.index_key(snapshot_id))


def _open_existing(storage: icechunk.Storage, location: Location) -> BoundedRepository:
    if not repository_exists(storage, where=location.uri):
        raise StoreNotFoundError(f"{location.uri} is not a logitstore store (no store there)")
    return open_repository(storage, where=location.uri)


def _open_or_create(storage: icechunk.Storage, location: Location) -> BoundedRepository:
    """Create the repository unless it exists. Two processes may race here: Icechunk lets one create
    win (its first ref write is conditional) and the loser then opens what the winner made."""
    deadline = time.monotonic() + CREATE_WAIT_S
    while True:
        if repository_exists(storage, where=location.uri):
            return open_repository(storage, where=location.uri)
        if not _only_repository_files(location):
            raise StoreNotFoundError(f"{location.uri} exists and is not a logitstore store; refusing to write there")
        try:
            return create_repository(storage, where=location.uri)
        except icechunk.IcechunkError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # another process is creating it: open what it made


# How long a creation waits for a concurrent one before giving up; creating takes milliseconds.
CREATE_WAIT_S = 10.0
# What a local store folder may hold: Icechunk's folders and logitstore's files beside them.
_REPOSITORY_FILES = {
    "chunks",
    "manifests",
    "refs",
    "snapshots",
    "transactions",
    "config.yaml",
    "logitstore-index",
    ".logitstore-commit.lock",
}


def _only_repository_files(location: Location) -> bool:
    """A local folder that is missing, empty, or holds only a (possibly half-created) repository's files."""
    path = Path(location.path)
    if location.scheme != "file" or not path.exists():
        return True
    return path.is_dir() and all(entry.name in _REPOSITORY_FILES for entry in path.iterdir())


def _is_bare(repo: BoundedRepository) -> bool:
    """Created by Icechunk but not yet initialised by logitstore: only Icechunk's first snapshot."""
    return len(list(repo.ancestry(branch=DEFAULT_BRANCH))) == 1


def _initialise(repo: BoundedRepository, location: Location) -> None:
    session = repo.writable_session(DEFAULT_BRANCH)
    root = zarr.open_group(session.store, mode="a")
    if layout.TEACHERS in root:  # a concurrent creation initialised it between our look and this session
        return
    root.attrs["logitstore"] = {"format": FORMAT_VERSION, "created": now(), "writer": WRITER}
    root.create_group(layout.TEACHERS)
    try:
        with commit_lock(location):
            session.commit("create logitstore store")
    except icechunk.ConflictError:
        if _is_bare(repo):  # not a concurrent creation: something else moved main
            raise
        # a concurrent creation initialised it first, the same way


def _version_info(snap: icechunk.SnapshotInfo, tags: list[str]) -> VersionInfo:
    meta = (snap.metadata or {}).get("logitstore", {})
    return VersionInfo(
        id=snap.id,
        message=snap.message,
        written_at=snap.written_at,
        parent_id=snap.parent_id,
        tags=tags,
        samples=meta.get("samples"),
        tokens=meta.get("tokens"),
    )
