"""The unit-test sandbox: time limit, memory limit, no network, crash isolation, caching."""

from __future__ import annotations

import importlib.util
import socket
import threading

import pytest

from aftraj.corpus.sandbox import Sandbox

GOOD = ("def add(a, b):\n    return a + b\n", ("assert add(1, 2) == 3", "assert add(2, 2) == 5"))


def test_pass_and_fail_are_reported(sandbox):
    run = sandbox.run(*GOOD)
    assert run.results[0] == "pass" and run.results[1].startswith("fail") and "got 4" in run.results[1]
    assert not run.passed and run.n_passed == 1


def test_infinite_loop_is_stopped():
    sb = Sandbox(timeout_s=0.5, memory_mb=512)
    runs = sb.run_many([("def f():\n    while True:\n        pass\n", ("assert f() is None",)),
                        ("while True:\n    pass\n", ("assert True",))])
    assert [r.results for r in runs] == [("timeout",), ("timeout",)]
    assert not any(r.passed for r in runs)


def test_ten_gigabyte_allocation_is_stopped():
    sb = Sandbox(timeout_s=5, memory_mb=512)
    run = sb.run("def f():\n    x = bytearray(10 * 1024 ** 3)\n    return len(x)\n", ("assert f() > 0",))
    assert not run.passed and "MemoryError" in run.results[0]


def test_socket_connect_to_localhost_is_refused():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    # the listener is reachable from outside the sandbox ...
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    # ... and not from inside it, whichever way the code tries
    code = ("import socket, _socket\n"
            f"def raw():\n    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n    s.connect(('127.0.0.1', {port}))\n    return 1\n"
            f"def lowlevel():\n    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n    s.connect(('127.0.0.1', {port}))\n    return 1\n"
            f"def helper():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return 1\n")
    run = Sandbox(timeout_s=2).run(code, ("assert raw() == 1", "assert lowlevel() == 1", "assert helper() == 1"))
    srv.close()
    assert not run.passed and run.n_passed == 0
    assert all("PermissionError" in r and "sandbox" in r for r in run.results), run.results


def test_subprocess_is_refused():
    run = Sandbox(timeout_s=2).run("import os\ndef f():\n    return os.system('true')\n", ("assert f() == 0",))
    assert not run.passed and "PermissionError" in run.results[0]


def test_a_crashing_sample_fails_alone_and_output_is_not_confused():
    sb = Sandbox(timeout_s=2)
    runs = sb.run_many([GOOD, ("import os\nos._exit(3)\n", ("assert True",)),
                        ("print('{\"id\": \"x\"}')\ndef g():\n    return 2\n", ("assert g() == 2",))])
    assert runs[0].results[0] == "pass"
    assert runs[1].results[0].startswith("crashed")
    assert runs[2].passed


def test_results_are_cached_by_code_and_tests():
    sb = Sandbox(timeout_s=2)
    sb.run(*GOOD)
    n = sb.n_subprocesses
    again = sb.run(*GOOD)
    assert sb.n_subprocesses == n and again.results[0] == "pass"
    sb.run(GOOD[0], ("assert add(0, 0) == 0",))
    assert sb.n_subprocesses == n + 1


@pytest.mark.parametrize("body, why", [
    ("    while True:\n        pass\n", "timeout"),
    ("    x = bytearray(10 * 1024 ** 3)\n    return len(x)\n", "MemoryError"),
    ("    import socket\n    socket.create_connection(('127.0.0.1', 80))\n", "PermissionError"),
])
@pytest.mark.slow
def test_a_bad_sample_is_a_failed_test_run_in_a_rollout(body, why):
    """Through the CodeTester's run_tests tool: the run is recorded as failed, never raised."""
    from aftraj.corpus.rollout import Turn
    from aftraj.corpus.tasks import generate_tasks
    from aftraj.corpus.templates import TEMPLATES

    tpl, task = TEMPLATES["coding"], generate_tasks("coding", 1, 0)[0]
    fn = task.data["function"]
    params = task.prompt.split(f"`{fn}(", 1)[1].split(")`", 1)[0]
    code = f"def {fn}({params}):\n{body}"
    turns = [tpl.request_turn(task),
             Turn(agent="CodeWriter", kind="message", content=f"```python\n{code}```", sim={"act": "code"}),
             Turn(agent="CodeTester", kind="tool_call", content="Running.", tool="run_tests",
                  arguments={"function": fn, "suite": "public"}, sim={"act": "tcall"})]
    res = tpl.execute(task, turns, Sandbox(timeout_s=1, memory_mb=512))
    assert res.kind == "tool_result" and res.sim["passed"] is False and res.error is None
    assert why in res.content and "passed 0/" in res.content


