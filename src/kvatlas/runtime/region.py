"""The L1 region: one contiguous block of POSIX shared memory holding every L1 chunk.

Owns creating, mapping, attaching to and cleaning up the region. It knows nothing about
which bytes belong to which chunk (that is ``kvatlas.core.server.l1pool``) and must not
interpret the bytes.

The owner (the cache server) creates the region with ``multiprocessing.shared_memory``
under a unique name ``kvatlas-<instance>-<pid>-<random>``; the resource tracker then
removes it if the server dies without ``unlink()``. Other processes (the local engine,
same-host peers) ``attach`` by name: that maps ``/dev/shm/<name>`` directly with ``mmap``
(``ACCESS_READ``, i.e. ``PROT_READ``, for a read-only attach) instead of through
``SharedMemory``, because on Python < 3.13 an attaching ``SharedMemory`` registers the
segment with its own resource tracker, which would unlink the owner's region when the
attaching process exits. Attach therefore needs Linux's ``/dev/shm``.

Cleanup: ``close()`` unmaps; it fails with RegionBusy while memoryviews or arrays handed
out by ``view``/``buffer``/``array`` are still alive (release them first; ``mmap`` cannot
unmap exported memory). ``unlink()`` (owner only) removes the name; the mapping stays
usable until ``close()``. As a context manager the owner closes and unlinks on exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
from multiprocessing import shared_memory
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import numpy as np
import numpy.typing as npt

from kvatlas.core.errors import InvalidInput, ServiceError

SHM_DIR: Final = Path("/dev/shm")
_NAME_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class RegionError(ServiceError):
    """The L1 region cannot be created, attached or closed."""


class RegionBusy(RegionError):
    """``close()`` while views into the region are still alive."""


def region_name(instance_id: str) -> str:
    """A fresh region name: ``kvatlas-<instance>-<pid>-<random>`` (instance sanitized)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id)[:64] or "node"
    return f"kvatlas-{safe}-{os.getpid()}-{secrets.token_hex(4)}"


