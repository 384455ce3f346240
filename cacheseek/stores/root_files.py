"""`RootFolder`: the files of a store root that only this user can plant, read through descriptors.

Anyone who can write a store root can plant links in it (a shard folder linked to another folder,
a value file linked to ``~/.ssh/id_rsa``, a FIFO where a value should be), and a store that
follows them reads, writes and deletes outside its root, blocks in ``open`` or counts another
file's bytes. So:

- the root is created ``0700``; an existing one must be a folder owned by this user that neither
  group nor others can write (a link to it is followed only when this user owns the link); anything
  else is a `ConfigError` naming ``store.root`` and the fix, before the store takes the root's lock;
- the root is opened once (``fd``) and every later call goes through that descriptor: shard folders
  are opened with ``O_NOFOLLOW | O_DIRECTORY`` (a link is refused, never followed), files with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked regular by ``fstat`` (a FIFO never blocks), listings
  use ``lstat`` (a link or a FIFO is neither a value nor counted in usage);
- only names the store could have written are removed, and never a folder.

Shapes: a *shard* is a two-hex-digit folder directly under the root; names inside it are the
caller's (`cacheseek.stores.localdisk` keeps values and ``.{value}.{token}.tmp`` temp files).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from cacheseek.errors import ConfigError, StoreError

__all__ = ["RootFolder", "NotRegularError", "is_shard_name"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EMLINK})


class NotRegularError(StoreError):
    """A name the store reads is a link, a FIFO, a folder or a device: not a file it wrote."""


def is_shard_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


class RootFolder:
    """A trusted store root (see the module docstring). ``fix``: the `ConfigError`s' fix."""

    def __init__(self, path: Path, fix: str) -> None:
        self.path = path
        self.fix = fix
        self.fd: Optional[int] = None

    def open(self) -> None:
        """Create (``0700``) or check the root and open it; `ConfigError` naming ``store.root``."""
        path = self.path
        if not os.path.lexists(path):
            self._create(path)
        me = os.geteuid()
        try:
            link = os.lstat(path)
            if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
                self._refuse(f"{path} is a link owned by uid {link.st_uid}, not by this user (uid {me})", owner=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise ConfigError("store.root", f"{path} is a file, not a folder", self.fix) from None
        except OSError as exc:
            raise ConfigError("store.root", f"cannot open folder {path}: {exc}", self.fix) from None
        st = os.fstat(fd)
        problem, owner = None, st.st_uid != me
        if owner:
            problem = f"{path} is owned by uid {st.st_uid}, not by this user (uid {me})"
        elif st.st_mode & 0o022:
            problem = f"{path} can be written by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        if problem is not None:
            os.close(fd)
            self._refuse(problem, owner)
        self.fd = fd

    def _create(self, path: Path) -> None:
        """Make the root itself (``0700``), never its parents: a parent that is missing or a file
        is a `ConfigError` naming the path that is wrong."""
        above = path.parent
        while not os.path.lexists(above) and above != above.parent:
            above = above.parent
        if not os.path.isdir(above):
            raise ConfigError("store.root", f"{above} is a file, not a folder, so {path} cannot be made under it",
                              f"choose a store.root under a folder: store.root={Path('/tmp') / path.name}")
        if above != path.parent:
            raise ConfigError("store.root", f"its parent {path.parent} does not exist (only the root's own folder "
                              "is created, never the folders above it)",
                              f"create the parent first (mkdir -p {path.parent}), or choose a store.root whose "
                              "parent exists")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError("store.root", f"cannot create folder {path}: {exc.strerror or exc}", self.fix) from None

    def _refuse(self, problem: str, owner: bool = False) -> None:
        fix = (f"use a folder of your own: a new store.root that does not exist yet (it is created 0700), or "
               f"take this one over (sudo chown -R $(id -u) {self.path})") if owner else \
            (f"make it writable by you alone (chmod 700 {self.path}), or a new store.root that does not exist "
             "yet (it is created 0700)")
        raise ConfigError("store.root", f"{problem}: anyone who can write it can plant links in it", fix)

    def probe(self, name: str) -> None:
        """Write and remove a new small file ``name``: `ConfigError` when the root is not
        writable. Created exclusively: a planted file or link of that name is never written."""
        try:
            fd = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=self.fd)
            try:
                os.write(fd, b"probe")
            finally:
                os.close(fd)
            os.unlink(name, dir_fd=self.fd)
        except OSError as exc:
            raise ConfigError("store.root", f"folder {self.path} is not writable: {exc}", self.fix) from None

    def lock(self, name: str) -> int:
        """A shared ``flock`` on the file ``name``, held by the returned descriptor while the
        store is open: every process of a root holds one (several stores share a root; something
        that must have it alone takes it exclusively). Opened read-only and never through a link;
        a hard link, a FIFO or another user's file in its place is a `ConfigError` (never written)."""
        import fcntl

        try:
            fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                         dir_fd=self.fd)
        except OSError as exc:
            raise ConfigError("store.root", f"cannot open the lock {self.path / name}: {exc}", self.fix) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            os.close(fd)
            raise ConfigError("store.root", f"{self.path / name} is not the root's own lock file (a link, a FIFO "
                              "or another user's file: someone put it there)",
                              f"remove it (rm {self.path / name}), or use a new store.root")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ConfigError("store.root", f"{self.path} is held exclusively by another process",
                                  "wait for it to finish, or use another store.root") from None
            raise ConfigError("store.root", f"cannot lock {self.path}: {exc}", self.fix) from None
        return fd

    def refuse_planted(self) -> None:
        """`ConfigError` when entries with a shard's name are links or files (nothing a store made)."""
        with os.scandir(self.fd) as it:
            planted = sorted(e.name for e in it if is_shard_name(e.name) and not e.is_dir(follow_symlinks=False))
        if planted:
            raise ConfigError("store.root", f"{self.path} holds {', '.join(planted)}: links or files where only "
                              "the store's folders go (someone else put them there)",
                              f"remove them (rm {' '.join(str(self.path / n) for n in planted)}), or use a new store.root")

    def free_bytes(self) -> Optional[int]:
        """Bytes free to an unprivileged writer on the root's file system (through its
        descriptor: the root opened, not whatever its path names now), or None if unknown."""
        try:
            st = os.fstatvfs(self.fd)
        except (OSError, TypeError):
            return None
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- shards ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def shard(self, name: str, *, create: bool = False) -> Iterator[Optional[int]]:
        """The shard folder ``name``'s descriptor (None: absent and not created). A link or a
        non-folder in its place is `NotRegularError`, never followed."""
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreError(f"cannot create folder {self.path / name}: {exc}") from exc
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            fd = None
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise NotRegularError(f"{self.path / name} is a link or not a folder: refused") from None
            raise StoreError(f"cannot open folder {self.path / name}: {exc}") from exc
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def shard_names(self) -> list[str]:
        """The shard folders under the root (links and files with a shard's name excluded)."""
        with os.scandir(self.fd) as it:
            return sorted(e.name for e in it if is_shard_name(e.name) and e.is_dir(follow_symlinks=False))

    # -- files ----------------------------------------------------------------------------------
    @staticmethod
    def open_file(shard_fd: int, name: str) -> Optional[int]:
        """A read descriptor of regular file ``name`` (None: absent); a link, FIFO, folder or
        device is `NotRegularError` (never followed, never blocking)."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=shard_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise NotRegularError(f"{name} is a link: refused") from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise NotRegularError(f"{name} is not a regular file (mode {mode:o}): refused")
        os.set_blocking(fd, True)
        return fd

    @staticmethod
    def create_file(shard_fd: int, name: str) -> int:
        """A new file ``name`` (``0600``, exclusive, never through a link)."""
        return os.open(name, _WRITE_FLAGS, 0o600, dir_fd=shard_fd)

    @staticmethod
    def is_regular(shard_fd: int, name: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(name, dir_fd=shard_fd).st_mode)
        except FileNotFoundError:
            return False

    @staticmethod
    def remove(shard_fd: int, name: str) -> bool:
        """Unlink ``name`` (a file or a link); False when absent; a folder is `NotRegularError`."""
        try:
            if stat.S_ISDIR(os.lstat(name, dir_fd=shard_fd).st_mode):
                raise NotRegularError(f"{name} is a folder, not a file: left alone")
            os.unlink(name, dir_fd=shard_fd)
        except FileNotFoundError:
            return False
        return True

    def files_aged(self, shard_fd: int) -> list[tuple[str, int, float]]:
        """``(name, size, mtime)`` of every regular file in a shard (links, FIFOs, folders excluded)."""
        out = []
        with os.scandir(shard_fd) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out.append((e.name, st.st_size, st.st_mtime))
                except FileNotFoundError:  # removed meanwhile
                    pass
        return out