_SO = getattr(importlib.util.find_spec("_posixsubprocess"), "origin", "") or ""
_SO = _SO if _SO.endswith(".so") else ""


@pytest.mark.parametrize("code", [
    # rebinding the harness's globals must not switch the hook off
    "import __main__, sys\nfor k in list(vars(__main__)):\n    if 'BLOCK' in k.upper() or 'HOOK' in k.upper():\n"
    "        setattr(__main__, k, ())\nimport socket\ns = socket.socket()\nR = 'escaped'\n",
    # _posixsubprocess.fork_exec spawns a process without raising any audit event
    "import _posixsubprocess\nR = 'escaped'\n",
    # ... also when its .so is loaded by file under another package name
    pytest.param("import importlib.util\n"
                 f"m = importlib.util.module_from_spec(importlib.util.spec_from_file_location('pkg._posixsubprocess', {_SO!r}))\n"
                 "R = 'escaped' if hasattr(m, 'fork_exec') else ''\n",
                 marks=pytest.mark.skipif(not _SO, reason="_posixsubprocess is built into this Python (no .so)")),
    "import subprocess\nR = 'escaped'\n",
    # a gc walk would find the hook function (and its block list)
    "import gc\nR = 'escaped' if gc.get_objects() else ''\n",
    "import _ctypes\nR = 'escaped'\n",
], ids=["rebind-globals", "posixsubprocess", "posixsubprocess-by-file", "subprocess-import", "gc-walk", "raw-ctypes"])
def test_sandbox_escapes_are_refused(code):
    run = Sandbox(timeout_s=2, memory_mb=512).run(code, ("assert R == 'escaped'",))
    assert not run.passed and "PermissionError" in run.results[0] and "sandbox" in run.results[0], run.results


# --------------------------------------------------------------------------- attacks (issue 14)
# Each attack sets R = 'escaped' only if it worked; its test is `assert R == 'escaped'`, so an
# attack is contained when the run does not pass. Every one runs in both isolation modes: the
# namespaces (where this kernel allows them) and the audit-hook fallback (isolation='none'): the
# `isolation` and `make_sandbox` fixtures of conftest.py, shared with test_sandbox_threats.py.

import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


