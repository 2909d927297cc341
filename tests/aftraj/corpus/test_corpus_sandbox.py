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
    sb = Sandbox(timeout_s=2, batch_size=8)
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
