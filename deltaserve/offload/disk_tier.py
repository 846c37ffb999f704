"""DiskTier: encoded objects as files in one directory, at most `capacity_bytes`, LRU evicted.

Layout: `<root>/<2 hex>/<32 hex>.obj`, the file named by a 128-bit blake2b of the key (keys may be
long and carry characters a file system dislikes), fanned out over 256 subdirectories.

- Writes are atomic: the object goes to a temporary file beside its final name, then
  `os.replace` moves it in, so a reader sees the old object, the new one or none, never half of
  one. Files are not fsynced: after a crash a torn file fails its checksum and is dropped as
  corrupt by the reader, which is the right outcome for a cache.
- Recency lives in memory; a hit also bumps the file's mtime, so that the index rebuilt from the
  directory at start-up (oldest mtime first) follows the access order of the previous run. Leftover
  temporary files are removed then, and if the directory holds more than the cap the oldest files go.
- A file that vanished under us (another process, an operator) is a miss; any other OSError
  (disk full, permission) raises TierError, so the TieredStore degrades this tier.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from deltaserve.offload.tiers import LruTier

OBJECT_SUFFIX = ".obj"
TEMP_SUFFIX = ".tmp"


class DiskTier(LruTier):
    """Encoded objects as files under `root`, the least recently used removed beyond `capacity_bytes`."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, name: str = "disk") -> None:
        super().__init__(name, capacity_bytes)  # the index is keyed by file stem, the digest of the object key
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._writing: set[str] = set()  # stems whose file is being written
        self._rebuild_index()

    def path_of(self, key: str) -> Path:
        """Where the object under `key` lives (whether or not it is there)."""
        return self._path_of_stem(_stem(key))

    def _put(self, key: str, data: bytes) -> bool:
        stem = _stem(key)
        with self._lock:
            if self._index.touch(stem):
                return True
            # Claim the bytes now so that concurrent puts cannot overshoot the cap while this one writes;
            # until the file is in place, readers see a miss.
            evicted = self._index.admit(stem, len(data))
            if evicted is None:
                return False
            self._writing.add(stem)
        for victim, _ in evicted:
            _unlink(self._path_of_stem(victim))
        self.count_evictions(nbytes for _, nbytes in evicted)
        path = self._path_of_stem(stem)
        try:
            self._write_atomically(path, data)
        except BaseException:
            with self._lock:
                self._index.remove(stem)
            raise
        finally:
            with self._lock:
                self._writing.discard(stem)
                deleted_meanwhile = stem not in self._index
        if deleted_meanwhile:
            _unlink(path)
        return True

    def _get(self, key: str) -> bytes | None:
        stem = _stem(key)
        with self._lock:
            if stem in self._writing or not self._index.touch(stem):
                return None
        path = self._path_of_stem(stem)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            with self._lock:
                self._index.remove(stem)
            return None
        return data

    def _contains(self, key: str) -> bool:
        stem = _stem(key)
        with self._lock:
            return stem in self._index and stem not in self._writing

    def _delete(self, key: str) -> bool:
        stem = _stem(key)
        with self._lock:
            held = stem in self._index
            self._index.remove(stem)
        if held:
            _unlink(self._path_of_stem(stem))
        return held

    def _path_of_stem(self, stem: str) -> Path:
        return self.root / stem[:2] / f"{stem}{OBJECT_SUFFIX}"

    def _write_atomically(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}")
        try:
            with open(temp, "wb") as file:
                file.write(data)
            os.replace(temp, path)
        except BaseException:
            _unlink(temp)
            raise

    def _rebuild_index(self) -> None:
        """Fills the index from the directory, oldest mtime first; drops temporaries and any excess."""
        found: list[tuple[float, str, int]] = []
        for subdir in self.root.iterdir():
            if not subdir.is_dir():
                continue
            for path in subdir.iterdir():
                if path.name.endswith(TEMP_SUFFIX):
                    _unlink(path)
                elif path.suffix == OBJECT_SUFFIX:
                    stat = path.stat()
                    found.append((stat.st_mtime, path.stem, stat.st_size))
        for _, stem, nbytes in sorted(found):
            self._index.add(stem, nbytes)
        while self._index.used_bytes > self._index.capacity_bytes:
            oldest = self._index.keys()[0]
            self.count_evictions([self._index.remove(oldest)])
            _unlink(self._path_of_stem(oldest))


def _stem(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
