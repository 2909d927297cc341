"""The sandbox's zygote (stdlib only; it never imports ctypes nor anything else that reaches raw
memory). `sandbox_runner.py` executes it once per runner as `python -I -S -B -c <this file's
text>` with an empty environment, after confining itself (namespaces, capabilities, uid); it is
never imported by the package and never runs candidate code itself. For every sample it forks a
child, a copy of this pristine interpreter, which becomes the sample's process: that process holds
no ctypes class (none was ever created in it), nothing of the runner, nothing of an earlier sample.

Control channel: fd 0, a unix stream socket to the runner; frames are a 4-byte big-endian length +
JSON.
  runner -> zygote  {"isolation": "namespaces"|"none", "uid": int|None, "read_roots": [...]}  (once)
  zygote -> runner  {"ready": true, "preloaded": n}
  runner -> zygote  {"wall_s", "memory_mb", "cpu_s", "file_mb", "workdir"} + one descriptor (SCM_RIGHTS):
                    the sample's socket
  zygote -> runner  {"pid": pid} + a pidfd of the child (where the kernel has pidfd_open)
  zygote -> runner  {"status": waitstatus, "timed_out": bool}
The sample's socket becomes the child's fds 1 and 2 (nothing else is open). On it the runner sends
frame 1, {"code", "nonce", "timeout"}; the child installs its audit hook, loads the code, freezes
(timers cancelled, signals blocked, garbage collection off) and writes "loaded:<nonce>\\n"; only
then does the runner send the tests (an 8-byte length, then each test hex-encoded, comma-separated:
decoded with bytes.fromhex, nothing a sample can patch), so the hidden tests are not in the
sample's process before it is loaded and frozen, and they never pass through the zygote at all.
The child runs them and writes one line, "<nonce>:" + hex results. See sandbox.py for the threat
model.
"""

import os
import select
import signal
import socket
import sys
import time

import _signal  # noqa: E402  (the C functions behind signal's: the sample can rebind signal.py's globals)
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402  (control frames and frame 1 only: never used after candidate code starts)

# Imported once here, before any sample, so a sample does not pay for them (a fork shares them
# copy-on-write). Each costs start-up time per runner.
PRELOAD = (
    "abc", "array", "bisect", "collections", "collections.abc", "contextlib", "copy", "datetime", "decimal", "enum",
    "fractions", "functools", "hashlib", "heapq", "importlib.util", "io", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "resource", "statistics", "string", "time", "types", "typing", "unicodedata")
# Imported too in mode none as the host's root, where the sample runs as nobody, who may not be able
# to read the stdlib (a Python under /root): there a sample can import only what is preloaded.
PRELOAD_UNPRIVILEGED = (
    "argparse", "ast", "base64", "binascii", "calendar", "cmath", "codecs", "colorsys", "copyreg", "csv",
    "dataclasses", "difflib", "fnmatch", "glob", "graphlib", "inspect", "keyword", "locale", "pathlib", "pprint",
    "queue", "reprlib", "secrets", "shlex", "shutil", "signal", "tempfile", "textwrap", "threading", "tokenize",
    "traceback", "uuid", "warnings", "weakref", "zlib")
# modules that reach raw memory or spawn processes without an audit event: never importable
FORBIDDEN_MODULES = ("_ctypes", "ctypes", "_posixsubprocess", "_xxsubinterpreters", "_xxinterpchannels")
FORBIDDEN_PREFIXES = ("_test", "_xx", "_ctypes")
OUTPUT_CAP = 1 << 20


# --------------------------------------------------------------------------- framing (zygote only)

# A copy of sandbox_runner.py's _read_exact on purpose: this file runs alone (`python -c` text) and
# must never import the runner, which holds ctypes.
def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _frame(obj):
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "big") + data


class _Control:
    """The runner's socket on fd 0: whole frames in, frames (with descriptors) out."""

    def __init__(self):
        self.sock = socket.socket(fileno=0)
        self.buf = b""
        self.fds = []

    def recv(self):
        """One frame and the descriptors that came with it; EOFError when the runner is gone."""
        while True:
            if len(self.buf) >= 4:
                n = int.from_bytes(self.buf[:4], "big")
                if len(self.buf) >= 4 + n:
                    obj, self.buf = json.loads(self.buf[4:4 + n]), self.buf[4 + n:]
                    fds, self.fds = self.fds, []
                    return obj, fds
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise EOFError
            self.buf += data
            self.fds += fds

    def send(self, obj, fds=()):
        data = _frame(obj)
        if fds:
            n = socket.send_fds(self.sock, [data], list(fds))
            data = data[n:]
        if data:
            self.sock.sendall(data)


# --------------------------------------------------------------------------- the audit hook (child only)
#
# The hook and every function it calls are made by _make_hook before the sample runs and read no
# global: what they call is bound in their closure or as a default value (the sample can rebind
# module attributes and builtins, and _run_sample empties this module's namespace before it runs;
# signal's functions are the C ones of _signal, since signal.py's wrappers read that module's
# globals). test_sandbox_threats.py::test_the_harness_reads_no_global_once_the_sample_runs checks it.

# audit events a sample may never raise
BLOCKED_EVENTS = frozenset((
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames", "sys._current_exceptions",
    "sys.settrace", "sys.setprofile", "_thread.start_new_thread", "os.chroot", "winreg", "webbrowser.open",
    # a second audit hook would see each hidden test's source as it is compiled
    "sys.addaudithook",
    # a code object the sample builds (CodeType, code.replace, marshal) can index past its
    # constants and locals: a raw memory read and write without ctypes (marshal.loads: below)
    "code.__new__", "marshal.load"))
# attributes that lead to a frame (the harness's locals and code): never read
FRAME_ATTRS = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_code"))
# mode none, the file events: event -> (indices of path arguments, indices of dir_fd arguments, writes?)
FS_EVENTS = {
    "open": ((0,), (), None), "os.listdir": ((0,), (), False), "os.scandir": ((0,), (), False),
    "os.chdir": ((0,), (), False), "os.getxattr": ((0,), (), False), "os.listxattr": ((0,), (), False),
    "os.remove": ((0,), (1,), True), "os.rmdir": ((0,), (1,), True), "os.mkdir": ((0,), (2,), True),
    "os.rename": ((0, 1), (2, 3), True), "os.symlink": ((0, 1), (2,), True), "os.link": ((0, 1), (2, 3), True),
    "os.truncate": ((0,), (), True), "os.chmod": ((0,), (2,), True), "os.chown": ((0,), (3,), True),
    "os.utime": ((0,), (3,), True), "os.setxattr": ((0,), (), True), "os.removexattr": ((0,), (), True),
    "os.chflags": ((0,), (), True), "os.lchflags": ((0,), (), True), "os.mkfifo": ((0,), (), True),
    "os.mknod": ((0,), (), True), "shutil.rmtree": ((0,), (), True)}


def _under(path, roots):
    for r in roots:
        if path == r or path.startswith(r + "/"):
            return True
    return False


def _path_resolver():
    """resolve(path): the real absolute path, symlinks resolved with functions bound now."""
    lstat, readlink, getcwd = os.lstat, os.readlink, os.getcwd
    islnk = __import__("stat").S_ISLNK

    def resolve(p, _bytes=bytes, _type=type, _deny=PermissionError, _oserror=OSError):
        if _type(p) is _bytes:
            p = p.decode("utf-8", "surrogateescape")
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        parts, done, hops = p.split("/"), [], 0
        while parts:
            part = parts.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            cur = "/" + "/".join(done + [part])
            try:
                st = lstat(cur)
            except _oserror:
                done.append(part)
                continue
            if islnk(st.st_mode):
                hops += 1
                if hops > 40:
                    raise _deny("sandbox: too many symbolic links")
                target = readlink(cur)
                if target.startswith("/"):
                    done = []
                parts = [x for x in target.split("/")] + parts
                continue
            done.append(part)
        return "/" + "/".join(done)

    return resolve


def _stdlib_bytecode(workdir, read_roots, resolve, under):
    """(note_pyc(path), trusted_bytecode(data)): marshal.loads is allowed for one thing, the import
    system loading a stdlib .pyc, i.e. data (the event's copy of the buffer) equal to the body of
    the .pyc last opened under the stdlib folders (note_pyc, on each open of a .pyc), which the
    sample cannot write."""
    os_open, os_read, os_close, O_RDONLY = os.open, os.read, os.close, os.O_RDONLY | os.O_CLOEXEC
    last_pyc = [None]      # the last .pyc opened from the stdlib (read-only to the sample)

    def note_pyc(path):
        real = resolve(path)
        last_pyc[0] = real if under(real, read_roots) and not under(real, (workdir,)) else None

    def trusted_bytecode(data, _type=type, _bytes=bytes, _len=len):
        path = last_pyc[0]
        if path is None or _type(data) is not _bytes:
            return False
        fd = os_open(path, O_RDONLY)       # raises an 'open' event of its own: a stdlib .pyc again
        try:
            body, chunk = b"", b"x"
            while chunk:
                chunk = os_read(fd, 1 << 20)
                body += chunk
        finally:
            os_close(fd)
        return _len(body) > 16 and _bytes(data) == body[16:]

    return note_pyc, trusted_bytecode


