"""A directory of block files: the embedded default store, shareable by processes and hosts
(a local disk, or any shared file system mounted at the same path).

Layout: ``<root>/<namespace>/<first two hex digits of the key>/<key hex>.kvb``.

Safe with many processes reading and writing at once, without locks:
- a writer writes a private temp file next to the target and ``os.replace``s it into place, so a
  reader sees the old file, the new one or none, never a partial one; two writers of one block
  leave one complete copy (equal keys mean equal K/V);
- every read checks the header and checksum (``blockfile``); a bad file is deleted (if it is still
  the same file) and is a miss;
- the LRU order is shared through file mtimes (a read touches the file); eviction removes the
  oldest files of the whole root and shrugs at files another process removed first;
- the size is re-scanned every ``rescan_interval_s`` and whenever this process's estimate passes
  the bound, so other processes' writes count too (between scans the root can overshoot by
  what other processes wrote since).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

from pdinfer.kv_store.blockfile import (
    check_key,
    encode_header,
    namespace_digest,
    read_block,
    read_block_into,
)
from pdinfer.kv_store.store import KVStore

logger = logging.getLogger("pdinfer")

SUFFIX = ".kvb"
_TMP = ".tmp-"
STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died


class DirectoryStore(KVStore):
    def __init__(
        self,
        root: str,
        namespace: str,
        block_size: int,
        max_bytes: int,
        *,
        fsync: bool = False,
        rescan_interval_s: float = 5.0,
        low_watermark: float = 0.9,
    ):
        super().__init__(namespace, block_size, max_bytes)
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark must be in (0, 1], got {low_watermark}")
        self.root = os.path.abspath(root)
        self.directory = os.path.join(self.root, namespace)
        os.makedirs(self.directory, exist_ok=True)
        self.fsync = fsync
        self.rescan_interval_s = rescan_interval_s
        self.low_watermark = low_watermark
        self._ns_digest = namespace_digest(namespace)
        self._lock = threading.Lock()  # the size estimate; one eviction at a time per process
        self._bytes = 0
        self._last_scan = 0.0
        self.evict()

    def path_of(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self.path_of(key))

    def get(self, key: bytes) -> bytes | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                payload = read_block(f, self._ns_digest, key)
                inode = os.fstat(f.fileno()).st_ino
        except OSError:  # absent, removed meanwhile, or unreadable
            self._count(misses=1)
            return None
        return payload if self._after_read(path, inode, None if payload is None else len(payload)) else None

    def get_into(self, key: bytes, out: memoryview) -> bool:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                ok = read_block_into(f, self._ns_digest, key, out)
                inode = os.fstat(f.fileno()).st_ino
        except OSError:
            self._count(misses=1)
            return False
        return self._after_read(path, inode, out.nbytes if ok else None)

    def _after_read(self, path: str, inode: int, nbytes: int | None) -> bool:
        if nbytes is None:
            logger.warning("KV store: %s failed verification; deleted, will be recomputed", path)
            _discard_if_same(path, inode)
            self._count(misses=1, corrupt=1)
            return False
        _touch(path)
        self._count(hits=1, bytes_read=nbytes)
        return True

    def put(self, key: bytes, payload) -> bool:
        check_key(key)
        path = self.path_of(key)
        if os.path.exists(path):
            _touch(path)
            return False
        header = encode_header(self._ns_digest, key, payload)
        size = len(header) + memoryview(payload).nbytes
        if size > self.max_bytes:
            return False
        tmp = f"{path}{_TMP}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            _touch(tmp)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            self._count(write_errors=1)
            logger.warning("KV store: could not write %s: %s", path, exc)
            return False
        self._count(puts=1, bytes_written=size)
        with self._lock:
            self._bytes += size
            due = self._bytes > self.max_bytes or time.monotonic() - self._last_scan > self.rescan_interval_s
        if due:
            self.evict()
        return True

    def evict(self, max_bytes: int | None = None) -> int:
        """Re-scan the root; when over ``max_bytes`` (default: over the bound, then down to
        ``low_watermark`` of it, so evictions come in batches) remove the oldest blocks."""
        with self._lock:
            files, total = self._scan()
            limit = self.max_bytes if max_bytes is None else max_bytes
            target = int(limit * self.low_watermark) if max_bytes is None else limit
            freed = evicted = 0
            if total > limit:
                files.sort()  # least recently used first
                for _, size, path in files:
                    if total - freed <= target:
                        break
                    _unlink(path)  # gone already (another process evicted it): as good
                    freed += size
                    evicted += 1
            self._bytes = total - freed
            self._last_scan = time.monotonic()
        if evicted:
            self._count(evictions=evicted)
        return freed

    def size_bytes(self) -> int:
        return self._bytes

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """(mtime, size, path) of every block file under the root, and the bytes in use."""
        files, total, now = [], 0, time.time()
        for namespace in _subdirs(self.root):
            for shard in _subdirs(namespace):
                for entry in _entries(shard):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.name.endswith(SUFFIX):
                        files.append((st.st_mtime_ns, st.st_size, entry.path))
                        total += st.st_size
                    elif _TMP in entry.name:
                        if now - st.st_mtime > STALE_TMP_S:
                            _unlink(entry.path)
                        else:
                            total += st.st_size  # being written
        return files, total

    def verify_all(self) -> tuple[int, list[str]]:
        """Check every block file of this namespace: (number that verify, paths that do not)."""
        good, bad = 0, []
        for shard in _subdirs(self.directory):
            for entry in _entries(shard):
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    with open(entry.path, "rb") as f:
                        ok = read_block(f, self._ns_digest, key) is not None
                except (OSError, ValueError):
                    ok = False
                if ok:
                    good += 1
                else:
                    bad.append(entry.path)
        return good, bad


def _subdirs(path: str) -> list[str]:
    return [e.path for e in _entries(path) if e.is_dir(follow_symlinks=False)]


def _entries(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _touch(path: str) -> None:
    """Mark ``path`` used now. The mtime is the shared LRU clock; set from ``time_ns`` because
    the file system's own timestamps are often coarser than back-to-back writes."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _discard_if_same(path: str, inode: int) -> None:
    """Delete a bad file unless a writer has meanwhile replaced it with a new one."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass
