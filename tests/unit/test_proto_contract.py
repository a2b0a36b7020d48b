"""The kubelet wire contracts: generated stubs against the protocol as the reference states it.

The expected tables below are written from shared/reference/dra-protocol.md §2 (the
kubelet's plugin registration, DRA and DRA health protocols), not read back from the stubs,
so a wrong name, number or type in proto/ fails here. The tests also check that the
committed stubs are what hack/gen-protos.py makes from proto/, and run every service over
a real unix socket through the generated client stubs.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from dra_driver.kubeletapi.dra.v1 import api_pb2 as dra_v1
from dra_driver.kubeletapi.dra.v1 import api_pb2_grpc as dra_v1_grpc
from dra_driver.kubeletapi.drahealth.v1 import api_pb2 as health_v1
from dra_driver.kubeletapi.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from dra_driver.kubeletapi.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2 as reg_v1
from dra_driver.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_v1_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------
# The contract, from the reference. A field is (name, number, type), the type spelled as
# in a .proto file; message and enum types are named relative to the file's package.
# ---------------------------------------------------------------------------------------

Fields = list[tuple[str, int, str]]


@dataclass(frozen=True)
class Method:
    name: str
    input: str
    output: str
    server_streaming: bool = False


@dataclass(frozen=True)
class Contract:
    module: str  # the generated _pb2 module, under dra_driver.kubeletapi
    package: str  # the proto package: it makes up the gRPC method paths
    service: str
    methods: tuple[Method, ...]
    messages: dict[str, Fields]
    enums: dict[str, dict[str, int]]


REGISTRATION_MESSAGES: dict[str, Fields] = {
    "PluginInfo": [
        ("type", 1, "string"),
        ("name", 2, "string"),
        ("endpoint", 3, "string"),
        ("supported_versions", 4, "repeated string"),
    ],
    "RegistrationStatus": [("plugin_registered", 1, "bool"), ("error", 2, "string")],
    "RegistrationStatusResponse": [],
    "InfoRequest": [],
}

DEVICE_V1: Fields = [
    ("request_names", 1, "repeated string"),
    ("pool_name", 2, "string"),
    ("device_name", 3, "string"),
    ("cdi_device_ids", 4, "repeated string"),
    ("share_id", 5, "optional string"),
]


def dra_messages(device: Fields) -> dict[str, Fields]:
    return {
        "NodePrepareResourcesRequest": [("claims", 1, "repeated Claim")],
        "NodePrepareResourcesResponse": [("claims", 1, "map<string, NodePrepareResourceResponse>")],
        "NodePrepareResourceResponse": [("devices", 1, "repeated Device"), ("error", 2, "string")],
        "Device": device,
        "NodeUnprepareResourcesRequest": [("claims", 1, "repeated Claim")],
        "NodeUnprepareResourcesResponse": [("claims", 1, "map<string, NodeUnprepareResourceResponse>")],
        "NodeUnprepareResourceResponse": [("error", 1, "string")],
        "Claim": [("namespace", 1, "string"), ("uid", 2, "string"), ("name", 3, "string")],
    }


DRA_METHODS = (
    Method("NodePrepareResources", "NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
    Method("NodeUnprepareResources", "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"),
)

HEALTH_MESSAGES: dict[str, Fields] = {
    "NodeWatchResourcesRequest": [],
    "DeviceIdentifier": [("pool_name", 1, "string"), ("device_name", 2, "string")],
    "DeviceHealth": [
        ("device", 1, "DeviceIdentifier"),
        ("health", 2, "HealthStatus"),
        ("last_updated_time", 3, "int64"),
        ("health_check_timeout_seconds", 4, "int64"),
        ("message", 5, "string"),
    ],
    "NodeWatchResourcesResponse": [("devices", 1, "repeated DeviceHealth")],
}
HEALTH_ENUMS = {"HealthStatus": {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}}
HEALTH_METHODS = (
    Method("NodeWatchResources", "NodeWatchResourcesRequest", "NodeWatchResourcesResponse", True),
)

CONTRACTS = [
    Contract(
        "pluginregistration.v1.api_pb2",
        "pluginregistration",
        "Registration",
        (
            Method("GetInfo", "InfoRequest", "PluginInfo"),
            Method("NotifyRegistrationStatus", "RegistrationStatus", "RegistrationStatusResponse"),
        ),
        REGISTRATION_MESSAGES,
        {},
    ),
    Contract(
        "dra.v1.api_pb2",
        "k8s.io.kubelet.pkg.apis.dra.v1",
        "DRAPlugin",
        DRA_METHODS,
        dra_messages(DEVICE_V1),
        {},
    ),
    Contract(
        "drahealth.v1alpha1.api_pb2",
        "v1alpha1",
        "DRAResourceHealth",
        HEALTH_METHODS,
        HEALTH_MESSAGES,
        HEALTH_ENUMS,
    ),
    Contract(
        "drahealth.v1.api_pb2", "v1", "DRAResourceHealth", HEALTH_METHODS, HEALTH_MESSAGES, HEALTH_ENUMS
    ),
]

# The full method paths a kubelet calls, verbatim from the reference.
KUBELET_METHOD_PATHS = {
    "pluginregistration.v1.api_pb2": [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ],
    "dra.v1.api_pb2": [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    ],
    "drahealth.v1alpha1.api_pb2": ["/v1alpha1.DRAResourceHealth/NodeWatchResources"],
    "drahealth.v1.api_pb2": ["/v1.DRAResourceHealth/NodeWatchResources"],
}

SCALAR_TYPE_NAMES = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
}


def load(contract: Contract) -> ModuleType:
    return importlib.import_module(f"dra_driver.kubeletapi.{contract.module}")


def relative_name(full_name: str, package: str) -> str:
    return full_name.removeprefix(f"{package}.")


def type_of(field: FieldDescriptor, package: str) -> str:
    """Spells the field's type as a .proto file would, e.g. 'map<string, Foo>', 'optional string'."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        assert field.message_type is not None
        if field.message_type.GetOptions().map_entry:
            key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
            return f"map<{type_of(key, package)}, {type_of(value, package)}>"
        base = relative_name(field.message_type.full_name, package)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        base = relative_name(field.enum_type.full_name, package)
    else:
        base = SCALAR_TYPE_NAMES.get(field.type, f"<protobuf type {field.type}>")
    if field.is_repeated:
        return f"repeated {base}"
    return base


