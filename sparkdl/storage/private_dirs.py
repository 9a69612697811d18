"""Private local directories and files for what sparkdl writes on a host's own disk: the executors'
spool (training rows), the driver's received model parts, local checkpoints.

A shared temp directory is hostile ground: another local user can create a fixed name first and
then read, swap or redirect (a symlink) what lands there. So:

- Roots are per user, `<tempdir>/sparkdl-<uid>/<kind>`, made 0700. One that exists must be a real
  directory (not a link), owned by this user and closed to group and others; otherwise sparkdl
  refuses with a SparkdlError naming it. Refused rather than avoided: a name someone else took first
  is an attack or a mistake worth a look, and any fallback name could be taken first as well.
- Files are created O_CREAT|O_EXCL|O_NOFOLLOW with mode 0600: a planted file or link at the name
  makes the creation fail instead of being written through.
- Each run's or worker's own directory `<root>/<prefix><random>` has a sibling lock file
  `<...>.<host>.lock` that its owner holds (flock LOCK_EX) for as long as the directory lives. The
  kernel drops the lock when the owner dies, however it dies (SIGKILL included), so the next holder
  made under the same root removes exactly the directories whose lock it can take: no ages, no pids.
  The lock is a sibling, not inside, so the directory holds only its data (MLflow copies the
  parts directory whole).
- A sweep takes only this host's entries (the host name, dots made dashes, is in the lock's name):
  a data.spool_dir on NFS mounted nolock shares files between hosts but not locks (flock is then
  host-local), so another host's live directory would look dead. Two hosts of one name on one
  shared directory are not told apart. A root writable by group or others without the sticky bit
  (someone else could rename what sparkdl holds there) is used, with one warning naming it.
- Windows (no fcntl, no uids): roots are checked only for being real directories (no owner or
  mode check: NTFS modes do not say who can get in, and the temp directory is the user's own),
  nothing is locked and nothing is swept; a killed process's directories stay there.

Lock protocol (races included): the owner creates the lock file exclusively, takes the lock, checks
the name still points at the file it locked, and only then makes the directory. A sweeper takes the
lock without waiting, checks the same, removes the directory, then the lock file, then lets go: an
owner that loses that race finds its lock file gone and starts again under a new name, and a sweeper
killed midway leaves a lock the next sweep takes. Stdlib only; used on executors and the driver.
"""
from __future__ import annotations

import atexit
import errno
import getpass
import hashlib
import logging
import os
import platform
import re
import secrets
import shutil
import stat
import tempfile
import threading
from types import ModuleType
from typing import BinaryIO

from sparkdl.errors import SparkdlError

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no flock (see the module's docstring)
    fcntl = None

log = logging.getLogger("sparkdl")
FILE_MODE = 0o600
DIR_MODE = 0o700
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a filesystem without flock

_POSIX_OWNERS = hasattr(os, "geteuid")  # False on Windows: no uids, no owner or mode checks
_held: dict[str, "HeldDirectory"] = {}  # this process's held directories, by path
# Reentrant: a Spool caught in a reference cycle can be finalized by a garbage collection that an
# allocation under the guard starts, and its finalizer closes its HeldDirectory on this same thread.
_held_guard = threading.RLock()
_warned_open_roots: set[str] = set()


def host_tag(hostname: str) -> str:
    """`hostname` as it goes into lock names: no dots (the sweep's suffix match must not take a
    longer name ending in this one), only [A-Za-z0-9-], long ones shortened by a hash."""
    tag = re.sub(r"[^A-Za-z0-9-]", "-", hostname) or "host"
    if len(tag) > 64:
        tag = tag[:40] + "-" + hashlib.sha256(hostname.encode()).hexdigest()[:16]
    return tag


LOCK_SUFFIX = f".{host_tag(platform.node())}.lock"  # `<directory><LOCK_SUFFIX>`: this host's locks


# -- files ---------------------------------------------------------------------------------------
def create_private_file(path: str | os.PathLike[str]) -> int:
    """A new file's descriptor, open for writing, mode 0600; FileExistsError when anything (a file,
    a symlink, dangling or not) already has the name, so nothing planted there is written through."""
    return os.open(path, _NEW_FILE, FILE_MODE)


def open_private(path: str | os.PathLike[str], buffering: int = -1) -> BinaryIO:
    """`create_private_file` as a binary file object."""
    return os.fdopen(create_private_file(path), "wb", buffering=buffering)


def open_no_follow(path: str | os.PathLike[str]) -> BinaryIO:
    """An existing file for reading, never through a symlink (OSError ELOOP on one)."""
    return os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC), "rb")


