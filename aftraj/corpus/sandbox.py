"""Run candidate code against unit tests in a sandbox: one fresh, confined process per sample.

    from aftraj.corpus.sandbox import Sandbox
    sb = Sandbox(timeout_s=2, memory_mb=1024)
    res = sb.run("def f(x):\\n    return x + 1", ("assert f(1) == 2",))
    res.passed, res.n_passed, res.results      # True, 1, ('pass',)
    sb.isolation                               # 'namespaces' or 'none' (see below)

The corpus builder runs it on every code variant (`aftraj corpus build`); with an `openai`
policy the code was written by an LLM, so it is treated as hostile.

How a sample runs. Each worker thread owns a runner (`sandbox_runner.py`, `python -I -S` with
an empty environment), which confines itself once (see 'namespaces' below) and starts a zygote
(`sandbox_zygote.py`): a fresh interpreter without any capability that imports the common stdlib
modules once and never imports ctypes. For each sample the zygote forks a child, a copy of its
pristine interpreter, so nothing of an earlier sample (patched builtins, globals, files, hidden
tests) survives, and nothing of the runner is in it. The child's only descriptor is a socket to
the runner (fds 1 and 2). It installs its audit hook, reads the code, loads it, freezes (its
timers cancelled, signals blocked, garbage collection paused) and says so with a random
per-sample nonce; only then does the runner send the tests. Each test runs under a timer; the
child reports one line that starts with the nonce; the parent accepts only that line, so output a
sample writes itself (a forged result line, then `os._exit(0)`) counts as a crash. Results are
cached by (code hash, tests hash). Cost: a fork per sample, two interpreter start-ups per runner
(`python benchmarks/sandbox_cost.py` measures it beside the earlier designs).

Threat model: what each mode promises, and the tests that show it (tests/aftraj/corpus/
test_sandbox_threats.py and test_corpus_sandbox.py).
Both modes:
- no raw-memory primitive: no ctypes class exists in the sample's process (the zygote never
  imported ctypes; the runner, which needs it, is never copied into a sample), importing ctypes,
  _ctypes, _posixsubprocess or _test* is refused, and so is every way to make a code object of
  one's own (CodeType, code.replace, marshal.loads of anything but the stdlib's own .pyc files,
  a .pyc the sample wrote), which could index past its constants (`test_no_ctypes_class_is_reachable_through_the_type_graph`,
  `test_a_union_read_of_any_address_fails`, `test_a_crafted_code_object_is_refused`);
- the hidden tests are not in the sample's process before it is loaded and frozen: not in its
  memory, not on a descriptor, not through an audit hook of its own (a second hook is never
  added), a timer, a finalizer, a gc walk or a frame; they never pass through the zygote
  (`test_code_that_parses_the_hidden_tests_learns_nothing`, `test_a_second_audit_hook_is_never_added`,
  `test_patched_builtins_and_hidden_tests_do_not_reach_another_sample`);
- processes and raw calls: the audit hook judges real types (a `str` subclass as a module name
  is refused, never `str()`-ed) and refuses subprocesses, fork/exec/spawn, threads, `os.kill`,
  sockets, setrlimit, gc walks, frame access (so the nonce and the harness's state stay out of
  reach) and replacing a function's code; RLIMIT_NPROC 0 stops a fork or thread the hook misses
  (a sample is never the host's root, whom it does not bind) (`test_attack_is_contained`,
  `test_sandbox_escapes_are_refused`);
- resources: RLIMIT_AS (memory_mb), RLIMIT_CPU (hard: ignoring SIGALRM does not help),
  RLIMIT_FSIZE (file_mb: a 200 MB write fails with EFBIG), RLIMIT_NOFILE, no core dumps, and a
  wall-clock deadline (timeout x (1 + tests) + 1 s) kept by the zygote, which kills the sample
  whatever it does with its signals, with a second one over the zygote kept by the runner
  (`test_ignoring_sigalrm_is_bounded_in_wall_time`, `test_a_200_mb_file_is_refused`);
- environment: an empty environment, no descriptor but the socket, a working folder of its own,
  removed afterwards (`test_the_environment_is_empty_and_descriptors_closed`,
  `test_files_of_one_sample_are_gone_for_the_next`).
Isolation 'namespaces' (Linux user namespaces; the default where the kernel allows them) adds:
the runner enters new user, network, mount, ipc and uts namespaces once, and the zygote's
children share one new pid namespace:
- files: the root is a read-only tmpfs with read-only binds of /usr, /lib*, the interpreter and
  the stdlib's folders, and size-capped tmpfs /work and /tmp mounted fresh for every sample;
  nothing else: no /proc (so no /proc/<ppid>/environ), no /etc/passwd, no home folders, no
  repository. The sample holds no capability and cannot regain one (an empty bounding set,
  no_new_privs; as the host's root it runs as the host's nobody), so it cannot mount, remount
  read-write or chroot;
- network: a network namespace with no interface up; signals: the sample's pid namespace holds
  only an init that waits (the kernel drops the signals a sample sends it) and the sample, whose
  parent is outside (getppid() is 0), so it can signal no other process
  (`test_signalling_the_parent_is_contained`, `test_the_namespace_init_ignores_the_sample`).
Isolation 'none' (the fallback where user namespaces are refused: some containers, kernels with
`kernel.unprivileged_userns_clone=0`, AppArmor's userns restriction; forced with
`Sandbox(isolation="none")`) promises less. The audit hook confines file access to the working
folder (read/write) and the stdlib (read), after resolving symlinks with functions the sample
cannot rebind, and refuses `dir_fd` forms. That is a check before the open, so nothing of the
sample may run in between: no symlink can be made, no thread can start (RLIMIT_NPROC), and no
file is opened while the garbage collector is on (it is off for the sample) or while the sample
has a Python signal handler installed (`test_the_symlink_swap_race_reads_nothing_outside`,
`test_write_outside_the_working_folder_is_contained`). A sample never runs as the host's root: as
root, the zygote runs each sample as NONE_MODE_UID (nobody), or, where it cannot become nobody,
the Sandbox refuses to run samples at all (SandboxError), so even a sample that beat the check
would read only what every user may read; the zygote imports the common stdlib modules first,
since where nobody cannot read the stdlib (a Python under /root) a module it did not preload
cannot be imported (`test_mode_none_as_root_runs_the_sample_as_nobody`,
`test_mode_none_as_root_is_refused_when_the_sample_cannot_leave_root`). NOT contained in mode
none: signals to processes of the sample's own uid (`signal.pidfd_send_signal` on
`os.pidfd_open` has no audit event): for a non-root builder that is the builder itself, its
runner and zygote (a killed zygote is a crash, and is restarted); for root, other processes of
nobody; `os.stat`-style probes of paths outside (existence and metadata, not content); another
process of the same uid changing files or symlinks on the paths the sample reads.
Never contained, in either mode: a memory-safety bug in CPython or an extension (the hook and
the nonce live in the same address space as the sample), a kernel bug; and, while a test runs,
the sample's code runs beside it, so it can game its own assertions (an object whose `__eq__`
returns True passes `assert f(x) == y`) or read side channels of the running test (the reference
counts of the small ints and interned strings its compiled code holds): a pass proves the tests
ran, not that the code is honest. For code from a model you do not trust, or on a machine where
this module reports isolation 'none', run the corpus build inside a container or VM without
network and without credentials (e.g. `docker run --network none --read-only ...`).
"""

