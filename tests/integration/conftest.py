"""Fixtures for tests against a real control plane (etcd, kube-apiserver, scheduler, controller-manager).

One control plane serves the whole session; each test gets its own namespace and
node names so that tests do not see each other's objects.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.objects import create_namespace, sync_client, sync_request

pytestmark = pytest.mark.integration

_counter = itertools.count()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(work_dir=tmp_path_factory.mktemp("cluster"))
    try:
        yield cp
    finally:
        cp.stop(remove=False)


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> client.ApiClient:
    return sync_client(str(control_plane.kubeconfig))


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"t{next(_counter)}-{uuid.uuid4().hex[:6]}"
    create_namespace(api, name)
    yield name
    # Without a kubelet, a bound pod's graceful deletion never finishes and its claims
    # keep their devices: delete pods at once so later tests get the GPUs back.
    sync_request(api, "DELETE", f"/api/v1/namespaces/{name}/pods", query={"gracePeriodSeconds": "0"})
    sync_request(api, "DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def unique() -> str:
    """A short suffix for cluster-scoped names (nodes, classes, slices) owned by one test."""
    return uuid.uuid4().hex[:6]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory for one test's plugin files: UNIX socket paths are limited to 107 bytes and
    pytest's tmp_path is too deep for them. KEEP_TMP=1 keeps it for a look afterwards."""
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield path
    if not os.environ.get("KEEP_TMP"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node_root(short_tmp: Path) -> Path:
    """One plugin's state, CDI and socket directories go under it (a `short_tmp`)."""
    return short_tmp
