"""Socket and data paths as the kubelet expects them, including rolling-update names."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.plugin.sockets import MAX_SOCKET_PATH, plugin_paths, prepare_socket_path


def test_default_paths() -> None:
    paths = plugin_paths(Path("/var/lib/kubelet"), DRIVER)
    assert paths.registration_socket == Path("/var/lib/kubelet/plugins_registry/gpu.dra-driver.dev-reg.sock")
    assert paths.dra_socket == Path("/var/lib/kubelet/plugins/gpu.dra-driver.dev/dra.sock")
    assert paths.data_dir == Path("/var/lib/kubelet/plugins/gpu.dra-driver.dev")


def test_rolling_update_names_carry_the_pod_uid() -> None:
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    paths = plugin_paths(Path("/var/lib/kubelet"), DRIVER, uid)
    assert paths.registration_socket.name == f"{DRIVER}-{uid}-reg.sock"
    assert paths.dra_socket.name == f"dra-{uid}.sock"
    other = plugin_paths(Path("/var/lib/kubelet"), DRIVER, "another-uid")
    assert other.registration_socket != paths.registration_socket


def test_long_names_fall_back_to_hashes_that_fit() -> None:
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    driver = "a-very-long-driver-name.example.com"
    paths = plugin_paths(Path("/var/lib/kubelet"), driver, uid)
    assert len(f"/var/lib/kubelet/plugins_registry/{driver}-{uid}-reg.sock") > MAX_SOCKET_PATH
    assert len(str(paths.registration_socket)) <= MAX_SOCKET_PATH
    assert paths.registration_socket.name.startswith(driver) and uid not in paths.registration_socket.name


def test_stale_socket_is_replaced_but_a_regular_file_is_not(tmp_path: Path) -> None:
    stale = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(stale))
    sock.close()
    prepare_socket_path(stale)
    assert not stale.exists()
    regular = tmp_path / "file.sock"
    regular.write_text("user data")
    with pytest.raises(FileExistsError, match="not a socket"):
        prepare_socket_path(regular)
    assert regular.read_text() == "user data"