from __future__ import annotations

import atexit
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

from aftraj.errors import UsageError

ISOLATIONS = ("auto", "namespaces", "none")
NONE_MODE_UID = 65534    # the uid (nobody) a sample runs as in mode none when the builder is the host's root
_RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text()
_ZYGOTE_SOURCE = (Path(__file__).with_name("sandbox_zygote.py")).read_text()
# python -> why: 'auto' found the namespaces set-up broken with this interpreter (after the kernel
# allowed the unshare), so later runners go straight to mode none instead of failing again
_NAMESPACES_BROKEN: dict[str, str] = {}


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


class SandboxError(UsageError, RuntimeError):
    """The sandbox itself failed (its runner could not start, namespaces were required and this
    machine refuses them, or mode none as the host's root cannot run a sample unprivileged);
    never raised for anything a sample does. A UsageError: the CLI reports it without a trace."""


class _Runner:
    """One runner process (sandbox_runner.py) and its framed pipe; used by one thread at a time."""

    def __init__(self, python: str, isolation: str):
        self.base = tempfile.mkdtemp(prefix="aftraj-sandbox-")
        self.proc = subprocess.Popen([python, "-I", "-S", "-B", "-c", _RUNNER_SOURCE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={}, cwd=self.base,
                                     start_new_session=True)
        self._send({"isolation": isolation, "base": self.base, "zygote": _ZYGOTE_SOURCE, "uid": NONE_MODE_UID})
        hello = self._recv(120.0)      # the runner and its zygote start, on a loaded machine
        if hello is None:
            self.close()
            raise SandboxError("the sandbox runner did not start (is the Python at "
                               f"{python!r} a CPython >= 3.9 on Linux?)")
        self.isolation, self.why, self.nproc = hello["isolation"], hello.get("why", ""), bool(hello.get("nproc"))
        self.uid, self.error = hello.get("uid"), hello.get("error")
        if self.error:
            self.close()

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


# Warm runners handed back by Sandboxes that are closed or collected, for the next Sandbox of the
# same (python, isolation asked for, NONE_MODE_UID): a runner starts two interpreters (itself and
# its zygote), and a test suite or a CLI run makes many Sandboxes. A runner keeps nothing of a
# sample (every sample is a new process in a new folder), so it may serve another Sandbox.
POOL_MAX = 4              # idle runners kept per key; the rest are stopped
_POOL: dict[tuple, list[_Runner]] = {}
_POOL_LOCK = threading.Lock()


def _pool_take(key: tuple) -> _Runner | None:
    while True:
        with _POOL_LOCK:
            lst = _POOL.get(key)
            if not lst:
                return None
            r = lst.pop()
        if r.proc.poll() is None:
            return r
        r.close()                # ended while pooled (killed from outside)


def _release(key: tuple, runners: list[_Runner], idle: queue.SimpleQueue) -> None:
    """A Sandbox is done: its idle runners go to the pool, any other is stopped."""
    free = []
    while True:
        try:
            free.append(idle.get_nowait())
        except queue.Empty:
            break
    for r in runners:
        pooled = False
        if any(r is f for f in free) and r.proc.poll() is None:
            with _POOL_LOCK:
                lst = _POOL.setdefault(key, [])
                if len(lst) < POOL_MAX:
                    lst.append(r)
                    pooled = True
        if not pooled:
            r.close()
    runners.clear()


def _close_pool() -> None:
    with _POOL_LOCK:
        runners = [r for lst in _POOL.values() for r in lst]
        _POOL.clear()
    _close_all(runners)


def _forget_pool_in_child() -> None:
    """A forked child must not take, or stop at its exit, its parent's runners."""
    global _POOL_LOCK
    _POOL.clear()
    _POOL_LOCK = threading.Lock()


atexit.register(_close_pool)
os.register_at_fork(after_in_child=_forget_pool_in_child)


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
        self._uid: int | None = None
        self._key = (os.getpid(), self.python, self.requested, NONE_MODE_UID)
        self._finalizer = weakref.finalize(self, _release, self._key, self._runners, self._idle)

    # ------------------------------------------------------------------ runners
    def _new_runner(self) -> _Runner:
        r = _pool_take(self._key)
        if r is not None:
            return self._own(r)
        wanted = self.requested
        if wanted == "auto" and self.python in _NAMESPACES_BROKEN:
            wanted = "none"
        r = _Runner(self.python, wanted)
        if r.error and wanted == "auto" and r.isolation == "namespaces":
            _NAMESPACES_BROKEN[self.python] = r.error      # the kernel allowed them, the set-up failed
            r = _Runner(self.python, "none")
            r.why = r.why if r.error else _NAMESPACES_BROKEN[self.python]
        if r.error:
            raise SandboxError(f"sandbox: {r.error}")
        if self.requested == "namespaces" and r.isolation != "namespaces":
            r.close()
            raise SandboxError(f"sandbox: isolation 'namespaces' was asked for and this machine refuses it: {r.why}")
        return self._own(r)

    def _own(self, r: _Runner) -> _Runner:
        with self._lock:
            self._runners.append(r)
            self._isolation, self._nproc, self._uid = r.isolation, r.nproc, r.uid
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
        """Whether RLIMIT_NPROC binds the sample (no thread, no fork): always, since a sample
        is never the host's root (who is exempt from it)."""
        if self._isolation is None:
            self._idle.put(self._take())
        return self._nproc

    @property
    def sample_uid(self) -> int | None:
        """The host uid samples run as in mode 'none' when the builder is the host's root
        (NONE_MODE_UID); None where a sample keeps the builder's uid (namespaces map it)."""
        if self._isolation is None:
            self._idle.put(self._take())
        return self._uid

    def close(self) -> None:
        """Hand the idle runners to the process-wide pool (the next Sandbox asking for the same
        isolation reuses them; they are stopped at exit) and stop any other; also done when the
        Sandbox is garbage-collected. The Sandbox may be used again (it starts or takes runners)."""
        with self._lock:
            _release(self._key, self._runners, self._idle)

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
        for k, item in zip(keys, items, strict=True):
            if k not in self.cache and k not in todo:
                todo[k] = item
        if todo:
            if len(todo) == 1 or self.workers == 1:
                results = [self._run_one(c, t) for c, t in todo.values()]
            else:
                with ThreadPoolExecutor(self.workers) as ex:
                    results = list(ex.map(lambda ct: self._run_one(*ct), todo.values()))
            for k, r in zip(todo, results, strict=True):
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