def is_proto3_optional(message: Descriptor, field_name: str) -> bool:
    message_proto = descriptor_pb2.DescriptorProto()
    message.CopyToProto(message_proto)
    return next(f.proto3_optional for f in message_proto.field if f.name == field_name)


def fields_of(message: Descriptor, package: str) -> Fields:
    out: Fields = []
    for field in message.fields:
        spelled = type_of(field, package)
        if is_proto3_optional(message, field.name):
            spelled = f"optional {spelled}"
        out.append((field.name, field.number, spelled))
    return out


# ---------------------------------------------------------------------------------------
# Descriptors against the contract
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.module)
def test_file_is_proto3_in_the_right_package(contract: Contract) -> None:
    file: FileDescriptor = load(contract).DESCRIPTOR
    file_proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(file_proto)
    assert file_proto.syntax == "proto3"
    assert file.package == contract.package
    assert list(file.dependencies) == []  # self-contained: no gogoproto, no well-known types


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.module)
def test_service_and_method_names(contract: Contract) -> None:
    file: FileDescriptor = load(contract).DESCRIPTOR
    assert list(file.services_by_name) == [contract.service]
    service = file.services_by_name[contract.service]
    assert service.full_name == f"{contract.package}.{contract.service}"
    assert [m.name for m in service.methods] == [m.name for m in contract.methods]
    for want in contract.methods:
        method = service.methods_by_name[want.name]
        assert relative_name(method.input_type.full_name, contract.package) == want.input
        assert relative_name(method.output_type.full_name, contract.package) == want.output
        assert method.input_type.full_name == f"{contract.package}.{want.input}"
        assert method.server_streaming is want.server_streaming
        assert method.client_streaming is False
    paths = [f"/{service.full_name}/{m.name}" for m in service.methods]
    assert paths == KUBELET_METHOD_PATHS[contract.module]


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.module)
def test_every_message_field_number_and_type(contract: Contract) -> None:
    file: FileDescriptor = load(contract).DESCRIPTOR
    assert sorted(file.message_types_by_name) == sorted(contract.messages)
    for name, want in contract.messages.items():
        message = file.message_types_by_name[name]
        assert message.full_name == f"{contract.package}.{name}"
        assert fields_of(message, contract.package) == want, name
        # The only nested types are the synthetic entries of map fields.
        assert all(nested.GetOptions().map_entry for nested in message.nested_types), name
        assert not message.enum_types, name
        # No real oneofs; only proto3 `optional` makes its synthetic one.
        optional = {f for f, _, t in want if t.startswith("optional ")}
        assert {o.name for o in message.oneofs} == {f"_{f}" for f in optional}, name


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.module)
def test_enum_values(contract: Contract) -> None:
    file: FileDescriptor = load(contract).DESCRIPTOR
    assert sorted(file.enum_types_by_name) == sorted(contract.enums)
    for name, want in contract.enums.items():
        enum = file.enum_types_by_name[name]
        assert enum.full_name == f"{contract.package}.{name}"
        assert {v.name: v.number for v in enum.values} == want


