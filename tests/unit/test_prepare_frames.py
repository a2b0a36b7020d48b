"""The frame list in `dra_driver.plugin.state`'s docstring is the code's: a real Prepare and
Unprepare through the gRPC service (simulated L4 GPUs, a real grpc.aio server on a UNIX
socket) are profiled, and the frames from the first of ours (the gRPC server's, which calls
the handler) to the CDI file's write (or removal) and to the checkpoint's save must be
exactly those the docstring lists, in order.

The hop into the worker thread (`asyncio.to_thread`) is stitched: the frames above the
`to_thread` call on the event loop, then the worker's frames from the function it was given.
Every frame between the handler and the target counts, ours or a library's, so a wrapper,
a decorator or a callback added on the way fails this test.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import grpc
import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.cdi import files
from dra_driver.devices import node_devices
from dra_driver.driver_root import simulated_driver_files
from dra_driver.gpu import discover
from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.plugin import checkpoint, state
from dra_driver.plugin.claim_steps import ClaimSteps
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.server import SocketServer
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import with_spec

NODE = "node-a"
REF = ClaimRef("team", "train", "0f0f0f0f-0000-0000-0000-000000000001")
TARGETS = {"CDI file": {"prepare": files.write_spec, "unprepare": files.remove_claim_spec},
           "checkpoint": {"prepare": checkpoint.save, "unprepare": checkpoint.save}}
MAX_FRAMES = 10


def documented() -> dict[tuple[str, str], list[str]]:
    """The docstring's lists: (verb, target) -> frames, top-down."""
    lists: dict[tuple[str, str], list[str]] = {}
    verb = target = ""
    for line in (state.__doc__ or "").splitlines():
        if line.startswith(("A Prepare", "An Unprepare")):
            verb = "prepare" if "A Prepare" in line else "unprepare"
            continue
        header = re.match(r"\s+to the (CDI file|checkpoint):(?: frames 1-(\d+), then)?\s*$", line)
        if header:
            target = header.group(1)
            shared = int(header.group(2) or 0)
            lists[(verb, target)] = list(lists[(verb, "CDI file")][:shared]) if shared else []
            continue
        frame = re.match(r"\s+(\d+) ([\w.<>]+)", line)
        if frame and verb and target:
            frames = lists[(verb, target)]
            assert int(frame.group(1)) == len(frames) + 1, f"frame numbers out of order at: {line!r}"
            frames.append(frame.group(2))
    return lists


def _name(frame: FrameType) -> str:
    module = str(frame.f_globals.get("__name__", "?"))
    return f"{module.removeprefix('dra_driver.')}.{frame.f_code.co_qualname}"


