"""``subprocess.Popen`` for Python processes, forked from one warm template per process.

A program that starts many short Python processes of its own (the DiLoCo
example's ``run_sites``, a benchmark's sites, a test's workers) pays ~3 CPU-s of
imports in each. :func:`popen` takes the same command and, when it is
``python -m MODULE ...`` or ``python SCRIPT.py ...``, forks it from a template
(:class:`~isthmus.deploy.launch.warm_start.RankTemplate`) started once for this
process and kept until it exits; any other command, or ``ISTHMUS_WARM_START=0``,
gets a plain ``subprocess.Popen``. The object returned answers ``pid``,
``args``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
``terminate`` and ``kill`` as ``Popen`` does.

The forked process writes to files rather than to pipes (the template, not
this process, is its parent): ``PIPE`` is a file in a private folder, read by
``communicate``; ``DEVNULL`` is /dev/null, ``STDOUT`` joins stderr to stdout.
A stream to inherit or a file of the caller's cannot be handed over as
``Popen`` hands it (the same open file), so such a command starts afresh.
A forked process runs in a session of its own: a terminal's Ctrl-C reaches the
caller only, and what is still running when the caller exits is stopped then
(the template goes with it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from isthmus.deploy.launch import warm_start
from isthmus.deploy.launch.warm_start import ForkedRank, RankTemplate, TemplateError

_lock = threading.Lock()
_template: RankTemplate | None = None
_folder: Path | None = None
_broken = False
_counter = 0
_owner = 0


class WarmProcess:
    """A forked process with ``Popen``'s interface (see the module's docstring)."""

    def __init__(
        self, forked: ForkedRank, captured: dict[str, Path | None], text: bool, args: list[str]
    ) -> None:
        self._forked = forked
        self._captured = captured
        self._text = text
        self.args = args
        self.pid = forked.pid
        self.stdout = self.stderr = self.stdin = None

    @property
    def returncode(self) -> int | None:
        return self._forked.returncode

    def poll(self) -> int | None:
        return self._forked.poll()

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._forked.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            raise ValueError("a warm process has no stdin")
        self.wait(timeout)
        return self._read("stdout"), self._read("stderr")

    def _read(self, stream: str) -> Any:
        path = self._captured.get(stream)
        if path is None:
            return None
        data = path.read_bytes()
        path.unlink(missing_ok=True)
        return data.decode(errors="replace") if self._text else data

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    text: bool = False,
) -> subprocess.Popen | WarmProcess:
    """``subprocess.Popen(command, ...)``, forked from the warm template when
    ``command`` runs this interpreter on a module or a script."""
    # Only streams a forked process can get as Popen would give them (see above).
    streams_ok = stdout in (subprocess.PIPE, subprocess.DEVNULL) and stderr in (
        subprocess.PIPE,
        subprocess.DEVNULL,
        subprocess.STDOUT,
    )
    template = _shared_template() if _warmable(command) and streams_ok else None
    if template is not None:
        try:
            return _fork(template, command, env, cwd, stdout, stderr, text)
        except TemplateError:
            global _broken
            _broken = True  # it is gone: this one, and every later one, start afresh
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text
    )  # fmt: skip


def _warmable(command: list[str]) -> bool:
    if len(command) < 2 or command[0] != sys.executable:
        return False
    if command[1] == "-m":
        return len(command) > 2
    return command[1].endswith(".py") and not command[1].startswith("-")


def _fork(
    template: RankTemplate,
    command: list[str],
    env: dict[str, str] | None,
    cwd: str | Path | None,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    text: bool,
) -> WarmProcess:
    script = command[1] != "-m"
    argv = command[1:] if script else command[2:]
    captured: dict[str, Path | None] = {}
    out_path = _target(stdout, "stdout", captured)
    err_path = out_path if stderr == subprocess.STDOUT else _target(stderr, "stderr", captured)
    forked = template.fork(
        argv,
        dict(os.environ if env is None else env),
        stdout=out_path,
        stderr=err_path,
        cwd=str(cwd) if cwd is not None else None,
        script=script,
    )
    return WarmProcess(forked, captured, text, list(command))


def _target(
    stream: int | IO[Any] | None, name: str, captured: dict[str, Path | None]
) -> str | None:
    """Where the forked process's ``name`` goes: a capture file (PIPE), else None
    (/dev/null)."""
    global _counter
    if stream != subprocess.PIPE:
        return None
    assert _folder is not None
    with _lock:
        _counter += 1
        path = _folder / f"{os.getpid()}-{_counter}.{name}"
    path.touch()
    captured[name] = path
    return str(path)


def _shared_template() -> RankTemplate | None:
    """This process's template, started on first use (None: disabled or broken)."""
    global _template, _folder, _broken, _owner
    if not warm_start.enabled() or _broken:
        return None
    with _lock:
        if _template is None:
            _folder = Path(tempfile.mkdtemp(prefix="isthmus-warm-"))
            try:
                _template = RankTemplate(_folder, _folder / "template.log")
                _template.wait_ready()
            except (OSError, TemplateError):
                _broken = True
                return None
            _owner = os.getpid()
            atexit.register(_close)
        return _template


def _close() -> None:
    global _template
    if os.getpid() != _owner:  # a fork of the caller: the template is not its own
        return
    if _template is not None:
        _template.close()
        _template = None
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)
