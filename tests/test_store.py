"""Tests of the rendezvous store (csrc/store.c): the C unit test, then real client processes on
127.0.0.1, hostile raw-socket clients, rank death detection, Ctrl-C and the default bind address."""
from __future__ import annotations

import hashlib
import hmac
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

import ddpc
from ddpc import _C

from _procs import free_port

# Client processes import the same ddpc as this test process.
ENV = {**os.environ, "PYTHONPATH": str(Path(ddpc.__file__).resolve().parents[1])}

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-7f3a"

# Wire protocol constants, mirrored from the header comment of csrc/store.c.
CMD_SET, CMD_GET, CMD_NUM_KEYS = 1, 2, 8

# Client processes get port, token and their extra arguments in argv.
PRELUDE = """
import sys, time
from ddpc import _C
port, token = int(sys.argv[1]), sys.argv[2]
args = sys.argv[3:]
"""


def spawn(code: str, port: int, *args: str, token: str = TOKEN, env: dict | None = None,
          stdin: int | None = None) -> subprocess.Popen:
    """Starts a client process running PRELUDE + code."""
    return subprocess.Popen([sys.executable, "-c", PRELUDE + code, str(port), token, *args],
                            env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=stdin, text=True)


def finish(p: subprocess.Popen, timeout: float = 20.0) -> str:
    """Waits for a client process, asserts it succeeded, returns its stdout."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"client process hung:\n{out}\n{err}")
    assert p.returncode == 0, f"client process failed ({p.returncode}):\n{out}\n{err}"
    return out


@pytest.fixture
def server() -> Iterator[int]:
    srv = _C.StoreServer("127.0.0.1", 0, TOKEN)
    yield srv.port
    srv.stop()


def client(port: int, token: str = TOKEN, rank: int = -1, timeout: float = 10.0) -> _C.Store:
    return _C.Store("127.0.0.1", port, token, rank, timeout)


# ---------------------------------------------------------------- raw protocol helpers

def raw_connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def auth_answer(greeting: bytes, token: str, rank: int = -1) -> bytes:
    assert len(greeting) == 40 and greeting[:4] == b"DDPC", greeting
    mac = hmac.new(token.encode(), greeting[8:40], hashlib.sha256).digest()
    return greeting[:8] + struct.pack("<i", rank) + mac


def raw_login(port: int, token: str = TOKEN) -> socket.socket:
    """An authenticated raw connection, ready for hand-made frames."""
    s = raw_connect(port)
    s.sendall(auth_answer(recv_exact(s, 40), token))
    assert recv_exact(s, 1) == b"\x01"
    return s


def field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def frame(cmd: int, body: bytes) -> bytes:
    return struct.pack("<IB", 1 + len(body), cmd) + body


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    """True when the server closes s within timeout (whatever it sent first is skipped)."""
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def still_serves(port: int, tag: str) -> None:
    """A fresh good client can write and read back a key."""
    c = client(port)
    c.set(f"alive/{tag}", tag.encode())
    assert c.get(f"alive/{tag}", 5.0) == tag.encode()
    c.close()


# ---------------------------------------------------------------- the C unit test

@pytest.mark.parametrize("sanitize", [False, True], ids=["O1", "asan_ubsan"])
def test_c_unit_test(sanitize: bool) -> None:
    out_dir = ROOT / "tests" / "c" / "bin"
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / ("test_store_asan" if sanitize else "test_store")
    san = (["-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all"] if sanitize else [])
    cmd = ["gcc", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-O1", "-g", *san, "-Icsrc",
           "-pthread", "tests/c/test_store.c", "csrc/store.c", "csrc/common.c", "-o", str(exe)]
    build = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    ours = [ln for ln in build.stderr.splitlines() if "store.c" in ln and "warning" in ln]
    assert not ours, "\n".join(ours)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks passed" in run.stdout


# ---------------------------------------------------------------- commands across processes

WRITER = """
s = _C.Store("127.0.0.1", port, token, 1, 10.0)
s.set("a/val", b"\\x00hello")
assert s.add("ctr", 10) == 10
assert s.compare_set("cas", b"", b"first") == b"first"
s.set("a/tmp", b"gone soon")
s.set("a/ready", b"1")
s.wait(["b/done"], 10.0)
assert s.get("cas", 1.0) == b"second", s.get("cas", 1.0)
assert s.get("ctr", 1.0) == b"15"
assert not s.check(["a/tmp"])
s.close()
print("writer ok")
"""

READER = """
s = _C.Store("127.0.0.1", port, token, 2, 10.0)
assert s.get("a/val", 10.0) == b"\\x00hello"   # waits until the writer has set it
s.wait(["a/ready"], 10.0)
assert s.add("ctr", 5) == 15
assert s.compare_set("cas", b"wrong", b"x") == b"first"
assert s.compare_set("cas", b"first", b"second") == b"second"
assert s.delete_key("a/tmp") is True
assert s.delete_key("a/tmp") is False
assert s.check(["a/val", "ctr"]) and not s.check(["a/val", "nope"])
s.set("b/done", b"1")
s.close()
print("reader ok")
"""


def test_commands_across_processes(server: int) -> None:
    reader = spawn(READER, server)  # first, so its get really waits for the writer
    time.sleep(0.2)
    writer = spawn(WRITER, server)
    assert "reader ok" in finish(reader)
    assert "writer ok" in finish(writer)
    c = client(server)
    assert c.get("ctr", 1.0) == b"15"
    assert c.get("cas", 1.0) == b"second"
    assert sorted(k for k in ("a/val", "a/ready", "b/done", "ctr", "cas")
                  if c.check([k])) == ["a/ready", "a/val", "b/done", "cas", "ctr"]
    assert c.num_keys() == 5
    assert not c.check(["ddpc/dead/1"]) and not c.check(["ddpc/dead/2"])


ADDER = """
s = _C.Store("127.0.0.1", port, token, -1, 10.0)
s.add("started", 1)
s.wait(["go"], 10.0)
print(" ".join(str(s.add("counter", 1)) for _ in range(int(args[0]))))
s.close()
"""


def test_add_is_atomic_across_processes(server: int) -> None:
    nproc, each = 4, 150
    procs = [spawn(ADDER, server, str(each)) for _ in range(nproc)]
    c = client(server)
    deadline = time.monotonic() + 20
    while c.add("started", 0) < nproc:  # start every adder at the same moment
        assert time.monotonic() < deadline, "adder processes did not start"
        time.sleep(0.05)
    c.set("go", b"1")
    seen: List[int] = []
    for p in procs:
        seen += [int(v) for v in finish(p).split()]
    # Every add returned a distinct value: no two processes saw the same count.
    assert sorted(seen) == list(range(1, nproc * each + 1))
    assert c.get("counter", 1.0) == str(nproc * each).encode()


# ---------------------------------------------------------------- authentication

def test_wrong_or_missing_token_is_refused(server: int) -> None:
    good = client(server)
    good.set("secret", b"v")
    nkeys = good.num_keys()
    for bad in ("wrong-token", "", TOKEN + "x", TOKEN[:-1]):
        with pytest.raises(ddpc.AuthError) as ei:
            client(server, token=bad)
        assert "DDPC_TOKEN" in str(ei.value) and isinstance(ei.value, ddpc.DistributedError)

    # A stranger who pipelines commands behind a wrong answer gets none of them executed.
    s = raw_connect(server)
    greeting = recv_exact(s, 40)
    s.sendall(auth_answer(greeting, "wrong-token", rank=5)
              + frame(CMD_SET, field(b"intruder") + field(b"x"))
              + frame(CMD_GET, struct.pack("<I", 0) + field(b"secret")))
    assert closed_by_server(s, 5.0)
    s.close()
    # One that skips authentication and sends a command straight away is dropped too.
    s = raw_connect(server)
    s.sendall(frame(CMD_SET, field(b"intruder2") + field(b"x")) + b"\0" * 64)
    assert closed_by_server(s, 5.0)
    s.close()

    assert good.num_keys() == nkeys
    assert good.get("secret", 1.0) == b"v"
    assert not good.check(["intruder"]) and not good.check(["intruder2"])
    assert not good.check(["ddpc/dead/5"])


def test_server_requires_a_token() -> None:
    with pytest.raises(ValueError, match="token"):
        _C.StoreServer("127.0.0.1", 0, "")


# ---------------------------------------------------------------- hostile input

def test_malformed_input_never_wedges_the_server(server: int) -> None:
    silent = raw_connect(server)                    # connects and says nothing
    half = raw_login(server)                        # authenticated, then half a message
    half.sendall(struct.pack("<I", 100) + bytes([CMD_SET]) + b"123456789")
    still_serves(server, "after-half-message")

    garbage = raw_connect(server)                   # random bytes instead of the answer
    garbage.sendall(os.urandom(4096))
    assert closed_by_server(garbage, 5.0)
    still_serves(server, "after-garbage")

    attacks = {
        "huge length": struct.pack("<I", 0xFFFFFFFF) + b"\x01" * 32,
        "zero length": struct.pack("<I", 0),
        "unknown command": frame(99, b"abc"),
        "field longer than frame": frame(CMD_SET, struct.pack("<I", 1000) + b"k"),
        "oversized key": frame(CMD_SET, field(b"k" * 5000) + field(b"v")),
        "trailing bytes": frame(CMD_NUM_KEYS, b"extra"),
        "random frame": struct.pack("<I", 64) + os.urandom(64),
    }
    for name, payload in attacks.items():
        s = raw_login(server)
        s.sendall(payload)
        if name != "random frame":  # random bytes may by chance form a valid request
            assert closed_by_server(s, 5.0), f"{name}: the server kept the client"
        s.close()
        still_serves(server, name.replace(" ", "-"))

    truncated = raw_login(server)                   # header promises more, then the peer leaves
    truncated.sendall(struct.pack("<I", 5000) + bytes([CMD_SET]) + b"partial")
    truncated.close()
    still_serves(server, "after-truncated")

    # The silent client is dropped after the authentication deadline (a few seconds).
    assert closed_by_server(silent, 10.0)
    still_serves(server, "after-silent")
    half.close()
    silent.close()

    c = client(server)
    assert not c.check(["ddpc/dead/-1"])
    with pytest.raises(ValueError, match="key"):
        c.set("k" * 5000, b"v")
    with pytest.raises(ValueError, match="64 MiB"):
        c.set("big", bytes((64 << 20) + 1))


# ---------------------------------------------------------------- sets posted without waiting

def test_posted_set_refused_is_raised_by_the_next_call() -> None:
    """set_posted returns without a reply; when the store refused it, the next call on the
    connection raises that refusal (its own request was answered), and the connection goes on.
    A hand-made store that refuses the first set (the real one refuses only when out of memory)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    seen: List[bytes] = []

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(b"DDPC" + struct.pack("<I", 1) + os.urandom(32))
            recv_exact(conn, 44)
            conn.sendall(b"\x01")
            for status, payload in ((2, b"no room for it"), (0, b""), (0, b"")):
                (n,) = struct.unpack("<I", recv_exact(conn, 4))
                seen.append(recv_exact(conn, n))
                conn.sendall(struct.pack("<IB", 1 + len(payload), status) + payload)
            recv_exact(conn, 5)  # goodbye

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = client(port)
        t0 = time.monotonic()
        c.set_posted("first", b"1")
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(ValueError) as ei:
            c.set("second", b"2")
        assert "posted earlier" in str(ei.value) and "no room for it" in str(ei.value), ei.value
        c.set("third", b"3")  # the refusal left the connection in step
        c.close()
        t.join(10)
        assert [m[0] for m in seen] == [CMD_SET] * 3
        assert b"first" in seen[0] and b"second" in seen[1] and b"third" in seen[2]
    finally:
        lsock.close()


