"""A process's death told the moment its teardown begins, without polling: a robust futex in a sealed memfd.

The engine (`DeathMark.create`, on its main thread) makes a 4 KiB memfd, sealed so that it can never shrink, puts a
process-shared robust pthread mutex at its start, locks it and never unlocks it, and sends the fd to its agent
(libs/client/agent_link.py). When the main thread dies, however it dies (SIGKILL included), the kernel walks its
robust list early in its teardown (do_exit -> exit_mm -> futex_exit_release, right after it set PF_EXITING and the
exit code in /proc/<pid>/stat, and long before a CUDA process's pidfd turns readable): it sets FUTEX_OWNER_DIED in
the mutex's word and wakes a waiter. The agent's mark waiter (services/agent/mark_waiter.py: `MarkView`, a thread
per engine) waits on that word with the futex syscall and so can hear of the death without a poll period's wait.

Rules:
1. The mark is a hint, never a verdict: the agent still reads the death (PF_EXITING and the exit code) from /proc,
   at once when woken. A word that changed without FUTEX_OWNER_DIED (the engine unlocked it, or wrote over it) only
   disarms the mark: the agent goes back to polling that engine.
2. The agent trusts nothing in the memfd: it maps it read-only, only once it is sealed against shrinking (a shrunk
   mapping would fault the agent with SIGBUS), and only if its word names the registered pid as its owner with the
   waiters bit set (the engine sets it, so that the kernel wakes a waiter; nobody else writes the word while the
   owner lives), or its owner's death. It never calls pthread functions on it (those would follow list pointers
   the engine controls).
3. The owner is the main thread, whose id is the pid: the kernel releases a thread's robust mutexes at that thread's
   death, and /proc/<pid>/stat is the main thread's. A mark locked on another thread is refused by its creator.
4. Linux with glibc only (the mutex's word is the first int of glibc's `pthread_mutex_t`); elsewhere `create`
   raises `Unsupported` and the engine registers without a mark.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import platform
import stat
import threading

from libs.common.errors import HoldfastError, MalformedMessage

SIZE = 4096
FUTEX_WAITERS = 0x80000000
FUTEX_OWNER_DIED = 0x40000000
FUTEX_TID_MASK = 0x3FFFFFFF
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_PTHREAD_PROCESS_SHARED, _PTHREAD_MUTEX_ROBUST = 1, 1
_MUTEX_BYTES, _ATTR_BYTES = 64, 16  # above glibc's sizes on x86_64 (40, 4) and aarch64 (48, 8)


class Unsupported(HoldfastError):
    code = "unsupported"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    with contextlib.suppress(ValueError, OSError):
        if (platform.system() == "Linux" and platform.machine() in _SYS_FUTEX
                and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc ")):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            return libc
    return None


def _libc() -> ctypes.CDLL:
    """glibc, its calls made without the GIL (a CDLL's are)."""
    libc = _glibc()
    if libc is None:
        raise Unsupported(f"death marks need Linux with glibc on x86_64 or aarch64, not {platform.platform()}")
    return libc


class DeathMark:
    """The engine's side: the locked mutex and its memfd (`fd`, sent to the agent on every registration)."""

    def __init__(self, fd: int, mm: mmap.mmap) -> None:
        self.fd, self._mm = fd, mm  # the mapping is kept: the mutex lives in it as long as the process

    @classmethod
    def create(cls) -> DeathMark:
        """Make, lock and seal the mark; raises `Unsupported` off the main thread or off glibc (rule 3, 4)."""
        if threading.current_thread() is not threading.main_thread():
            raise Unsupported("a death mark is locked on the main thread (its owner's death is the process's)")
        libc = _libc()
        fd = os.memfd_create("holdfast-death-mark", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SIZE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        mutex = (ctypes.c_char * _MUTEX_BYTES).from_buffer(mm)
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        for call, args in (("pthread_mutexattr_init", (attr,)),
                           ("pthread_mutexattr_setpshared", (attr, _PTHREAD_PROCESS_SHARED)),
                           ("pthread_mutexattr_setrobust", (attr, _PTHREAD_MUTEX_ROBUST)),
                           ("pthread_mutex_init", (mutex, attr)),
                           ("pthread_mutex_lock", (mutex,))):
            rc = getattr(libc, call)(*args)
            if rc != 0:
                del mutex
                mm.close()
                os.close(fd)
                raise Unsupported(f"{call}: {os.strerror(rc)}")
        del mutex  # the buffer's export: the mapping stays open as long as the process (it is never unlocked)
        word = ctypes.c_uint32.from_buffer(mm)
        # rule 2: the waiters bit, so that the kernel wakes the agent; nothing else writes the word while we live
        word.value = word.value | FUTEX_WAITERS
        value = word.value
        del word
        if value & FUTEX_TID_MASK != os.getpid():
            mm.close()
            os.close(fd)
            raise Unsupported(f"the mark's owner is {value & FUTEX_TID_MASK}, not this process's main thread")
        return cls(fd, mm)


class MarkView:
    """The agent's side: a read-only view of an engine's mark. `wait` blocks (without the GIL) until the word changes,
    `wake` from another thread ends a wait early. Not reusable after `close`."""

    def __init__(self, fd: int, pid: int) -> None:
        """Check and map the mark the engine of `pid` sent (rule 2); `fd` stays the caller's to close. Raises
        `MalformedMessage` for a mark that is not one."""
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise MalformedMessage(f"the death mark is not a sealed memfd: {e}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size < SIZE:
            raise MalformedMessage(f"the death mark is not a memfd of {SIZE} bytes")
        if not seals & fcntl.F_SEAL_SHRINK:
            raise MalformedMessage("the death mark is not sealed against shrinking")
        self._libc = _libc()
        self._sys_futex = _SYS_FUTEX[platform.machine()]
        # mapped through libc: a read-only Python mmap cannot give ctypes an address
        addr = self._libc.mmap(None, SIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise MalformedMessage(f"the death mark could not be mapped: {os.strerror(err)}")
        self._addr: int | None = int(addr)
        self._word = ctypes.c_uint32.from_address(self._addr)
        self.armed_with = pid | FUTEX_WAITERS
        word = int(self._word.value)
        if word != self.armed_with and not word & FUTEX_OWNER_DIED:  # its owner dead already: the first wait says so
            self.close()
            raise MalformedMessage(f"the death mark's word {word:#x} does not name pid {pid} as its owner with "
                                   "waiters")

    def value(self) -> int:
        assert self._addr is not None, "closed"
        return int(self._word.value)

    def wait(self, timeout_s: float) -> int:
        """Block until the word is no longer `armed_with` (or `timeout_s`, or a `wake`); the word then."""
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        rc = self._libc.syscall(self._sys_futex, ctypes.c_void_p(self._addr), _FUTEX_WAIT,
                                ctypes.c_uint32(self.armed_with), ctypes.byref(ts), None, 0)
        if rc != 0:
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                raise OSError(err, os.strerror(err))
        return self.value()

    def wake(self) -> None:
        self._libc.syscall(self._sys_futex, ctypes.c_void_p(self._addr), _FUTEX_WAKE, 1, None, None, 0)

    @property
    def closed(self) -> bool:
        return self._addr is None

    def close(self) -> None:
        """Unmap; only once no thread waits or will wait on it."""
        if self._addr is not None:
            self._libc.munmap(self._addr, SIZE)
            self._addr = None


def died(word: int) -> bool:
    """The owner's death, as the kernel writes it into the word."""
    return bool(word & FUTEX_OWNER_DIED)
