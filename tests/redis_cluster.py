"""Redis servers of the tests' own: a real three-node Redis Cluster, started once per test
session on free loopback ports and stopped when the session ends, and private single servers.

``cluster()`` starts it lazily (three ``redis-server --cluster-enabled yes`` child processes,
then ``redis-cli --cluster create``, then a wait for ``cluster_state:ok``) and returns its
startup nodes; the next calls return the same cluster. ``shutdown()`` stops it: it runs from a
pytest session finalizer where one is registered, and from ``atexit`` always. The servers are
also started with a parent-death signal, so even a SIGKILLed test run leaves no orphan
``redis-server`` behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "ClusterUnavailable", "cluster", "private_server", "running", "shutdown"]

_NODES = 3
_PR_SET_PDEATHSIG = 1


class ClusterUnavailable(RuntimeError):
    """The binaries are missing or the cluster did not form; the message says why."""


@dataclass(frozen=True)
class Cluster:
    ports: tuple[int, ...]
    directory: Path
    processes: tuple[subprocess.Popen[bytes], ...]

    @property
    def url(self) -> str:
        """A store URL for this cluster (any node is a startup node)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0?cluster=true"

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


class _State:
    lock = threading.Lock()
    running: Cluster | None = None
    failure: str | None = None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM to the server when the
    # test process dies, however it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int = _NODES) -> list[int]:
    """Ports P whose cluster bus port P + 10000 is free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 10_000 < 65_536 and port not in ports and _free(port + 10_000):
            ports.append(port)
    return ports


def _spawn(port: int, directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A ``redis-server`` child on ``port`` that keeps nothing on disk and dies with us."""
    command = [
        *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
        *("--save", "", "--appendonly", "no", "--daemonize", "no"),
        *("--dir", str(directory), "--logfile", str(directory / f"redis-{port}.log")),
        *extra,
    ]
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads start servers
    )


@contextlib.contextmanager
def private_server() -> Iterator[int]:
    """A single Redis of the caller's own on a free port (for tests that must count its
    commands or put it in a bad state): yields the port, stops it at the end."""
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            raise ClusterUnavailable(f"{binary} is not installed")
    directory = Path(tempfile.mkdtemp(prefix="oncely-redis-"))
    port = _free_ports(1)[0]
    process = _spawn(port, directory)
    try:
        _wait(f"PING on {port}", lambda: "PONG" in _cli(port, "ping"), 10)
        yield port
    finally:
        _stop(Cluster((port,), directory, (process,)))


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


def _wait(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    raise ClusterUnavailable(f"a test Redis did not become ready: {what}")


def _start() -> Cluster:
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            raise ClusterUnavailable(f"{binary} is not installed")
    directory = Path(tempfile.mkdtemp(prefix="oncely-redis-cluster-"))
    ports = _free_ports()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            processes.append(
                _spawn(
                    port,
                    directory,
                    *("--cluster-enabled", "yes", "--cluster-node-timeout", "5000"),
                    *("--cluster-config-file", str(directory / f"nodes-{port}.conf")),
                )
            )
        for port in ports:
            _wait(f"PING on {port}", lambda port=port: "PONG" in _cli(port, "ping"), 10)
        created = subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{port}" for port in ports]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise ClusterUnavailable(f"redis-cli --cluster create failed: {created.stdout}")
        for port in ports:
            _wait(
                f"cluster_state:ok on {port}",
                lambda port=port: "cluster_state:ok" in _cli(port, "cluster", "info"),
                30,
            )
    except BaseException:
        _stop(Cluster(tuple(ports), directory, tuple(processes)))
        raise
    return Cluster(tuple(ports), directory, tuple(processes))


def _stop(running: Cluster) -> None:
    for process in running.processes:
        if process.poll() is None:
            process.terminate()
    for process in running.processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    shutil.rmtree(running.directory, ignore_errors=True)


def cluster() -> Cluster:
    """The session's cluster, started on first use. Raises :class:`ClusterUnavailable` (the
    same error on every later call) when it cannot be started."""
    with _State.lock:
        if _State.running is not None:
            return _State.running
        if _State.failure is not None:
            raise ClusterUnavailable(_State.failure)
        try:
            _State.running = _start()
        except ClusterUnavailable as exc:
            _State.failure = str(exc)
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            _State.failure = f"starting the test Redis Cluster failed: {exc}"
            raise ClusterUnavailable(_State.failure) from exc
        return _State.running


def running() -> Cluster | None:
    """The cluster if it was started and not yet stopped."""
    return _State.running


def shutdown() -> None:
    """Stop the cluster if it runs (idempotent)."""
    with _State.lock:
        stopping, _State.running = _State.running, None
    if stopping is not None:
        with contextlib.suppress(Exception):
            _stop(stopping)


atexit.register(shutdown)