def test_posted_sets_reach_other_clients(server: int) -> None:
    """Posted sets from one process (more than the 32 replies left unread at once) are there for
    another process, in order: the last of each key wins."""
    c = client(server)
    for i in range(80):
        c.set_posted(f"p/{i % 10}", str(i).encode())
    other = spawn("""
s = _C.Store("127.0.0.1", port, token, -1, 10.0)
print(" ".join(s.get(f"p/{k}", 10.0).decode() for k in range(10)))
s.close()
""", server)
    assert finish(other).split() == [str(70 + k) for k in range(10)]
    with pytest.raises(ValueError, match="at most 4096"):
        c.set_posted("p/big", bytes(5000))
    assert c.get("p/9", 1.0) == b"79"
    c.close()


# ---------------------------------------------------------------- connecting, timeouts

LATE_CLIENT = """
s = _C.Store("127.0.0.1", port, token, -1, 20.0)
s.set("hello", b"world")
s.close()
"""


def test_client_started_before_the_server_connects_when_it_appears() -> None:
    port = free_port()
    p = spawn(LATE_CLIENT, port)
    time.sleep(1.0)
    assert p.poll() is None, "the client gave up before the server started"
    srv = _C.StoreServer("127.0.0.1", port, TOKEN)
    try:
        finish(p)
        assert client(port).get("hello", 1.0) == b"world"
    finally:
        srv.stop()


