"""Ranks of the built-in training loop forked from a warm template.

A rank's interpreter spends ~3 CPU-seconds importing torch, DTensor and
torch._dynamo (which the optimizer pulls in) before it does anything of its
own: on a small machine running several emulated sites that is most of a short
run's CPU, and every restart of a lost site pays it again. So ``isthmus run``
starts one template process that does those imports once, and forks each rank
of the built-in loop from it (``benchmarks/rank_startup.py`` measures the two).

Forking is safe only from a process with one thread: the template starts no
thread (its loop is a ``select`` on its request pipe and a SIGCHLD wake-up
pipe), never touches CUDA, and checks ``/proc/self/task`` before each fork.
A forked rank is what ``python -m isthmus.training.worker`` would be: its
own session, its log as stdout and stderr, the rank's environment, its own
seed for ``random``, torch's thread count from ``OMP_NUM_THREADS`` (libgomp
read the template's at import), ``atexit`` handlers run at its end.

The launcher's side (:class:`RankTemplate`) hands out :class:`ForkedRank`
objects that answer ``poll``/``wait``/``pid`` like ``subprocess.Popen``. The
ranks' parent is the template, so they end with it
(:mod:`isthmus.training.orphan`), and it ends with the launcher. A template
that cannot start, or ``ISTHMUS_WARM_START=0``, means plain processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from isthmus.training.orphan import PARENT_ENV, parent_environment

log = logging.getLogger(__name__)

ENABLE_ENV = "ISTHMUS_WARM_START"
"""``0`` starts every rank as a fresh interpreter (the template is skipped)."""
START_TIMEOUT_S = 120.0
"""How long the template may take to import torch and say it is ready."""
WORKER_MODULE = "isthmus.training.worker"
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    WORKER_MODULE,
)


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


@contextlib.contextmanager
def template_for_runs(folder: Path) -> Iterator[RankTemplate | None]:
    """One template for several runs in a row (``--compare``'s strategies, the
    tuner's trials): each run forks its ranks from it instead of starting its own,
    which costs ~4 CPU-seconds of imports and a few seconds of a trial's wall time.
    Runs share nothing else through it: every fork gets its rank's whole
    environment and working directory. None when warm start is off."""
    if not enabled():
        yield None
        return
    folder.mkdir(parents=True, exist_ok=True)
    template = RankTemplate(folder, folder / "template.log")
    try:
        yield template
    finally:
        template.close()


# -- the launcher's side -------------------------------------------------------------
class ForkedRank:
    """A rank forked by the template, as the launcher sees it: ``pid``, ``poll()``,
    ``wait(timeout)`` and ``returncode`` as in ``subprocess.Popen`` (a signal's end
    is its negative number)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class TemplateError(RuntimeError):
    pass


class RankTemplate:
    """The template process and the pipe to it. ``spawn`` forks one rank."""

    def __init__(self, run_dir: Path, log_path: Path) -> None:
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            # The run directory on the command line names the run in `ps`, for the
            # template and for each rank forked from it (a fork keeps the command line).
            [sys.executable, "-m", __name__, str(run_dir.resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
            # One OpenMP thread: libgomp would otherwise start its pool at torch's
            # import, and a process with threads must not fork. Each rank sets its
            # own count (_run_worker).
            env={
                **os.environ,
                **parent_environment(),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
            },
        )
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._replied = threading.Condition(self._lock)
        self._ranks: dict[int, ForkedRank] = {}
        self._early_ends: dict[int, int] = {}
        self._next_id = 0
        self._ready = threading.Event()
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="isthmus-template", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        if not self._ready.wait(timeout) or self._gone:
            raise TemplateError(
                f"the rank template did not start in {timeout:.0f} s "
                f"(exit status {self.proc.poll()}; log: {self._log.name})"
            )

    def spawn(
        self, args: list[str], env: dict[str, str], log_path: Path, module: str = WORKER_MODULE
    ) -> ForkedRank:
        """Fork one rank running ``python -m MODULE args...`` (the built-in loop's),
        its output and errors to ``log_path``."""
        return self.fork([module, *args], env, stdout=str(log_path), stderr=str(log_path))

    def fork(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        stdout: str | None,
        stderr: str | None,
        cwd: str | None = None,
        script: bool = False,
    ) -> ForkedRank:
        """Fork a process that is ``python -m ARGV[0] ARGV[1:]`` (``script``: ``python
        ARGV[0] ...``), writing to the files ``stdout`` and ``stderr`` (appending;
        None: /dev/null), in ``cwd`` (default: this process's)."""
        self.wait_ready()
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
        request = {
            "id": request_id,
            "argv": argv,
            "script": script,
            "env": env,
            "stdout": stdout,
            "stderr": stderr,
            "cwd": cwd or os.getcwd(),
        }
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise TemplateError(f"the rank template is gone: {exc}") from None
        with self._lock:
            deadline = time.monotonic() + 30.0
            while request_id not in self._replies:
                if self._gone or time.monotonic() > deadline:
                    raise TemplateError(f"the rank template did not fork (log: {self._log.name})")
                self._replied.wait(0.5)
            reply = self._replies.pop(request_id)
            if "error" in reply:
                raise TemplateError(reply["error"])
            rank = ForkedRank(reply["pid"], ["python", *([] if script else ["-m"]), *argv])
            self._ranks[rank.pid] = rank
            if rank.pid in self._early_ends:  # it ended before the reply was read
                rank._end(self._early_ends.pop(rank.pid))
            return rank

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue  # something a preloaded module printed, not the protocol
                self._take(message)
        finally:
            # The template is gone: whatever it had forked can no longer be told
            # about, and a wait for it to be ready ends now.
            self.proc.wait()
            with self._lock:
                self._gone = True
                for rank in self._ranks.values():
                    if rank.returncode is None:
                        rank._end(_live_or_lost(rank.pid))
                self._ranks.clear()
                self._replied.notify_all()
            self._ready.set()

    def _take(self, message: dict[str, Any]) -> None:
        with self._lock:
            if "ready" in message:
                self._ready.set()
            elif "ended" in message:
                pid, code = message["ended"], message["code"]
                rank = self._ranks.pop(pid, None)
                if rank is None:
                    self._early_ends[pid] = code
                else:
                    rank._end(code)
            elif "id" in message:
                self._replies[message["id"]] = message
                self._replied.notify_all()

    def close(self) -> None:
        """The template exits once the ranks it forked have (the launcher has
        stopped them by now)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5.0)
        self._log.close()


def _live_or_lost(pid: int) -> int:
    """The end of a rank whose template died: nothing can report it any more, so it
    is killed if it still runs, and counted as killed either way."""
    signal_rank(pid, signal.SIGKILL)
    return -signal.SIGKILL


# -- the template's side -------------------------------------------------------------
_HELD = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
ORPHAN_GRACE_S = 30.0
"""After the launcher is gone, how long the ranks get to stop on SIGTERM."""


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serve() -> int:
    for module in _PRELOAD:
        __import__(module)
    # The built-in data's corpus: read once here, every rank's from these pages.
    from isthmus.intra.data import stdlib_corpus

    stdlib_corpus()
    launcher = int(os.environ.pop(PARENT_ENV, "0") or 0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wake the select; reaped below
    signal.signal(signal.SIGTERM, lambda *_: None)  # ended by closing stdin, not signals
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The pipes to the launcher on descriptors of their own; 0 and 1 become
    # /dev/null and the template's log, so that a forked rank's 0, 1 and 2 are free
    # to be its own.
    requests = os.dup(0)
    out = os.fdopen(os.dup(1), "wb")
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    os.dup2(2, 1)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    private = [requests, out.fileno(), wake_r, wake_w, selector.fileno()]

    def say(message: dict[str, Any]) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):  # the launcher is gone
            out.write((json.dumps(message) + "\n").encode())
            out.flush()

    say({"ready": os.getpid()})
    pending = b""  # read straight from the pipe: a buffered reader could hold a
    open_requests = True  # whole request that select would then never report
    orphaned: float | None = None
    while open_requests or children:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj == requests:
                data = os.read(requests, 65536)
                if not data:
                    open_requests = False
                    selector.unregister(requests)
                    continue
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if orphaned is None:  # nobody would be told of it any more
                        _serve_one(line, children, private, say)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
        for pid, code in _reap():
            children.discard(pid)
            say({"ended": pid, "code": code})
        if launcher and orphaned is None and os.getppid() != launcher:
            # The launcher was killed: its ranks would train on, orphaned. They watch
            # this process, so it stops them first and goes once they have gone.
            orphaned, open_requests = time.monotonic(), False
            _signal_all(children, signal.SIGTERM)
        if orphaned is not None and time.monotonic() > orphaned + ORPHAN_GRACE_S:
            _signal_all(children, signal.SIGKILL)
    return 0


def _serve_one(line: bytes, children: set[int], private: list[int], say: Any) -> None:
    """Fork for one request; a request that cannot be served (bad JSON, threads,
    a fork refused by the kernel) is answered with its error, and the template and
    the ranks it runs go on."""
    try:
        request = json.loads(line)
        request_id = request["id"]
    except (ValueError, KeyError, TypeError) as exc:
        print(f"isthmus warm start: ignoring a bad request: {exc}", file=sys.stderr)
        return
    if _threads() > 1:
        say({"id": request_id, "error": "the rank template runs threads"})
        return
    # Signals wait until the child has its own handlers: one sent right after the
    # fork (a Ctrl-C, a stop) must not hit the template's.
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        pid = os.fork()
        if pid == 0:
            _run_rank(request, private)  # never returns
    except OSError as exc:  # EAGAIN, ENOMEM: this one fails, not the run
        say({"id": request_id, "error": f"fork failed: {exc}"})
        return
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
    children.add(pid)
    say({"id": request_id, "pid": pid})


def _signal_all(children: set[int], sig: int) -> None:
    for pid in children:
        signal_rank(pid, sig)


def signal_rank(pid: int, sig: int) -> None:
    """Signal a forked rank's process group, or the rank alone if it is not yet
    past its ``setsid()`` (then the signal is held until it has its handlers, and
    delivered). With the group alone, a launcher killed right after a fork left
    that rank running until the 30 s grace's SIGKILL."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap() -> list[tuple[int, int]]:
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _run_rank(request: dict[str, Any], private: list[int]) -> None:
    """In the forked child: become what ``python -m WORKER args`` would be, run it,
    and exit with its status. Never returns into the template's loop."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # held since before the fork
        for fd in private:
            with contextlib.suppress(OSError):
                os.close(fd)
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        os.close(nothing)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        env = dict(request["env"])
        if PARENT_ENV in env:  # this process's parent is the template, not the launcher
            env[PARENT_ENV] = str(os.getppid())
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        code = _run_worker(request["argv"], env, script=request["script"])
    except BaseException:  # a rank's end must reach the launcher as a status
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        if code < 0:  # ended by a signal, as a fresh interpreter would be
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _run_worker(argv: list[str], env: dict[str, str], *, script: bool) -> int:
    import atexit
    import random
    import runpy

    import torch

    random.seed()  # the template's state is every fork's: each rank draws its own
    if "numpy.random" in sys.modules:  # imported by torch._dynamo: the same, for numpy's
        sys.modules["numpy.random"].seed()
    # The template imported torch with one OpenMP thread; a fresh interpreter would
    # take OMP_NUM_THREADS, else one thread per CPU.
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _cpus())
    sys.argv = list(argv)
    # sys.path[0] as a fresh start would set it: the script's folder, or for -m the
    # working directory.
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0])) if script else os.getcwd()
    # Imported by the template as a module; run afresh as __main__, as `python -m`
    # would (runpy warns when the module is already in sys.modules).
    if not script and not hasattr(sys.modules.get(argv[0]), "__path__"):
        sys.modules.pop(argv[0], None)  # a package's __init__ must not run twice
    code: int = 0
    try:
        if script:
            runpy.run_path(argv[0], run_name="__main__")
        else:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT  # as a fresh interpreter: it ends by the signal
    except BaseException:  # as the interpreter would: traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    # What the interpreter does at its end: wait for non-daemon threads, then run
    # the atexit handlers (the site's final records and files are written there).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


if __name__ == "__main__":
    # The argument (the run directory) is for `ps` only. The template owns nothing
    # to clean up, and tearing down an interpreter that holds torch costs a second
    # of CPU that the launcher's end would wait for: it ends without the teardown.
    status = serve()
    sys.stderr.flush()
    os._exit(status)
