"""What a request to the API server answers, whichever protocol carried it: the `Response`
both connection kinds (`dra_driver.kube.transport`'s HTTP/1.1, `dra_driver.kube.http2`'s
HTTP/2) return, and the error for a connection that never opened. Apart from both so that
neither imports the other.

It must NOT hold protocol code (framing, connections): only what callers read.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Final

READ_CHUNK: Final = 2**16
IDLE_SECONDS: Final = 30.0  # an idle connection older than this is closed, not reused


class CouldNotConnect(ConnectionError):
    """The connection could not be opened: the request never left, so any method may repeat it."""


class Response(abc.ABC):
    """An answer whose head has arrived; the body is read with `chunks`, and the caller
    releases it (`async with`)."""

    def __init__(self, status: int, reason: str, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.reason = reason
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        length = self.headers.get("content-length", "")
        self.content_length = int(length) if length.isdigit() else None

    @abc.abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in pieces of at most READ_CHUNK bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Do not read the rest: it is given up when the response is released."""

    @abc.abstractmethod
    def release(self) -> None:
        """Done with the answer: what it held goes back (or is closed)."""

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