class L1Region:
    """A mapped shared-memory region; build it with ``create`` or ``attach``."""

    def __init__(
        self,
        name: str,
        size: int,
        mapping: mmap.mmap,
        *,
        owner: bool,
        readonly: bool,
        shm: shared_memory.SharedMemory | None = None,
    ) -> None:
        self._name = name
        self._size = size
        self._mmap: mmap.mmap | None = mapping
        self._shm = shm
        self._owner = owner
        self._readonly = readonly
        self._view: memoryview | None = memoryview(mapping)[:size]
        self._array: npt.NDArray[np.uint8] | None = None
        self._unlinked = False
        self._lock_fd: int | None = None
        """A kept region's file, flocked for as long as it is mapped (``keep``)."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, size: int, instance_id: str = "node", name: str | None = None) -> Self:
        """Create and own a new region of ``size`` bytes (zero-filled by the kernel)."""
        if size <= 0:
            raise InvalidInput(f"L1 region size must be positive, got {size}")
        name = name or region_name(instance_id)
        _check_name(name)
        _check_room(size)
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except OSError as exc:
            raise RegionError(
                f"cannot create shared memory {name!r} of {size} bytes: {exc}"
            ) from exc
        # SharedMemory keeps its mapping in ``_mmap``; using it directly lets close() release
        # our own views before SharedMemory.close() unmaps.
        mapping: mmap.mmap = shm._mmap  # type: ignore[attr-defined]
        return cls(shm.name, size, mapping, owner=True, readonly=False, shm=shm)

    @classmethod
    def keep(cls, name: str, size: int) -> tuple[Self, bool]:
        """Open the region ``name`` that outlives this process (for a warm restart),
        creating it when missing; True with it when it existed with ``size`` bytes, its
        bytes as the last process left them. Another size is cleared to zeros (a new
        layout). No resource tracker is involved, so neither SIGKILL nor ``close()``
        removes it; ``unlink()`` does. An exclusive ``flock`` on it, held until
        ``close()`` (the kernel drops it when the process dies), keeps a second process
        from taking it over: RegionError then."""
        if size <= 0:
            raise InvalidInput(f"L1 region size must be positive, got {size}")
        _check_name(name)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RegionError(f"cannot open shared memory {name!r}: {exc}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise RegionError(
                    f"L1 region {name!r} is held by another running process (a server with"
                    " the same --instance-id and --state-dir?)"
                ) from exc
            existed = os.fstat(fd).st_size == size
            if not existed:
                os.ftruncate(fd, 0)
                _check_room(size)
                os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            os.close(fd)
            raise RegionError(f"cannot map shared memory {name!r}: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        region = cls(name, size, mapping, owner=True, readonly=False)
        region._lock_fd = fd
        return region, existed

    @classmethod
    def attach(cls, name: str, size: int, readonly: bool = True, *, populate: bool = True) -> Self:
        """Map an existing region created by another process (Linux ``/dev/shm``).

        ``readonly`` maps it ``PROT_READ``: writes through any view raise TypeError.
        ``populate`` fills this process's page tables for the whole region now (see
        ``_populate``): right for the local engine, which uses all of it; a same-host peer
        that reads a few leased ranges of a large region passes False, so that attaching
        costs neither the time nor the page tables of the whole region.
        """
        _check_name(name)
        path = SHM_DIR / name
        flags = os.O_RDONLY if readonly else os.O_RDWR
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise RegionError(f"cannot open shared memory {name!r}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise RegionError(f"shared memory {name!r} has {actual} bytes, expected {size}")
            # ACCESS_READ (not just PROT_READ) so that Python's buffers are read-only too:
            # a PROT_READ mapping exported as writable would segfault on write.
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mapping = mmap.mmap(fd, size, access=access)
        except OSError as exc:
            raise RegionError(f"cannot map shared memory {name!r}: {exc}") from exc
        finally:
            os.close(fd)
        if populate:
            _populate(mapping, readonly)
        return cls(name, size, mapping, owner=False, readonly=readonly)

    # ------------------------------------------------------------------------- access

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def buffer(self) -> memoryview:
        """The whole region as a memoryview (read-only for a read-only attach)."""
        if self._view is None:
            raise RegionError(f"L1 region {self._name!r} is closed")
        return self._view

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole region as a uint8 numpy array (not writeable for a read-only attach)."""
        if self._array is None:
            self._array = np.frombuffer(self.buffer, dtype=np.uint8)
        return self._array

    def prefault(self, page_bytes: int = 4096) -> None:
        """Touch every page now, so that no store or peer read pays the page faults.

        A fresh shared-memory page costs a fault plus zeroing on first write: on a large
        peer read into untouched slots, more than the copy itself. Writing one byte per page
        allocates them all up front, which is what an operator asking for
        ``--l1-size-gb`` expects to be reserved.
        """
        if self._readonly:
            raise RegionError(f"cannot prefault the read-only mapping of {self._name!r}")
        if self._mmap is not None and _populate(self._mmap, readonly=False):
            return
        if self._lock_fd is not None:  # a kept region's bytes matter: fault by reading
            int(self.array[::page_bytes].sum())
            return
        self.array[::page_bytes] = 0

    def view(self, offset: int, size: int) -> memoryview:
        """``size`` bytes at ``offset``; InvalidInput when outside the region."""
        if offset < 0 or size < 0 or offset + size > self._size:
            raise InvalidInput(
                f"range [{offset}, {offset + size}) is outside the L1 region of {self._size} bytes"
            )
        return self.buffer[offset : offset + size]

    def address(self) -> int:
        """Base address of the mapping in this process (for transports that register
        memory or take pointers)."""
        return int(self.array.ctypes.data)

    # ------------------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Unmap (idempotent). RegionBusy while views handed out are still referenced."""
        if self._view is None:
            return
        self._array = None
        try:
            self._view.release()
        except BufferError as exc:  # an array made from the view still lives
            raise RegionBusy(
                f"L1 region {self._name!r} still has live views; release them before close()"
            ) from exc
        try:
            if self._shm is not None:
                self._shm.close()
            elif self._mmap is not None:
                self._mmap.close()
        except BufferError as exc:
            self._view = memoryview(self._mmap)[: self._size] if self._mmap else None
            raise RegionBusy(
                f"L1 region {self._name!r} still has live views; release them before close()"
            ) from exc
        self._view = None
        self._mmap = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    @property
    def kept(self) -> bool:
        """Opened with ``keep``: the region outlives this process unless unlinked."""
        return self._shm is None and self._owner

    def unlink(self) -> None:
        """Remove the region's name (owner only, idempotent); mappings stay valid."""
        if not self._owner:
            raise RegionError(f"only the owner may unlink L1 region {self._name!r}")
        if self._unlinked:
            return
        if self._shm is not None:
            self._shm.unlink()
        else:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / self._name).unlink()
        self._unlinked = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        finally:
            if self._owner:
                self.unlink()

    def __repr__(self) -> str:
        mode = "owner" if self._owner else ("ro" if self._readonly else "rw")
        return f"L1Region({self._name!r}, size={self._size}, {mode})"


def _check_room(size: int) -> None:
    """RegionError when ``/dev/shm`` has less than ``size`` bytes free: the region would
    be created sparse and the process killed by SIGBUS on its first touch of a page the
    filesystem cannot give, with nothing in its log."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return  # no /dev/shm to ask (not Linux): SharedMemory will say what is wrong
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise RegionError(
            f"an L1 region of {size / 2**30:.2f} GiB does not fit {SHM_DIR}, which has"
            f" {free / 2**30:.2f} GiB free: lower --l1-size-gb, or give {SHM_DIR} more room"
            " (docker run --shm-size, a Kubernetes emptyDir with medium Memory and a"
            " sizeLimit)"
        )


def _check_name(name: str) -> None:
    if not _NAME_OK.match(name):
        raise InvalidInput(
            f"shared memory name {name!r} must be 1-200 characters among"
            " letters, digits, '.', '_' and '-'"
        )


_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


def _populate(mapping: mmap.mmap, readonly: bool) -> bool:
    """Fill this process's page tables for the whole mapping now (Linux >= 5.14).

    The owner touched every page, but each process that maps the region still takes a
    minor fault per 4 KiB page on first access, which makes an engine's first stores into
    a freshly attached region several times slower than later ones. Older kernels refuse
    the advice (EINVAL, False); the mapping then fills lazily as before.
    """
    advice = _MADV_POPULATE_READ if readonly else _MADV_POPULATE_WRITE
    try:
        mapping.madvise(advice)
    except OSError:
        return False
    return True
