"""Run candidate code against unit tests in a sandbox: one fresh, confined process per sample.

    from aftraj.corpus.sandbox import Sandbox
    sb = Sandbox(timeout_s=2, memory_mb=1024)
    res = sb.run("def f(x):\\n    return x + 1", ("assert f(1) == 2",))
    res.passed, res.n_passed, res.results      # True, 1, ('pass',)
    sb.isolation                               # 'namespaces' or 'none' (see below)

The corpus builder runs it on every code variant (`aftraj corpus build`); with an `openai`
policy the code was written by an LLM, so it is treated as hostile.

How a sample runs. A runner process (`sandbox_runner.py`, `python -I -S` with an empty
environment) never runs candidate code; for each sample it forks a child, a copy of its pristine
interpreter, so nothing of an earlier sample (patched builtins, globals, hidden tests) survives.
The child confines itself, then runs the code and its tests, each test under a timer. It reports
on a pipe one line that starts with a random per-sample nonce; the parent accepts only that line,
so output a sample writes itself (a forged result line, then `os._exit(0)`) counts as a crash.
Results are cached by (code hash, tests hash); each worker thread owns one runner. Cost: a fork,
not an interpreter start-up, per sample (`python benchmarks/sandbox.py`).

Threat model. Contained, in both modes:
- processes and raw calls: an audit hook that judges real types (a `str` subclass as a module
  name is refused, never `str()`-ed) refuses subprocesses, fork/exec/spawn, threads, ctypes,
  `_posixsubprocess`, `os.kill`, sockets, setrlimit, gc walks, frame access (so the nonce and
  the runner's state stay out of reach) and replacing a function's code; `RLIMIT_NPROC` 0 stops a
  fork the hook missed (where the kernel enforces it: not for the host's real root in mode none);
- resources: `RLIMIT_AS` (memory_mb), `RLIMIT_CPU` (hard: ignoring SIGALRM does not help),
  `RLIMIT_FSIZE` (file_mb: a 200 MB write fails with EFBIG), `RLIMIT_NOFILE`, no core dumps, and
  a wall-clock deadline kept by the runner (timeout × (1 + tests) + 1 s), which kills the
  process group whatever the sample does with its signals;
- environment: an empty environment, descriptors other than the result pipe closed, stdin empty,
  a temporary working folder removed afterwards.
Contained with isolation 'namespaces' (Linux user namespaces; the default where the kernel
allows them, checked once per runner by a forked copy that confines itself and runs a trivial
sample). The runner enters new user, network, mount, ipc and uts namespaces once; each sample
adds its own mount and pid namespaces:
- files: the root is a read-only tmpfs with read-only binds of /usr, /lib* and the stdlib's
  folders, and a fresh size-capped tmpfs /work and /tmp per sample; nothing else: no /proc (so
  no /proc/<ppid>/environ), no /etc/passwd, no home folders, no repository. The sample holds no
  capability (as the host's root, it also runs as the host's nobody), so it cannot mount,
  remount read-write, chroot or regain one;
- network: a network namespace with no interface up (shared by the samples of one runner, one
  after another; a sample can open no socket); signals: a pid namespace per sample, where it is
  pid 1 and sees no outside process (`pidfd_send_signal` to its parent has no target).
Isolation 'none' (the fallback where user namespaces are refused: some containers, kernels with
`kernel.unprivileged_userns_clone=0`, AppArmor's userns restriction; forced with
`Sandbox(isolation="none")`): the audit hook also confines file access to the working folder
(read/write) and the stdlib (read), after resolving symlinks with functions the sample cannot
rebind, and refuses `dir_fd` forms. NOT contained there: calls the hook never sees, above all
`signal.pidfd_send_signal` on an `os.pidfd_open` of a same-user process (it can kill its runner,
which is restarted and the sample counted as crashed, or the builder itself); `os.stat`-style
probes of paths outside (existence and metadata, not content).
Never contained, in either mode: a memory-safety bug in CPython or an extension (the hook and
the nonce live in the same address space as the sample), a kernel bug, and a sample gaming its
own assertions (an object whose `__eq__` returns True passes `assert f(x) == y`): a pass proves
the tests ran, not that the code is honest. For code from a model you do not trust, or on a
machine where this module reports isolation 'none', run the corpus build inside a container or
VM without network and without credentials (e.g. `docker run --network none --read-only ...`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ISOLATIONS = ("auto", "namespaces", "none")
_RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text()


@dataclass(frozen=True)
class TestRun:
    """The outcome of running one code sample against its tests."""

    key: str
    results: tuple[str, ...]      # per test: 'pass' | 'fail: …' | 'error: …' | 'timeout' | 'crashed: …'

    @property
    def n_passed(self) -> int:
        return sum(r == "pass" for r in self.results)

    @property
    def passed(self) -> bool:
        return bool(self.results) and self.n_passed == len(self.results)

    def summary(self, names: Sequence[str] | None = None) -> str:
        lines = [f"passed {self.n_passed}/{len(self.results)} tests"]
        for i, r in enumerate(self.results):
            if r != "pass":
                lines.append(f"FAIL {names[i] if names else f'test_{i}'}: {r}")
        return "\n".join(lines)


def sample_key(code: str, tests: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(code.encode()).digest())
    h.update(hashlib.sha256(json.dumps(list(tests)).encode()).digest())
    return h.hexdigest()[:24]


class SandboxError(RuntimeError):
    """The sandbox itself failed (its runner could not start, or namespaces were required and
    this machine refuses them); never raised for anything a sample does."""


class _Runner:
    """One runner process (sandbox_runner.py) and its framed pipe; used by one thread at a time."""

    def __init__(self, python: str, isolation: str):
        self.base = tempfile.mkdtemp(prefix="aftraj-sandbox-")
        self.proc = subprocess.Popen([python, "-I", "-S", "-B", "-c", _RUNNER_SOURCE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={}, cwd=self.base,
                                     start_new_session=True)
        self._send({"isolation": isolation, "base": self.base})
        hello = self._recv(30.0)
        if hello is None:
            self.close()
            raise SandboxError("the sandbox runner did not start (is the Python at "
                               f"{python!r} a CPython >= 3.8 on Linux?)")
        self.isolation, self.why, self.nproc = hello["isolation"], hello.get("why", ""), bool(hello.get("nproc"))

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()

    def _read_exact(self, n: int, deadline: float) -> bytes | None:
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def _recv(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        head = self._read_exact(4, deadline)
        body = head and self._read_exact(struct.unpack(">I", head)[0], deadline)
        return json.loads(body) if body else None

    def run(self, req: dict) -> dict | None:
        """One sample; None when the runner died or hung (it is then unusable)."""
        try:
            self._send(req)
        except (BrokenPipeError, OSError):
            return None
        return self._recv(req["wall_s"] + 10.0)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


def _close_all(runners: list[_Runner]) -> None:
    for r in runners:
        r.close()
    runners.clear()


def _verdict(tests: Sequence[str], nonce: str, reply: dict | None) -> tuple[str, ...]:
    """Per-test results from the one line that carries the nonce; anything else is a crash."""
    n = max(1, len(tests))
    if reply is None:
        return ("crashed: the sandbox runner died or hung",) * n
    out = reply["output"].encode("latin-1")
    tag = nonce.encode() + b":"
    i = out.find(tag)
    j = out.find(b"\n", i) if i >= 0 else -1
    if i >= 0 and j >= 0:
        body = out[i + len(tag):j]
        try:
            res = tuple(bytes.fromhex(h.decode()).decode("utf-8", "replace") for h in body.split(b",")) if body else ()
        except ValueError:
            res = None
        if res is not None and len(res) == len(tests):
            return res
    if reply["timed_out"]:
        why = "ran past its wall-clock limit"
    else:
        st = reply["status"]
        why = (f"was killed by signal {os.WTERMSIG(st)} (time, CPU or memory limit)" if os.WIFSIGNALED(st)
               else f"exited ({os.WEXITSTATUS(st)}) without a result")
    return (f"crashed: the test process {why}",) * n


class Sandbox:
    """Runs (code, tests) samples, each in its own confined process (see the module docstring).

    timeout_s: per test (and for loading the code); memory_mb: address space; file_mb: the
    largest file a sample may write; workers: samples run at once; isolation: 'auto' (namespaces
    where the kernel allows them, else 'none'), 'namespaces' (SandboxError if refused) or 'none'.
    """

    def __init__(self, *, timeout_s: float = 2.0, memory_mb: int = 1024,
                 workers: int = 2, python: str | None = None, file_mb: int = 16, isolation: str = "auto"):
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.timeout_s, self.memory_mb, self.file_mb = float(timeout_s), int(memory_mb), int(file_mb)
        self.workers = max(1, int(workers))
        self.python = python or sys.executable
        self.requested = isolation
        self.cache: dict[str, TestRun] = {}
        self.n_subprocesses = 0          # sample processes started (one per sample not in the cache)
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Runner] = queue.SimpleQueue()
        self._runners: list[_Runner] = []
        self._isolation: str | None = None
        self._nproc = False
        self._finalizer = weakref.finalize(self, _close_all, self._runners)

    # ------------------------------------------------------------------ runners
    def _new_runner(self) -> _Runner:
        r = _Runner(self.python, self.requested)
        if self.requested == "namespaces" and r.isolation != "namespaces":
            r.close()
            raise SandboxError(f"sandbox: isolation 'namespaces' was asked for and this machine refuses it: {r.why}")
        with self._lock:
            self._runners.append(r)
            self._isolation, self._nproc = r.isolation, r.nproc
        return r

    def _take(self) -> _Runner:
        while True:
            try:
                r = self._idle.get_nowait()
            except queue.Empty:
                return self._new_runner()
            if r.proc.poll() is None:
                return r
            self._drop(r)        # ended while idle (killed from outside): never hand it out

    def _drop(self, r: _Runner) -> None:
        with self._lock:
            if r in self._runners:
                self._runners.remove(r)
        r.close()

    @property
    def isolation(self) -> str:
        """'namespaces' or 'none': what this machine gives (starts a runner to find out)."""
        if self._isolation is None:
            self._idle.put(self._take())
        return self._isolation

    @property
    def limits_processes(self) -> bool:
        """Whether RLIMIT_NPROC binds the sample (False only for the host's root in mode 'none'
        when nobody cannot read the stdlib: then threads, which have no audit event before
        Python 3.13, are not stopped)."""
        if self._isolation is None:
            self._idle.put(self._take())
        return self._nproc

    def close(self) -> None:
        """Stop the runner processes (also done when the Sandbox is garbage-collected or at exit)."""
        with self._lock:
            _close_all(self._runners)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ one sample
    def _run_one(self, code: str, tests: tuple[str, ...]) -> tuple[str, ...]:
        budget = self.timeout_s * (1 + len(tests))
        nonce = secrets.token_hex(16)
        req = {"code": code, "tests": list(tests), "timeout": self.timeout_s, "nonce": nonce,
               "memory_mb": self.memory_mb, "file_mb": self.file_mb, "cpu_s": math.ceil(budget) + 1,
               "wall_s": budget + 1.0}
        runner = self._take()
        with self._lock:
            self.n_subprocesses += 1
        reply = runner.run(req)
        if reply is None:        # the runner died (a sample killed it) or hung: never reuse it
            self._drop(runner)
        else:
            self._idle.put(runner)
        return _verdict(tests, nonce, reply)

    # ------------------------------------------------------------------ public API
    def run_many(self, items: Iterable[tuple[str, Sequence[str]]]) -> list[TestRun]:
        """Run (code, tests) pairs, `workers` at a time; cached by content hash."""
        items = [(c, tuple(t)) for c, t in items]
        keys = [sample_key(c, t) for c, t in items]
        todo: dict[str, tuple[str, tuple[str, ...]]] = {}
        for k, item in zip(keys, items):
            if k not in self.cache and k not in todo:
                todo[k] = item
        if todo:
            if len(todo) == 1 or self.workers == 1:
                results = [self._run_one(c, t) for c, t in todo.values()]
            else:
                with ThreadPoolExecutor(self.workers) as ex:
                    results = list(ex.map(lambda ct: self._run_one(*ct), todo.values()))
            for k, r in zip(todo, results):
                self.cache[k] = TestRun(k, r)
        return [self.cache[k] for k in keys]

    def run(self, code: str, tests: Sequence[str]) -> TestRun:
        return self.run_many([(code, tests)])[0]

    def seed(self, code: str, tests: Sequence[str], results: Sequence[str]) -> TestRun:
        """Record results obtained otherwise (a prefix of a longer suite of the same code, run in
        one fresh process: `aftraj.corpus.build.precompute_tests`) as if (code, tests) had run."""
        tests = tuple(tests)
        if len(results) != len(tests):
            raise ValueError(f"{len(results)} results for {len(tests)} tests")
        key = sample_key(code, tests)
        self.cache[key] = TestRun(key, tuple(results))
        return self.cache[key]
