"""A Linux timerfd: a file descriptor that becomes readable at a precise time.

epoll's own timeout has millisecond resolution (rounded up), which would add
up to a millisecond to every emulated delay. A timerfd armed for the next due
packet wakes an epoll loop within tens of microseconds instead. Python 3.13
has ``os.timerfd_create``; on older versions the same system calls are made
through ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

_CLOCK_MONOTONIC = 1  # the clock of time.monotonic()
_TFD_CLOEXEC = 0o2000000
_TFD_NONBLOCK = 0o4000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class TimerFD:
    """A one-shot timer on CLOCK_MONOTONIC; register :attr:`fd` with epoll for reading."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd: int = fd
        self._armed_at: float | None = None
        # One preallocated argument, reused on every call: arming is on the
        # router's hot path.
        self._spec = _Itimerspec()
        self._settime = self._libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        self._spec_ref = ctypes.byref(self._spec)

    def arm(self, when: float) -> None:
        """Fire at ``when`` (a ``time.monotonic()`` value); re-arming replaces the last."""
        if when == self._armed_at:
            return
        when = max(when, 1e-9)  # an all-zero it_value would disarm the timer
        sec = int(when)
        value = self._spec.it_value
        value.tv_sec = sec
        value.tv_nsec = int((when - sec) * 1e9)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, self._spec_ref, None) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
        self._armed_at = when

    def fired(self) -> None:
        """Note that the timer went off, so the next :meth:`arm` sets it even for the
        same time (for edge-triggered epoll, where the expiry is never read)."""
        self._armed_at = None

    def clear(self) -> None:
        """Consume the expiry so the descriptor stops being readable."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)
        self._armed_at = None

    def close(self) -> None:
        os.close(self.fd)
