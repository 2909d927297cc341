"""Run candidate code against unit tests in a subprocess sandbox: time limit, memory limit
(RLIMIT_AS), no network (an audit hook in the child refuses sockets, subprocesses, ctypes and
the raw _posixsubprocess/_ctypes modules; a sample cannot rebind or reach the hook).

Many samples run in one child (each with its own per-sample timer); a child that dies or
overruns is retried sample by sample, so one bad sample fails only itself. Results are cached
by (code hash, tests hash).

    from aftraj.corpus.sandbox import Sandbox
    sb = Sandbox(timeout_s=2, memory_mb=1024)
    res = sb.run("def f(x):\\n    return x + 1", ("assert f(1) == 2",))
    res.passed, res.n_passed, res.results      # True, 1, ('pass',)
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# The child: reads a JSON list of samples on stdin, writes one JSON line per sample on the fd named in argv[1].
_HARNESS = r'''
import sys, os, json, io, signal, traceback
_out = os.fdopen(int(sys.argv[1]), "w")
def _install_hook():
    # Everything the hook needs is bound here (defaults), not looked up in globals a sample can
    # rebind (`import __main__; __main__._BLOCKED = ()` used to switch it off). gc walks are
    # refused so a sample cannot find the hook function; imports of _posixsubprocess (fork_exec
    # spawns a process without any audit event) and _ctypes (raw foreign calls) are refused.
    def hook(event, args, _blocked=frozenset((
            "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
            "os.spawn", "os.fork", "os.forkpty", "ctypes.dlopen", "ctypes.cdata",
            "ctypes.call_function", "os.kill", "os.killpg", "pty.spawn", "resource.setrlimit",
            "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents")),
            _modules=frozenset(("_posixsubprocess", "_ctypes")), _deny=PermissionError, _str=str):
        # an extension module's init function is named after the last part of its name, so
        # loading the .so under a package prefix (pkg._posixsubprocess) is refused too
        if event in _blocked or (event == "import" and args and _str(args[0]).rpartition(".")[2] in _modules):
            what = "import " + _str(args[0]) if event == "import" else _str(event)
            raise _deny("sandbox: " + what + " is not allowed")
    return hook
samples = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
sys.addaudithook(_install_hook())
del _install_hook
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
def _short(e):
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= 300 else s[:300] + "..."
for sample in samples:
    res = []
    real_stdout, real_stderr = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    ns = {"__name__": "__sandbox__"}
    try:
        signal.setitimer(signal.ITIMER_REAL, sample["timeout"])
        try:
            exec(compile(sample["code"], "<candidate>", "exec"), ns)
            load_err = None
        except _Timeout:
            load_err = "timeout"
        except BaseException as e:
            load_err = "error: " + _short(e)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for test in sample["tests"]:
            if load_err is not None:
                res.append(load_err)
                continue
            signal.setitimer(signal.ITIMER_REAL, sample["timeout"])
            try:
                exec(compile(test, "<test>", "exec"), dict(ns))
                res.append("pass")
            except _Timeout:
                res.append("timeout")
            except AssertionError as e:
                got = ""
                if test.startswith("assert ") and " == " in test:
                    try:
                        got = " got " + repr(eval(test[7:].split(" == ", 1)[0], dict(ns)))[:200]
                    except BaseException:
                        got = ""
                res.append("fail: assertion failed" + got)
            except BaseException as e:
                res.append("error: " + _short(e))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:
        res = res + ["error: " + _short(e)] * (len(sample["tests"]) - len(res))
    finally:
        sys.stdout, sys.stderr = real_stdout, real_stderr
    _out.write(json.dumps({"id": sample["id"], "results": res}) + "\n")
    _out.flush()
'''


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


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def sample_key(code: str, tests: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(code.encode()).digest())
    h.update(hashlib.sha256(json.dumps(list(tests)).encode()).digest())
    return h.hexdigest()[:24]


class Sandbox:
    def __init__(self, *, timeout_s: float = 2.0, memory_mb: int = 1024, batch_size: int = 256,
                 workers: int = 2, python: str | None = None):
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.batch_size, self.workers = int(batch_size), int(workers)
        self.python = python or sys.executable
        self.cache: dict[str, TestRun] = {}
        self.n_subprocesses = 0

    # ------------------------------------------------------------------ the child process
    def _limits(self) -> None:
        mem = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()

    def _spawn(self, samples: list[dict]) -> dict[str, list[str]]:
        """Run samples in one child; returns what it reported (possibly fewer than asked)."""
        budget = 5.0 + sum(self.timeout_s * (1 + len(s["tests"])) for s in samples)
        r_fd, w_fd = os.pipe()
        self.n_subprocesses += 1
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([self.python, "-I", "-S", "-c", _HARNESS, str(w_fd)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                pass_fds=(w_fd,), preexec_fn=self._limits, cwd="/tmp")
        os.close(w_fd)
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(_read_all(r_fd)), daemon=True)
        reader.start()   # drain results while the child runs: a full pipe must never block it
        try:
            proc.stdin.write(json.dumps(samples).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
        reader.join()
        out: dict[str, list[str]] = {}
        for line in b"".join(chunks).splitlines():
            try:
                rec = json.loads(line)
                out[rec["id"]] = rec["results"]
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _run_batch(self, samples: list[dict]) -> dict[str, tuple[str, ...]]:
        got = self._spawn(samples)
        done = {k: tuple(v) for k, v in got.items()}
        rest = [s for s in samples if s["id"] not in done]
        if len(samples) > 1:
            for s in rest:  # retry alone: only the culprit fails
                one = self._spawn([s])
                done[s["id"]] = tuple(one[s["id"]]) if s["id"] in one else \
                    ("crashed: the test process was killed (time or memory limit, or exit)",) * max(1, len(s["tests"]))
        else:
            for s in rest:
                done[s["id"]] = ("crashed: the test process was killed (time or memory limit, or exit)",) * max(1, len(s["tests"]))
        return done

    # ------------------------------------------------------------------ public API
    def run_many(self, items: Iterable[tuple[str, Sequence[str]]]) -> list[TestRun]:
        """Run (code, tests) pairs, batched over `workers` children; cached by content hash."""
        items = [(c, tuple(t)) for c, t in items]
        keys = [sample_key(c, t) for c, t in items]
        todo: dict[str, dict] = {}
        for k, (c, t) in zip(keys, items):
            if k not in self.cache and k not in todo:
                todo[k] = {"id": k, "code": c, "tests": list(t), "timeout": self.timeout_s}
        if todo:
            ordered = list(todo.values())
            batches = [ordered[i:i + self.batch_size] for i in range(0, len(ordered), self.batch_size)]
            if len(batches) == 1 or self.workers == 1:
                results = [self._run_batch(b) for b in batches]
            else:
                with ThreadPoolExecutor(self.workers) as ex:
                    results = list(ex.map(self._run_batch, batches))
            for res in results:
                for k, r in res.items():
                    self.cache[k] = TestRun(k, r)
        return [self.cache[k] for k in keys]

    def run(self, code: str, tests: Sequence[str]) -> TestRun:
        return self.run_many([(code, tests)])[0]