def test_server_that_never_comes_up_is_named() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ddpc.DistributedTimeoutError) as ei:
        _C.Store("127.0.0.1", port, TOKEN, -1, 0.5)
    assert time.monotonic() - t0 >= 0.45
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "MASTER_ADDR" in msg and "rank 0" in msg


def test_get_and_wait_timeouts_name_the_missing_keys(server: int) -> None:
    c = client(server)
    c.set("present", b"1")
    t0 = time.monotonic()
    with pytest.raises(ddpc.DistributedTimeoutError) as ei:
        c.get("no/such/key", 0.3)
    assert time.monotonic() - t0 >= 0.28
    assert isinstance(ei.value, TimeoutError) and "'no/such/key'" in str(ei.value)
    with pytest.raises(TimeoutError) as ei:
        c.wait(["present", "absent/key"], 0.3)
    assert "'absent/key'" in str(ei.value) and "'present'" not in str(ei.value)
    with pytest.raises(KeyError):
        c.get("no/such/key", 0.0)
    assert c.get("present", 0.0) == b"1"  # the connection is still in step after timeouts


def test_bad_timeouts_keys_and_values_are_refused_and_torch_forms_are_taken(server: int) -> None:
    """A NaN or negative timeout is a ValueError (NaN used to become an undefined int64); a
    timedelta is taken, as torch's store takes it; a str value is stored as UTF-8; a bare str
    as keys is refused rather than waited on letter by letter."""
    import datetime
    c = client(server)
    for bad in (float("nan"), -1.0, -0.5):
        for call in (lambda: c.get("k", bad), lambda: c.wait(["k"], bad),
                     lambda: _C.Store("127.0.0.1", server, TOKEN, -1, bad)):
            with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0 "
                               r"\(float\('inf'\) waits without end\), got "):
                call()
    for bad in ("1", None, True):
        with pytest.raises(TypeError, match="timeout must be a number of seconds or a "
                           "datetime.timedelta, got " + type(bad).__name__):
            c.get("k", bad)
    c.set("text", "héllo")
    assert c.get("text", datetime.timedelta(seconds=1)) == "héllo".encode()
    c.wait(["text"], datetime.timedelta(milliseconds=200))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        c.wait(["absent"], datetime.timedelta(milliseconds=300))
    assert time.monotonic() - t0 >= 0.28
    c2 = _C.Store("127.0.0.1", server, TOKEN, -1, datetime.timedelta(seconds=5))
    assert c2.get("text", 0.0) == "héllo".encode()
    c2.close()
    with pytest.raises(TypeError, match=r"keys must be a list of str, got the str 'text': "
                       r"pass \['text'\]"):
        c.wait("text", 1.0)
    with pytest.raises(TypeError, match="store value must be bytes or str, got int"):
        c.set("k", 5)
    assert c.get("text", 0.0) == "héllo".encode()  # still in step