def _ours(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("dra_driver.")


def _down_from_first_of_ours(frame: FrameType | None) -> list[FrameType]:
    """The stack ending at `frame`, top-down, from the outermost frame of ours."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    stack.reverse()
    first = next((i for i, f in enumerate(stack) if _ours(f)), len(stack))
    return stack[first:]


def _code_of(func: Any) -> CodeType | None:
    return getattr(getattr(func, "__func__", func), "__code__", None)


class Recorder:
    """A profile hook on the loop and the worker threads: the frames down to each target."""

    def __init__(self) -> None:
        self.targets = {f.__code__: f for by_verb in TARGETS.values() for f in by_verb.values()}
        self.hops: dict[CodeType, list[str]] = {}  # the function given to to_thread -> frames above
        self.seen: list[tuple[Any, list[str]]] = []  # (target function, frames top-down)
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is asyncio.to_thread.__code__:
            func = _code_of(frame.f_locals.get("func"))
            if func is not None and frame.f_back is not None:
                with self.lock:
                    self.hops[func] = [_name(f) for f in _down_from_first_of_ours(frame.f_back)]
        elif code in self.targets:
            stack = _down_from_first_of_ours(frame)
            above = self.hops.get(stack[0].f_code, []) if stack else []
            with self.lock:
                self.seen.append((self.targets[code], above + [_name(f) for f in stack]))

    def of(self, target: Any) -> list[list[str]]:
        return [frames for t, frames in self.seen if t is target]


class Claims:
    """The API server, as a dict."""

    def __init__(self, claims: dict[str, Any]) -> None:
        self.claims = claims

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, Any | ClaimRejected]:
        return {r.uid: with_spec(self.claims[r.uid]) for r in refs}

    async def allocated_here(self, driver: str, pool: str) -> list[Any] | None:
        return list(self.claims.values())


class QuietBoard:
    async def follow(self):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()
        yield ()


@pytest.fixture
def profiled() -> Iterator[Recorder]:
    recorder = Recorder()
    sys.setprofile(recorder)
    threading.setprofile(recorder)  # the worker threads asyncio.run's fresh executor starts
    try:
        yield recorder
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def prepare_and_unprepare(root: Path, recorder: Recorder) -> None:
    inventory = discover("l4x4")
    claim = {
        "metadata": {"namespace": REF.namespace, "name": REF.name, "uid": REF.uid},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}]}}},
    }
    preparer = NodePreparer(
        driver=DRIVER, pool=NODE, devices=node_devices(inventory), claims=Claims({REF.uid: claim}),
        driver_files=simulated_driver_files([g.minor for g in inventory.gpus]), cdi_dir=root / "cdi",
        state_dir=root / "state", boot_id="boot-1",
        sharing=Sharing(DRIVER, NODE, MpsControl(root / "mps", "/nonexistent-driver-root")),
    )
    (root / "state").mkdir()
    wire = dra_v1.Claim(namespace=REF.namespace, name=REF.name, uid=REF.uid)

    async def scenario() -> None:
        socket = root / "dra.sock"
        server = SocketServer("dra", lambda s: add_dra_services(s, preparer, QuietBoard()))  # type: ignore[arg-type]
        await server.start(socket)
        try:
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                stub = dra_v1_grpc.DRAPluginStub(channel)
                answer = await stub.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(claims=[wire]))
                assert not answer.claims[REF.uid].error, answer.claims[REF.uid].error
                assert list(root.glob("cdi/*.json")), "no CDI spec written"
                request = dra_v1.NodeUnprepareResourcesRequest(claims=[wire])
                answer = await stub.NodeUnprepareResources(request)
                assert not answer.claims[REF.uid].error, answer.claims[REF.uid].error
        finally:
            await server.stop(None)

    asyncio.run(scenario())


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="frames-") as directory:  # tmp_path can exceed 107 bytes
        yield Path(directory)


def test_the_docstring_lists_every_path_in_at_most_ten_frames() -> None:
    lists = documented()
    assert set(lists) == {(v, t) for v in ("prepare", "unprepare") for t in TARGETS}
    for key, frames in lists.items():
        assert frames[0] == "plugin.server._Bounded._wrap.<locals>.unary", key  # grpcio calls it
        assert frames[1].startswith("plugin.service._DraService.Node"), key  # the handler
        assert 0 < len(frames) <= MAX_FRAMES, (key, frames)


@pytest.mark.parametrize("verb", ["prepare", "unprepare"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_the_code_takes_the_documented_frames(root: Path, profiled: Recorder, verb: str, target: str) -> None:
    prepare_and_unprepare(root, profiled)
    wanted = documented()[(verb, target)]
    seen = [frames for frames in profiled.of(TARGETS[target][verb]) if wanted[1] in frames]  # its handler
    assert seen, f"no {target} reached from {wanted[1]}"
    for frames in seen:
        assert frames == wanted, "the code's frames:\n  " + "\n  ".join(frames)


def test_a_wrapper_on_the_way_is_caught(
    root: Path, profiled: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ClaimSteps.write_spec

    def wrapper(self: ClaimSteps, *args: Any) -> None:
        original(self, *args)

    monkeypatch.setattr(ClaimSteps, "write_spec", wrapper)
    prepare_and_unprepare(root, profiled)
    [frames] = [f for f in profiled.of(files.write_spec) if "NodePrepareResources" in f[1]]
    assert frames != documented()[("prepare", "CDI file")]
    assert f"{__name__}.test_a_wrapper_on_the_way_is_caught.<locals>.wrapper" in frames