ATTACKS = {
    # the audit hook used to check str(args[0]): a str subclass that lies passed it
    "str-subclass-import": (
        "class S(str):\n"
        "    def __str__(self):\n        return 'harmless'\n"
        "m = __import__(S('_posixsubprocess'))\n"
        "R = 'escaped' if hasattr(m, 'fork_exec') else ''\n"),
    "read-etc-passwd": "R = 'escaped' if 'root' in open('/etc/passwd').read() else ''\n",
    "read-etc-passwd-by-symlink": (
        "import os\nos.symlink('/etc/passwd', 'p')\nR = 'escaped' if 'root' in open('p').read() else ''\n"),
    "read-repository": f"R = 'escaped' if 'aftraj' in open({str(REPO / 'pyproject.toml')!r}).read() else ''\n",
    "list-repository": f"import os\nR = 'escaped' if 'aftraj' in os.listdir({str(REPO)!r}) else ''\n",
    "read-parent-environ": (
        "import os\nD = b''\npid = os.getppid()\n"
        "for _ in range(3):\n"
        "    D += open(f'/proc/{pid}/environ', 'rb').read()\n"
        "    pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "R = 'escaped' if D else ''\n"),
    "socket": (
        "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(1)\ntry:\n    s.connect(('127.0.0.1', 9))\nexcept ConnectionRefusedError:\n    pass\n"
        "R = 'escaped'\n"),
    "write-root": "open('/escaped.txt', 'w').write('x')\nR = 'escaped'\n",
    "thread": "import threading\nt = threading.Thread(target=lambda: None)\nt.start()\nR = 'escaped'\n",
    "fork": "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nR = 'escaped'\n",
    "frame-walk": (
        "import sys\ntry:\n    raise ValueError\nexcept ValueError as e:\n    f = e.__traceback__.tb_frame\n"
        "R = 'escaped' if f.f_back is not None else ''\n"),
    "getframe": "import sys\nR = 'escaped' if sys._getframe(1) is not None else ''\n",
    # the old batch harness serialised results with json.dumps after the sample ran
    "patch-harness-json": (
        "import json\n_d = json.dumps\n"
        "json.dumps = lambda o, **k: _d(dict(o, results=['pass'] * len(o.get('results', [1]))) if isinstance(o, dict) else o)\n"
        "R = ''\n"),
    "patch-builtins-exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\nR = ''\n",
    # a forged result line on every descriptor the harness might read, then a clean exit
    "forged-result-line": (
        "import os, sys, json, __main__\n"
        "ids = [s['id'] for s in getattr(__main__, 'samples', [])] or ['x']\n"
        "fds = [int(sys.argv[1])] if len(sys.argv) > 1 and sys.argv[1].isdigit() else []\n"
        "for fd in fds + [1, 2]:\n"
        "    for i in ids:\n"
        "        try:\n"
        "            os.write(fd, (json.dumps({'id': i, 'results': ['pass']}) + '\\n').encode())\n"
        "        except OSError:\n            pass\n"
        "os._exit(0)\n"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(name, isolation, make_sandbox):
    with make_sandbox(isolation) as sb:
        if name == "thread" and not sb.limits_processes:
            pytest.xfail("documented gap: the host's root in mode 'none' is exempt from RLIMIT_NPROC and "
                         "Python < 3.13 raises no audit event for a thread")
        run = sb.run(ATTACKS[name], ("assert R == 'escaped'",))
    assert not run.passed, (name, isolation, run.results)


def test_write_outside_the_working_folder_is_contained(isolation, tmp_path, make_sandbox):
    tmp_path.chmod(0o777)
    target = tmp_path / "escaped.txt"
    code = (f"T = {str(target)!r}\ntry:\n    open(T, 'w').write('x')\nexcept OSError:\n    pass\n"
            "import os\nos.makedirs('sub', exist_ok=True)\nopen('sub/own.txt', 'w').write('ok')\n")
    with make_sandbox(isolation) as sb:
        run = sb.run(code, ("assert open(T).read() == 'x'", "assert open('sub/own.txt').read() == 'ok'"))
    assert not target.exists()
    assert run.results[0] != "pass" and run.results[1] == "pass", run.results   # its own folder works


def test_a_200_mb_file_is_refused(isolation, make_sandbox):
    name = f"aftraj-sandbox-big-{os.getpid()}"
    code = (f"import os\nN = {name!r}\ndef write():\n    with open(N, 'wb') as f:\n"
            "        for _ in range(200):\n            f.write(b'\\0' * (1 << 20))\n    return os.path.getsize(N)\n")
    try:
        with make_sandbox(isolation, timeout_s=20) as sb:
            run = sb.run(code, ("assert write() >= 200 << 20",))
    finally:
        for folder in ("/tmp", os.getcwd()):   # where the old sandbox left it
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
    assert not run.passed and "File too large" in run.results[0], run.results


def test_signalling_the_parent_is_contained(isolation, make_sandbox):
    if isolation == "none":
        pytest.xfail("documented gap: without a pid namespace pidfd_send_signal reaches same-user processes")
    code = (f"import os, signal\nR = ''\nfor pid in (os.getppid(), {os.getpid()}):\n"
            "    try:\n        signal.pidfd_send_signal(os.pidfd_open(pid), 0)\n        R = 'escaped'\n"
            "    except OSError:\n        pass\n")
    with make_sandbox(isolation) as sb:
        run = sb.run(code, ("assert R == 'escaped'",))
    assert not run.passed, run.results


def test_kill_of_the_parent_is_refused(isolation, make_sandbox):
    code = f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    R = 'escaped'\nexcept OSError:\n    R = ''\n"
    with make_sandbox(isolation) as sb:
        run = sb.run(code, ("assert R == 'escaped'",))
    assert not run.passed


def test_patched_builtins_and_hidden_tests_do_not_reach_another_sample(isolation, make_sandbox):
    evil = ("import builtins, __main__\nbuiltins.exec = lambda *a, **k: None\n"
            "L = repr(vars(__main__))\n")
    wrong = "def add(a, b):\n    return a - b\n"
    with make_sandbox(isolation) as sb:
        runs = sb.run_many([(evil, ("assert 'SECRET-7781' in L",)),
                            (wrong, ("assert add(1, 2) == 3  # SECRET-7781",))])
    assert not runs[0].passed, runs[0].results      # the other sample's hidden test is not visible
    assert not runs[1].passed, runs[1].results      # and the patched exec did not make it pass


@pytest.mark.slow
def test_ignoring_sigalrm_is_bounded_in_wall_time(isolation, make_sandbox):
    stall = ("import os, signal, time\ndef f():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
             "    os.close(1)\n    os.close(2)\n    time.sleep(3600)\n")   # and its output pipe closed
    spin = "import signal\ndef f():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n"
    good = [(f"def f():\n    return {i}\n", (f"assert f() == {i}",)) for i in range(8)]
    t0 = time.monotonic()
    with make_sandbox(isolation, timeout_s=0.5, workers=2) as sb:
        runs = sb.run_many([(stall, ("f()",)), (spin, ("f()",))] + good)
    took = time.monotonic() - t0
    assert [r.results[0].startswith("crashed") for r in runs[:2]] == [True, True], [r.results for r in runs[:2]]
    assert all(r.passed for r in runs[2:])
    assert took < 6.0, took      # the bound is timeout * (1 + tests) + 1 s per sample, not a batch budget


def test_runner_killed_by_a_sample_is_replaced(isolation, make_sandbox):
    """In the fallback a sample can signal a runner of its own uid (not as root: the sample is
    nobody); the sample is a crash or refused, and the next one runs."""
    kill = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n"
    with make_sandbox(isolation) as sb:
        runs = sb.run_many([(kill, ("assert True",))])
        after = sb.run(*GOOD)
    # namespaces: no target; mode none: a crash, or refused where the sample is nobody and the runner root
    assert isolation == "namespaces" or runs[0].results[0].startswith(("crashed", "error: PermissionError"))
    assert after.results[0] == "pass"


def test_isolation_is_reported_and_checked():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="chroot")
    with Sandbox(isolation="none") as sb:
        assert sb.isolation == "none"
    with Sandbox(isolation="auto") as sb:
        assert sb.isolation in ("namespaces", "none")


def test_common_stdlib_works_inside(isolation, make_sandbox):
    code = ("import collections, typing, hashlib, decimal, json, re, math, itertools, heapq, datetime, random\n"
            "P = collections.namedtuple('P', 'a b')\nT = typing.TypeVar('T')\n"
            "def f():\n    return (P(1, 2).b, hashlib.sha256(b'x').hexdigest()[:4], str(decimal.Decimal('1.5') * 2),"
            " json.dumps([1]), math.comb(5, 2))\n")
    with make_sandbox(isolation) as sb:
        run = sb.run(code, ("assert f() == (2, '2d71', '3.0', '[1]', 10)",))
    assert run.passed, run.results


def test_the_environment_is_empty_and_descriptors_closed(isolation, make_sandbox):
    code = ("import os\nE = dict(os.environ)\ndef is_open(fd):\n    try:\n        os.fstat(fd)\n        return True\n"
            "    except OSError:\n        return False\nFDS = [fd for fd in range(64) if is_open(fd)]\n")
    with make_sandbox(isolation) as sb:   # Python itself sets LC_CTYPE when the environment has no locale
        run = sb.run(code, ("assert set(E) <= {'LC_CTYPE'}", "assert FDS == [1, 2]"))
    assert run.results == ("pass", "pass"), run.results


def test_files_of_one_sample_are_gone_for_the_next(isolation, make_sandbox):
    """Samples run one after another in the same runner: the working folder and /tmp are fresh."""
    write = ("import os, tempfile\nopen('left.txt', 'w').write('x')\n"
             "T = tempfile.gettempdir()\nopen(os.path.join(T, 'left-tmp.txt'), 'w').write('x')\n")
    look = ("import os, tempfile\nF = [os.path.exists('left.txt'), "
            "os.path.exists(os.path.join(tempfile.gettempdir(), 'left-tmp.txt'))]\n")
    with make_sandbox(isolation, workers=1) as sb:
        first = sb.run(write, ("assert open('left.txt').read() == 'x'",))
        second = sb.run(look, ("assert F == [False, False]",))
    assert first.results == ("pass",) and second.results == ("pass",), (first.results, second.results)


def test_runners_outlive_the_worker_threads_that_started_them():
    """Runners are started from run_many's worker threads, which end with the call: the runner
    must not die with its thread (PR_SET_PDEATHSIG is per thread), and a dead idle runner is
    replaced, never handed a sample."""
    with Sandbox(timeout_s=2, workers=2) as sb:
        first = sb.run_many([GOOD, ("def g():\n    return 1\n", ("assert g() == 1",))])
        later = sb.run("def h():\n    return 2\n", ("assert h() == 2",))
        assert first[1].passed and later.passed, (first[1].results, later.results)
        for r in list(sb._runners):
            r.proc.kill()
            r.proc.wait()
        again = sb.run("def k():\n    return 3\n", ("assert k() == 3",))
    assert again.passed, again.results