# ---------------------------------------------------------------- ranks that die

RANK_CLIENT = """
rank = int(args[0])
s = _C.Store("127.0.0.1", port, token, rank, 10.0)
s.set(f"up/{rank}", b"1")
if args[1] == "close":
    s.close()
else:
    time.sleep(60)
"""


def test_killed_rank_is_published_and_clean_close_is_not(server: int) -> None:
    c = client(server)
    victim = spawn(RANK_CLIENT, server, "3", "sleep")
    leaver = spawn(RANK_CLIENT, server, "4", "close")
    c.wait(["up/3"], 15.0)
    t0 = time.monotonic()
    victim.kill()
    c.wait(["ddpc/dead/3"], 5.0)
    assert time.monotonic() - t0 < 3.0
    assert b"rank 3" in c.get("ddpc/dead/3", 1.0)
    assert c.get("ddpc/first_dead", 1.0) == b"3"  # (one key a waiting rank asks)
    victim.communicate()
    finish(leaver)
    assert c.get("up/4", 1.0) == b"1"
    time.sleep(0.5)  # as long as the kill took to be noticed, with margin
    assert not c.check(["ddpc/dead/4"])
    # a second death leaves the first one named
    other = spawn(RANK_CLIENT, server, "5", "sleep")
    c.wait(["up/5"], 15.0)
    other.kill()
    c.wait(["ddpc/dead/5"], 5.0)
    other.communicate()
    assert c.get("ddpc/first_dead", 1.0) == b"3"