def make_dirs(path: str | os.PathLike[str]) -> str:
    """`path` and its missing parents, each one sparkdl makes 0700 (os.makedirs would leave the
    parents 0777 less the umask); directories already there are left as they are (the user's)."""
    target = os.path.abspath(path)
    missing: list[str] = []
    current = target
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
    return target


# -- private roots -------------------------------------------------------------------------------
def private_root(kind: str, base: str | None = None) -> str:
    """`<base or the temp directory>/sparkdl-<uid>/<kind>`, made 0700 when absent and checked
    (check_private_dir) when present."""
    top = os.path.join(base or tempfile.gettempdir(), f"sparkdl-{_owner_tag()}")
    for directory in (top, os.path.join(top, kind)):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            pass
        check_private_dir(directory)
    return os.path.join(top, kind)


def check_private_dir(path: str) -> None:
    """SparkdlError unless `path` is a real directory (lstat: not a symlink) owned by this user
    and closed to group and others."""
    info = os.lstat(path)
    problem = ""
    if stat.S_ISLNK(info.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)!r})"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif not _POSIX_OWNERS:
        pass  # Windows: st_uid is 0 and st_mode 0o777 for every directory (see the docstring)
    elif info.st_uid != os.geteuid():
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}, not 0700)"
    if problem:
        raise SparkdlError(
            f"sparkdl's private directory {path!r} {problem}: whoever made it could read, swap or redirect "
            "the training rows and model parts sparkdl writes there, so sparkdl will not use it",
            hint=f"look at who made {path!r} and what it holds, then remove it (sparkdl makes it again, 0700, "
                 "owned by you), or point TMPDIR at a directory of your own; executors' spool can also go to "
                 "data.spool_dir")


# -- held directories and the sweep --------------------------------------------------------------
class HeldDirectory:
    """A directory this process made and holds by the lock on `<path><LOCK_SUFFIX>` (`<path>.<host>.lock`).
    `close()` removes it, then its lock file, then lets go (a kill midway leaves a lock the next
    sweep takes)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd, self._pid = path, fd, os.getpid()

    @property
    def lock_path(self) -> str:
        return self.path + LOCK_SUFFIX

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Idempotent. In a forked child only its copy of the descriptor goes: the parent's lock and
        directory stay (the lock is the open file's, shared across fork, and held while either lives)."""
        with _held_guard:  # a finalizer and atexit racing: only one of them gets the descriptor
            if _held.get(self.path) is self:
                del _held[self.path]
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() == self._pid:
                _remove_entry(self.path)
                _unlink(self.lock_path)
        finally:
            os.close(fd)

    def __enter__(self) -> "HeldDirectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HeldDirectory({self.path!r}, held={self.held})"


def _owner_tag() -> str:
    """This user in the private root's name: the uid; on Windows the user name (its temp
    directory is already the user's own)."""
    if _POSIX_OWNERS:
        return str(os.geteuid())
    try:
        return host_tag(getpass.getuser())
    except (OSError, KeyError, ImportError):
        return "user"


def warn_if_open(root: str) -> bool:
    """Warn, once per directory, when `root` is writable by group or others without the sticky bit:
    anyone who can write there can rename or delete sparkdl's directories and lock files in it (the
    private roots are 0700; this is about a user's data.spool_dir). True when it warned now."""
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return False
    if not _POSIX_OWNERS or not mode & 0o022 or mode & stat.S_ISVTX:
        return False
    with _held_guard:
        if root in _warned_open_roots:
            return False
        _warned_open_roots.add(root)
    log.warning("sparkdl: %r (mode %04o) is writable by group or others and has no sticky bit: another user "
                "can rename or delete the directories sparkdl keeps there (training rows); make it 0700, or "
                "chmod +t it", root, stat.S_IMODE(mode))
    return True


