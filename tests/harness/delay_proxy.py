"""A TCP relay that delays every byte by a fixed time each way: a far API server, on loopback.

`DelayProxy(target, delay).start()` listens on 127.0.0.1 (an ephemeral port, `port`) and
relays each connection to `target`, holding what it reads for `delay` seconds in each
direction before it writes it on, in order; TLS passes through untouched, so a client
checks the real server's certificate (it names 127.0.0.1). `connections` counts the TCP
connections accepted. It runs its own asyncio loop in a daemon thread, so a test in any
loop, or a plugin process pointed at it, sees the same far server. `stop()` closes the
listener and every relayed connection.

It must NOT look into what it relays, drop or reorder bytes, or add delay beyond `delay`
(reads are written on as soon as their time has come).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class DelayProxy:
    target: tuple[str, int]
    delay: float  # seconds, each way
    port: int = 0
    connections: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _relays: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def start(self) -> DelayProxy:
        ready = threading.Event()
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def listen() -> None:
            self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(listen())
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="delay-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the delay proxy did not start listening within 10 s")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            self._relays.discard(task)
            return
        self._writers.add(up_writer)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                self._writers.discard(w)
            self._relays.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                with contextlib.suppress(OSError):
                    await writer.drain()

        delivering = loop.create_task(deliver())
        try:
            while True:
                try:
                    data = await reader.read(2**16)
                except OSError:
                    data = b""
                queue.put_nowait((loop.time() + self.delay, data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):  # ends both pipes of each relay
                writer.transport.abort()
            if self._relays:
                _, late = await asyncio.wait(list(self._relays), timeout=5)
                for task in late:
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None