def test_a_second_claimant_of_a_rank_is_refused_and_recorded(server: int) -> None:
    """The store refuses a process that registers a rank a live connection holds, and records
    why under ddpc/refused, for the job's ranks that wait for the others."""
    c = client(server)
    holder = client(server, rank=2)
    assert not c.check(["ddpc/refused"])
    with pytest.raises(ddpc.MismatchError, match="two processes claim rank 2"):
        client(server, rank=2)
    why = c.get("ddpc/refused", 5.0).decode()
    assert why.startswith("the store refused a second process claiming rank 2 (from 127.0.0.1:"), why
    holder.close()


# ---------------------------------------------------------------- Ctrl-C

BLOCKED_GET = """
s = _C.Store("127.0.0.1", port, token, -1, 10.0)
print("ready", flush=True)
try:
    s.get("never", 30.0)
except KeyboardInterrupt:
    s.set("after-interrupt", b"1")   # the interrupt fell between requests: still in step
    print("KeyboardInterrupt", flush=True)
"""


def test_sigint_interrupts_a_blocked_get(server: int) -> None:
    p = spawn(BLOCKED_GET, server)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out = finish(p, timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert "KeyboardInterrupt" in out
    assert client(server).get("after-interrupt", 1.0) == b"1"


# ---------------------------------------------------------------- bind address

def listen_addresses(port: int) -> List[str]:
    """Local addresses (hex, as in /proc/net/tcp) of the sockets listening on port."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            found.append(addr)
    return found


def test_server_binds_loopback_unless_told_otherwise() -> None:
    for host in (None, ""):
        srv = _C.StoreServer(host, 0, TOKEN)
        try:
            assert listen_addresses(srv.port) == ["0100007F"]  # 127.0.0.1
        finally:
            srv.stop()
    srv = _C.StoreServer("0.0.0.0", 0, TOKEN)
    try:
        assert listen_addresses(srv.port) == ["00000000"]
    finally:
        srv.stop()


# ---------------------------------------------------------------- the server goes away

SERVER_PROC = """
srv = _C.StoreServer("127.0.0.1", 0, token)
print(srv.port, flush=True)
sys.stdin.read()
"""


def test_waiter_learns_when_the_server_dies_and_debug_log() -> None:
    env = {**ENV, "DDPC_DEBUG": "INFO"}
    srv = spawn(SERVER_PROC, 0, env=env, stdin=subprocess.PIPE)
    port = int(srv.stdout.readline())
    with pytest.raises(ddpc.AuthError):
        client(port, token="wrong")
    c = client(port, rank=0)
    result: List[BaseException] = []

    def waiter() -> None:
        try:
            c.get("never", 20.0)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            result.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.kill()
    t.join(10)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 3.0
    assert len(result) == 1 and isinstance(result[0], ddpc.PeerError), result
    assert "lost the connection" in str(result[0]) and "rank 0" in str(result[0])
    _, err = srv.communicate()
    assert "connection from 127.0.0.1" in err
    assert "authentication failed" in err and "DDPC_TOKEN" in err
    assert "authenticated as rank 0" in err