def test_share_id_has_presence() -> None:
    assert dra_v1.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence


class RecordingChannel:
    """Stands in for a grpc.Channel: records the method paths a generated stub registers."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    def _record(self, kind: str) -> Callable[..., None]:
        def register(path: str, *args: Any, **kwargs: Any) -> None:
            self.paths.append((kind, path))

        return register

    def __getattr__(self, kind: str) -> Callable[..., None]:
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.module)
def test_generated_stub_dials_the_kubelet_paths(contract: Contract) -> None:
    grpc_module = importlib.import_module(f"dra_driver.kubeletapi.{contract.module}_grpc")
    channel = RecordingChannel()
    getattr(grpc_module, f"{contract.service}Stub")(channel)
    kinds = ["unary_stream" if m.server_streaming else "unary_unary" for m in contract.methods]
    assert channel.paths == list(zip(kinds, KUBELET_METHOD_PATHS[contract.module], strict=True))


# ---------------------------------------------------------------------------------------
# The committed stubs are what the generator makes
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_committed_stubs_match_generator() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "gen-protos.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------
# Over the wire: every service on a unix socket, called through the generated stubs
# ---------------------------------------------------------------------------------------


# The servicers are plain classes: the generated add_*_to_server functions look each RPC
# method up by name, so a misspelt or missing one fails at registration.


class Registration:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.statuses: list[tuple[bool, str]] = []

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_v1.PluginInfo(
            type="DRAPlugin",
            name="gpu.dra-driver.dev",
            endpoint=self.endpoint,
            supported_versions=["v1.DRAPlugin", "v1.DRAResourceHealth"],
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.statuses.append((request.plugin_registered, request.error))
        return reg_v1.RegistrationStatusResponse()


def prepared_device(api: ModuleType, claim: Any) -> Any:
    device = api.Device(
        request_names=["gpu"],
        pool_name="node-a",
        device_name=f"gpu-{claim.name}",
        cdi_device_ids=[f"gpu.dra-driver.dev/gpu={claim.uid}-gpu-0"],
    )
    if claim.name == "shared":
        device.share_id = "share-1"
    return device


class DRAPlugin:
    """Serves DRA v1 (`api`, its _pb2 module)."""

    def __init__(self, api: ModuleType) -> None:
        self.api = api

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = self.api.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.name == "broken":
                response.claims[claim.uid].error = "claim broken: not allocated"
            else:
                response.claims[claim.uid].devices.append(prepared_device(self.api, claim))
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = self.api.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].SetInParent()
        return response


class DRAResourceHealth:
    """Serves either health version: `api` is that version's _pb2 module."""

    def __init__(self, api: ModuleType) -> None:
        self.api = api

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        api = self.api
        for status in (api.HEALTHY, api.UNHEALTHY):
            yield api.NodeWatchResourcesResponse(
                devices=[
                    api.DeviceHealth(
                        device=api.DeviceIdentifier(pool_name="node-a", device_name="gpu-0"),
                        health=status,
                        last_updated_time=1_760_000_000,
                        health_check_timeout_seconds=30,
                        message="XID 79" if status == api.UNHEALTHY else "",
                    )
                ]
            )


@pytest.fixture
def socket_path() -> Iterator[str]:
    # tmp_path can exceed the 108-byte limit of a unix socket path; keep it short.
    with tempfile.TemporaryDirectory(prefix="proto-") as directory:
        yield str(Path(directory) / "dra.sock")