def hold_new_directory(root: str, prefix: str, label: str = "") -> HeldDirectory:
    """A new 0700 directory `<root>/<prefix><label><random>`, held until closed or this process
    dies; first the directories under `root` (same prefix, this host's) whose owners died are swept."""
    root = os.path.abspath(root)
    warn_if_open(root)
    _forget_removed()
    sweep(root, prefix)
    for _ in range(64):  # each retry follows a lost race with a sweep: a new name wins at once
        held = _try_hold(os.path.join(root, f"{prefix}{label}{secrets.token_hex(8)}"))
        if held is not None:
            with _held_guard:
                _held[held.path] = held
            return held
    raise OSError(f"could not make a directory of its own under {root!r}")


def release(path: str) -> bool:
    """Close this process's held directory at `path` (removing it); False when none is held there."""
    with _held_guard:
        held = _held.get(os.path.abspath(path)) or _held.get(path)
    if held is None:
        return False
    held.close()
    return True


def sweep(root: str, prefix: str) -> list[str]:
    """Remove the directories under `root` named `<prefix>...` whose lock can be taken (their
    owner is dead), never one whose lock is held, nor one of this process's (a filesystem that
    emulates flock with per-process POSIX locks would let this process take its own). Entries
    that are not this user's regular lock files, or are another host's, are left alone; without
    flock (Windows) nothing is swept. Returns the paths removed."""
    root = os.path.abspath(root)
    if fcntl is None:
        return []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if not (name.startswith(prefix) and name.endswith(LOCK_SUFFIX)):
            continue
        path = os.path.join(root, name[: -len(LOCK_SUFFIX)])
        with _held_guard:
            ours = path in _held
        if not ours and _sweep_one(path):
            removed.append(path)
    return removed


def _sweep_one(path: str) -> bool:
    lock = path + LOCK_SUFFIX
    try:
        fd = os.open(lock, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError:  # gone meanwhile, a symlink, not readable by us
        return False
    try:
        info = os.fstat(fd)
        if (_POSIX_OWNERS and info.st_uid != os.geteuid()) or not stat.S_ISREG(info.st_mode):
            return False
        if not _take(fd, missing_locks_count_as_taken=False) or not _still_named(lock, fd):
            return False  # alive, or already swept by someone else
        _remove_entry(path)
        _unlink(lock)
        return True
    finally:
        os.close(fd)


def _try_hold(path: str) -> HeldDirectory | None:
    lock = path + LOCK_SUFFIX
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, FILE_MODE)
    except FileExistsError:
        return None
    try:
        if not _take(fd, missing_locks_count_as_taken=True) or not _still_named(lock, fd):
            os.close(fd)  # a sweep took it between creation and lock: it removes the name
            return None
        os.mkdir(path, DIR_MODE)
    except BaseException:
        _unlink(lock)
        os.close(fd)
        raise
    return HeldDirectory(path, fd)


def _take(fd: int, missing_locks_count_as_taken: bool) -> bool:
    """The exclusive lock without waiting. On a filesystem without locks an owner goes on unlocked
    and a sweeper takes nothing: such directories are never swept, rather than swept while alive."""
    if fcntl is None:
        return missing_locks_count_as_taken
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return missing_locks_count_as_taken
        raise


def _still_named(path: str, fd: int) -> bool:
    """Whether `path` still names the file open at `fd` (a sweep that won removed the name)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_entry(path: str) -> None:
    """A directory and what it holds, never following a link (a link or a file is unlinked itself)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: links inside are not followed
    else:
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _close_all() -> None:
    """At a normal exit every held directory goes (they are temporary by nature); a killed process
    leaves them to the next sweep."""
    with _held_guard:
        held = _held.copy()  # one C-level copy: a finalizer that a collection runs meanwhile cannot break it
    for one in held.values():
        one.close()


def _forget_removed() -> None:
    """Let go of held directories someone removed as a whole (ModelParts removes the driver's parts
    directory with shutil.rmtree): their lock files go too, and their descriptors are closed."""
    with _held_guard:
        held = _held.copy()
    for path, one in held.items():
        if not os.path.lexists(path):
            one.close()