def _quiet_check(own_handlers):
    """quiet(), mode none: nothing of the sample can run between the check and the open."""
    getsignal, signals = _signal.getsignal, tuple(sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}))
    fine_handlers = (_signal.SIG_DFL, _signal.SIG_IGN, None, _signal.default_int_handler)
    gc_isenabled = gc.isenabled

    def quiet(_deny=PermissionError):
        if gc_isenabled():
            raise _deny("sandbox: file access with the garbage collector enabled is not allowed "
                        "(isolation 'none': a finalizer could race the path check)")
        for sig in signals:
            h = getsignal(sig)
            ok = False
            for f in fine_handlers:          # identity only: a handler object's __eq__ is the sample's
                if h is f:
                    ok = True
            for f in own_handlers:
                if h is f:
                    ok = True
            if not ok:
                raise _deny("sandbox: file access while the sample has a signal handler installed is not "
                            "allowed (isolation 'none': it could race the path check)")

    return quiet


def _file_check(workdir, read_roots, resolve, under, quiet):
    """check_files(event, args), mode none, for the events of FS_EVENTS: no symlink is made, no
    dir_fd is used, and every path resolves under workdir (read/write) or the stdlib folders (read)."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    fs_events = FS_EVENTS

    def check_files(event, args, _type=type, _str=str, _bytes=bytes, _int=int, _bool=bool, _deny=PermissionError,
                    _len=len):
        if event == "os.symlink":
            raise _deny("sandbox: os.symlink is not allowed (isolation 'none')")
        quiet()
        paths, dirfds, writes = fs_events[event]
        for i in dirfds:    # absent: None, or AT_FDCWD (-100) as some events pass it
            if i < _len(args) and _type(args[i]) is _int and args[i] >= 0:
                raise _deny("sandbox: " + event + " with dir_fd is not allowed")
        if writes is None:     # open(path, mode, flags)
            flags = args[2] if _len(args) > 2 else 0
            writes = _type(flags) is _int and _bool(flags & write_flags)
        for i in paths:
            if i >= _len(args):
                continue
            p = args[i]
            if p is None or _type(p) is _int:
                continue   # the current folder, or a descriptor the sample already holds
            if _type(p) is not _str and _type(p) is not _bytes:
                raise _deny("sandbox: " + event + " of a " + _type(p).__name__ + " path is not allowed")
            real = resolve(p)
            if not (under(real, (workdir,)) or (not writes and under(real, read_roots))):
                raise _deny("sandbox: " + event + " outside the sample's folder is not allowed")

    return check_files


def _make_hook(workdir, read_roots, confine_files, own_handlers):
    """The hook judges real types only (an argument of a str subclass is refused, never str()-ed).

    confine_files (mode none): file access is confined to workdir (read/write) and the stdlib
    folders (read), after resolving symlinks with functions bound now; and since that is a check
    before the open, nothing of the sample may run between the two: no symlink may be created (a
    swapped path component is then always a real folder, whose '..' the lexical resolution
    matches), no file access while the garbage collector is on (a finalizer could run inside the
    check or the open) or while a Python signal handler of the sample is installed (it could run
    inside the check), and threads are stopped by RLIMIT_NPROC (the sample is never the host's
    root)."""
    resolve, under = _path_resolver(), _under
    note_pyc, trusted_bytecode = _stdlib_bytecode(workdir, read_roots, resolve, under)
    check_files = _file_check(workdir, read_roots, resolve, under, _quiet_check(own_handlers))
    blocked, frame_attrs, fs_events = BLOCKED_EVENTS, FRAME_ATTRS, FS_EVENTS
    modules, prefixes = frozenset(FORBIDDEN_MODULES), FORBIDDEN_PREFIXES
    gc_after = [None]      # the collector's state before an allowed marshal.loads
    gc_enable, gc_disable, gc_isenabled = gc.enable, gc.disable, gc.isenabled

    def hook(event, args, _type=type, _str=str, _deny=PermissionError, _valueerror=ValueError, _len=len):
        if event == "open" and args and _type(args[0]) is _str and args[0].endswith(".pyc"):
            note_pyc(args[0])
        if gc_after[0] is not None:        # the first event after an allowed marshal.loads
            was, gc_after[0] = gc_after[0], None
            if was:
                gc_enable()
        if event == "marshal.loads":
            if not (args and trusted_bytecode(args[0])):
                raise _deny("sandbox: marshal.loads is not allowed (only the stdlib's own .pyc files are loaded)")
            # the hook saw a copy of the buffer: no finalizer may change the original while
            # marshal reads it (marshal raises no event; the next event turns the collector back on)
            gc_after[0] = gc_isenabled()
            gc_disable()
        if event in blocked or event.startswith(("socket.", "ctypes.")):
            raise _deny("sandbox: " + event + " is not allowed")
        if event == "sys._getframe":
            # a ValueError, as for a too-deep frame, so stdlib callers (namedtuple, typing) fall back
            raise _valueerror("sandbox: sys._getframe is not allowed")
        if event == "object.__getattr__" and _len(args) > 1 and (_type(args[1]) is not _str or args[1] in frame_attrs):
            raise _deny("sandbox: this attribute is not allowed")
        if event == "object.__setattr__" and _len(args) > 1 and (_type(args[1]) is not _str or args[1] == "__code__"):
            raise _deny("sandbox: replacing code is not allowed")
        if event == "import" and args:
            name = args[0]
            if _type(name) is not _str:
                raise _deny("sandbox: import of a non-str name is not allowed")
            last = name.rpartition(".")[2]
            if last in modules or last.startswith(prefixes):
                raise _deny("sandbox: import " + name + " is not allowed")
        if confine_files and event in fs_events:
            check_files(event, args)

    return hook


# --------------------------------------------------------------------------- the sample (child only)
#
# What _run_sample uses once the candidate code has started is bound before it: its locals, and the
# helpers below, which it binds as locals too and which read no global: what they call is a
# parameter or a default value, evaluated when this file ran in the zygote, before any sample.

def _read_exact_bound(read, fd, n, _len=len, _eof=EOFError):
    """_read_exact with os.read passed in (the sample may have rebound os.read by then)."""
    buf = b""
    while _len(buf) < n:
        chunk = read(fd, n - _len(buf))
        if not chunk:
            raise _eof
        buf += chunk
    return buf


def _error_text(e, _type=type, _str=str, _len=len, _BaseException=BaseException):
    """"error: <type>: <message>" (300 characters), or the type alone when str(e) raises."""
    try:
        s = _type(e).__name__ + ": " + _str(e)
        return "error: " + (s if _len(s) <= 300 else s[:300] + "...")
    except _BaseException:
        return "error: " + _type(e).__name__


# Every signal, computed at import and bound below as _receive_tests' default, so that nothing is
# looked up once the sample runs (frozen: the default the harness holds cannot be emptied either).
_ALL_SIGNALS = frozenset(signal.valid_signals())


def _receive_tests(nonce, _write=os.write, _read=os.read, _exit=os._exit, _set_blocking=os.set_blocking,
                   _from_bytes=int.from_bytes, _fromhex=bytes.fromhex, _read_n=_read_exact_bound,
                   _setitimer=signal.setitimer, _timers=(signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF),
                   _sigmask=_signal.pthread_sigmask, _SIG_BLOCK=signal.SIG_BLOCK, _SIG_SETMASK=signal.SIG_SETMASK,
                   _all_signals=_ALL_SIGNALS, _gc_disable=gc.disable, _gc_enable=gc.enable,
                   _gc_isenabled=gc.isenabled, _BaseException=BaseException):
    """The sample is loaded; now frozen (no timer of the sample fires, no signal handler or
    finalizer of the sample runs) while the tests come in, and only then are they asked for:
    "loaded:<nonce>" out, the tests in. Exits 72 when the runner went away, or the sample broke
    its own descriptors."""
    tests = None
    try:
        for which in _timers:
            _setitimer(which, 0)
        old_mask = _sigmask(_SIG_BLOCK, _all_signals)
        gc_was = _gc_isenabled()
        _gc_disable()
        _set_blocking(1, True)
        marker = ("loaded:" + nonce + "\n").encode()
        while marker:
            marker = marker[_write(1, marker):]
        n = _from_bytes(_read_n(_read, 1, 8), "big")
        data = _read_n(_read, 1, n)
        tests = [_fromhex(h.decode()).decode("utf-8", "surrogatepass") for h in data.split(b",")] if data else []
        del data
        if gc_was:
            _gc_enable()
        _sigmask(_SIG_SETMASK, old_mask)
    except _BaseException:
        _exit(72)
    return tests


def _run_tests(tests, load_err, ns, timeout, timeout_error, alarm, _error=_error_text, _exec=exec,
               _compile=compile, _eval=eval, _repr=repr, _dict=dict, _type=type, _str=str,
               _handle=_signal.signal, _setitimer=signal.setitimer, _ITIMER_REAL=signal.ITIMER_REAL,
               _SIGALRM=signal.SIGALRM, _AssertionError=AssertionError, _BaseException=BaseException):
    """Each test in a copy of the loaded namespace, under its timer: "pass", "timeout", "fail: …" or
    "error: …" (the load's error for every test when the load failed)."""
    results = []
    for test in tests:
        if load_err is not None:
            results.append(load_err)
            continue
        try:
            _handle(_SIGALRM, alarm)
            _setitimer(_ITIMER_REAL, timeout)
            try:
                _exec(_compile(test, "<test>", "exec"), _dict(ns))
                res = "pass"
            except timeout_error:
                res = "timeout"
            except _AssertionError:
                got = ""
                if test.startswith("assert ") and " == " in test:
                    try:
                        got = " got " + _repr(_eval(test[7:].split(" == ", 1)[0], _dict(ns)))[:200]
                    except _BaseException:
                        got = ""
                res = "fail: assertion failed" + got
            except _BaseException as e:
                res = _error(e)
            finally:
                _setitimer(_ITIMER_REAL, 0)
        except timeout_error:
            res = "timeout"
        if _type(res) is not _str:
            res = "error: the sample returned a non-text error"
        results.append(res)
    return results


def _report(nonce, results, _set_blocking=os.set_blocking, _write=os.write, _exit=os._exit):
    """The one line "<nonce>:" + hex results, then the end of the sample's process."""
    try:
        line = nonce + ":" + ",".join([r.encode("utf-8", "backslashreplace").hex() for r in results]) + "\n"
        data = line.encode()
        _set_blocking(1, True)
        while data:
            data = data[_write(1, data):]
    finally:
        _exit(0)


def _run_sample(workdir, read_roots, confine_files):
    """Runs in the sample's process (a fork of the zygote, confined and limited): installs the hook,
    loads the code, then receives and runs the tests (see the module docstring). Everything used
    after the candidate code starts is bound as a local first (the helpers above included, whose
    own values are parameters and defaults): a sample can rebind module attributes and builtins,
    not these."""
    import builtins
    import sys as _sys
    head = _read_exact(1, 4)                       # frame 1, from the runner, before any sample code
    req = json.loads(_read_exact(1, int.from_bytes(head, "big")))
    nonce, code, timeout = req["nonce"], req["code"], float(req["timeout"])
    del req, head
    _exec, _compile, error_text = exec, compile, _error_text
    receive_tests, run_tests, report = _receive_tests, _run_tests, _report
    _setitimer, _handle, _ITIMER_REAL, _SIGALRM = signal.setitimer, _signal.signal, signal.ITIMER_REAL, signal.SIGALRM
    _gc_disable, _BaseException, _StringIO = gc.disable, BaseException, io.StringIO
    sys.stdin = sys.__stdin__ = _StringIO("")
    sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = _StringIO()
    sys.argv = ["sandbox"]

    class _Timeout(_BaseException):
        pass

    def _alarm(signum, frame):
        raise _Timeout()

    hook = _make_hook(workdir, read_roots, confine_files, (_alarm,))
    # nothing of the zygote's module is left for the sample to read or call
    main = sys.modules.get("__main__")
    if main is not None:
        for k in [k for k in vars(main) if not k.startswith("__")]:
            delattr(main, k)
    if confine_files:
        _gc_disable()          # mode none: no finalizer may run inside a file check (see _make_hook)
    _sys.addaudithook(hook)    # the first hook and the last: it refuses sys.addaudithook
    del hook, main
    ns = {"__name__": "__sandbox__", "__builtins__": builtins}
    _handle(_SIGALRM, _alarm)
    _setitimer(_ITIMER_REAL, timeout)
    try:
        try:
            _exec(_compile(code, "<candidate>", "exec"), ns)
            load_err = None
        except _Timeout:
            load_err = "timeout"
        except _BaseException as e:
            load_err = error_text(e)
        finally:
            _setitimer(_ITIMER_REAL, 0)
    except _Timeout:
        load_err = "timeout"
    del code
    tests = receive_tests(nonce)         # loaded: now frozen, and only then the tests
    report(nonce, run_tests(tests, load_err, ns, timeout, _Timeout, _alarm))


def _set_limits(req):
    import resource
    mem = int(req["memory_mb"]) << 20
    cpu = int(req["cpu_s"])
    for lim, val in ((resource.RLIMIT_AS, (mem, mem)), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                     (resource.RLIMIT_FSIZE, (int(req["file_mb"]) << 20,) * 2), (resource.RLIMIT_NPROC, (0, 0)),
                     (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, val)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # an oversized write fails with EFBIG


def _child(req, sock_fd, hello):
    """The forked child: its socket as fds 1 and 2 and nothing else open, then its uid, folder and
    limits, then the sample. Never returns."""
    try:
        os.dup2(sock_fd, 1)
        os.dup2(sock_fd, 2)
        os.close(0)
        os.closerange(3, 1 << 16)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        confine = hello["isolation"] != "namespaces"
        workdir = req["workdir"]
        uid = hello.get("uid")
        if uid is not None:    # mode none as the host's root: the sample is never root
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError(f"could not become uid {uid}")
        os.chdir(workdir)
        _set_limits(req)
        _run_sample(workdir, hello["read_roots"], confine)
    except BaseException as e:  # confinement failed: say so on the socket, report no result
        try:
            os.write(1, f"\nsandbox setup failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(70)
    os._exit(71)


# --------------------------------------------------------------------------- the zygote

def _start_init():
    """Mode namespaces: the runner made this zygote's children start a new pid namespace; its
    first child is that namespace's init and only waits (for the zygote's end, then the kernel
    kills every process of the namespace). The samples, forked after it, are its siblings: the
    sample's parent (this zygote) is outside its namespace (getppid() is 0), it sees no outside
    process, and signals it sends to init are dropped by the kernel (init has no handler)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
            os.closerange(0, r)
            os.closerange(r + 1, 1 << 16)
            while True:
                try:
                    if not os.read(r, 1):
                        break
                except InterruptedError:
                    continue
                while True:        # reap any orphan
                    try:
                        if os.waitpid(-1, os.WNOHANG)[0] == 0:
                            break
                    except ChildProcessError:
                        break
        finally:
            os._exit(0)
    os.close(r)
    return pid, w


def _wait(pid, pidfd, ctrl, wall_s):
    """Wait for the child until wall_s; kill it past that, or when the runner is gone."""
    deadline = time.monotonic() + wall_s
    timed_out = gone = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        if pidfd is not None:
            ready = select.select([pidfd, ctrl.sock], [], [], left)[0]
            if pidfd in ready:
                break
            if ready:                 # the runner sends nothing while a sample runs: EOF
                gone = True
                break
        else:                         # no pidfd_open (Linux < 5.3): poll
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, False, False
            time.sleep(0.001)
    if timed_out or gone:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    return status, timed_out, gone


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = _Control()
    hello, _ = ctrl.recv()
    n = 0
    for name in PRELOAD + (PRELOAD_UNPRIVILEGED if hello.get("uid") is not None else ()):
        try:
            __import__(name)
            n += 1
        except ImportError:
            pass
    leaked = [m for m in FORBIDDEN_MODULES if m in sys.modules]
    if leaked:
        raise SystemExit(f"sandbox zygote: a preloaded module imported {leaked}")
    if hello["isolation"] == "namespaces":
        # its pid is not needed (the kernel reaps it), nor the pipe's write end: that stays open in
        # this process until the zygote exits, and then the init ends too
        _start_init()
    ctrl.send({"ready": True, "preloaded": n})
    while True:
        try:
            req, fds = ctrl.recv()
        except EOFError:
            return
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            ctrl.send({"status": 70 << 8, "timed_out": False, "error": "no socket for the sample"})
            continue
        pid = os.fork()
        if pid == 0:
            _child(req, fds[0], hello)
        os.close(fds[0])
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None
        try:
            ctrl.send({"pid": pid}, [pidfd] if pidfd is not None else [])
            status, timed_out, gone = _wait(pid, pidfd, ctrl, float(req["wall_s"]))
            if not gone:
                ctrl.send({"status": status, "timed_out": timed_out})
        except OSError:        # the runner is gone: so is its sample
            gone = True
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pidfd is not None:
            os.close(pidfd)
        if gone:
            return


if __name__ == "__main__":
    main()