async def serve_all(socket_path: str, registration: Registration) -> grpc.aio.Server:
    server = grpc.aio.server()
    reg_v1_grpc.add_RegistrationServicer_to_server(registration, server)
    dra_v1_grpc.add_DRAPluginServicer_to_server(DRAPlugin(dra_v1), server)
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(DRAResourceHealth(health_v1alpha1), server)
    health_v1_grpc.add_DRAResourceHealthServicer_to_server(DRAResourceHealth(health_v1), server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    return server


async def exercise_registration(channel: grpc.aio.Channel, registration: Registration, endpoint: str) -> None:
    stub = reg_v1_grpc.RegistrationStub(channel)
    info = await stub.GetInfo(reg_v1.InfoRequest(), timeout=10)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", "gpu.dra-driver.dev", endpoint)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1.DRAResourceHealth"]
    await stub.NotifyRegistrationStatus(reg_v1.RegistrationStatus(plugin_registered=True), timeout=10)
    await stub.NotifyRegistrationStatus(reg_v1.RegistrationStatus(error="endpoint taken"), timeout=10)
    assert registration.statuses == [(True, ""), (False, "endpoint taken")]


async def exercise_dra(channel: grpc.aio.Channel, api: ModuleType, api_grpc: ModuleType) -> None:
    stub = api_grpc.DRAPluginStub(channel)
    claims = [
        api.Claim(namespace="ns", uid="uid-excl", name="exclusive"),
        api.Claim(namespace="ns", uid="uid-shared", name="shared"),
        api.Claim(namespace="ns", uid="uid-broken", name="broken"),
    ]
    prepared = await stub.NodePrepareResources(api.NodePrepareResourcesRequest(claims=claims), timeout=10)
    assert sorted(prepared.claims) == ["uid-broken", "uid-excl", "uid-shared"]
    assert prepared.claims["uid-broken"].error == "claim broken: not allocated"
    assert not prepared.claims["uid-broken"].devices

    (exclusive,) = prepared.claims["uid-excl"].devices
    assert list(exclusive.request_names) == ["gpu"]
    assert (exclusive.pool_name, exclusive.device_name) == ("node-a", "gpu-exclusive")
    assert list(exclusive.cdi_device_ids) == ["gpu.dra-driver.dev/gpu=uid-excl-gpu-0"]
    (shared,) = prepared.claims["uid-shared"].devices
    # Presence survives the wire: unset and set-to-a-value are told apart.
    assert not exclusive.HasField("share_id")
    assert shared.HasField("share_id")
    assert shared.share_id == "share-1"

    unprepared = await stub.NodeUnprepareResources(
        api.NodeUnprepareResourcesRequest(claims=claims), timeout=10
    )
    assert sorted(unprepared.claims) == ["uid-broken", "uid-excl", "uid-shared"]
    assert all(entry.error == "" for entry in unprepared.claims.values())


async def exercise_health(channel: grpc.aio.Channel, api: ModuleType, api_grpc: ModuleType) -> None:
    stub = api_grpc.DRAResourceHealthStub(channel)
    responses = [r async for r in stub.NodeWatchResources(api.NodeWatchResourcesRequest(), timeout=10)]
    assert [[d.health for d in r.devices] for r in responses] == [[api.HEALTHY], [api.UNHEALTHY]]
    last = responses[-1].devices[0]
    assert (last.device.pool_name, last.device.device_name) == ("node-a", "gpu-0")
    assert (last.last_updated_time, last.health_check_timeout_seconds) == (1_760_000_000, 30)
    assert last.message == "XID 79"


def test_every_service_round_trips_over_a_unix_socket(socket_path: str) -> None:
    async def scenario() -> None:
        registration = Registration(endpoint=socket_path)
        server = await serve_all(socket_path, registration)
        try:
            async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
                await exercise_registration(channel, registration, socket_path)
                await exercise_dra(channel, dra_v1, dra_v1_grpc)
                await exercise_health(channel, health_v1alpha1, health_v1alpha1_grpc)
                await exercise_health(channel, health_v1, health_v1_grpc)
        finally:
            await server.stop(grace=None)

    asyncio.run(scenario())
