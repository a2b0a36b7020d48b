"""Reading kubeconfigs and the in-cluster service account into API credentials."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import subprocess
from pathlib import Path

import pytest
import yaml

from dra_driver import kube
from dra_driver.kube.credentials import Credentials, from_kubeconfig, in_cluster, static
from tests.harness.kubeconfig import write_kubeconfig


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate (and its key beside it) to stand for the cluster's CA."""
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=test", "-days", "1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "ca.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    return d / "ca.pem"


def _authorization(credentials: Credentials) -> str | None:
    return asyncio.run(credentials.authorization())


def test_a_token_kubeconfig_with_a_relative_ca_file(tmp_path: Path, ca: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(ca.read_bytes())
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": "https://10.0.0.1:6443", "certificate-authority": "ca.crt"},
        {"token": "t0"},
    )
    credentials = asyncio.run(from_kubeconfig(path))
    assert credentials.server == "https://10.0.0.1:6443"
    assert _authorization(credentials) == "Bearer t0"


def test_inline_ca_and_client_certificate_data(tmp_path: Path, ca: Path) -> None:
    def data(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    path = write_kubeconfig(
        tmp_path / "config",
        {"server": "https://api:443", "certificate-authority-data": data(ca)},
        {"client-certificate-data": data(ca), "client-key-data": data(ca.parent / "key.pem")},
    )
    credentials = asyncio.run(from_kubeconfig(path))
    assert _authorization(credentials) is None  # the certificate is the identity
    assert not list(tmp_path.glob("dra-kubeconfig-*")), "no key material left on disk"


def test_a_token_file_is_read_again_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("first\n")
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": "https://api", "insecure-skip-tls-verify": True},
        {"tokenFile": "token"},
    )
    credentials = asyncio.run(from_kubeconfig(path))
    assert _authorization(credentials) == "Bearer first"
    (tmp_path / "token").write_text("rotated\n")
    assert _authorization(credentials) == "Bearer first", "cached within the re-read interval"
    monkeypatch.setattr("dra_driver.kube.credentials.TOKEN_REREAD_SECONDS", -1.0)
    assert _authorization(credentials) == "Bearer rotated"


def test_in_cluster_with_an_ipv6_service_address(tmp_path: Path, ca: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_bytes(ca.read_bytes())
    credentials = in_cluster(
        {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path
    )
    assert credentials.server == "https://[fd00::1]:443"
    assert _authorization(credentials) == "Bearer sa-token"
    client = kube.ApiClient(credentials)
    assert client.address == ("fd00::1", 443)
    assert client._pool.host_header == "[fd00::1]:443"


def test_an_exec_plugin_goes_through_the_official_loader(
    tmp_path: Path, ca: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def credential(token: str) -> str:
        return json.dumps(
            {
                "apiVersion": "client.authentication.k8s.io/v1",
                "kind": "ExecCredential",
                "status": {"token": token},
            }
        )

    (tmp_path / "credential.json").write_text(credential("from-exec"))
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": "https://api:6443", "certificate-authority": str(ca), "tls-server-name": "api.internal"},
        {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": "cat",
                "args": [str(tmp_path / "credential.json")],
                "interactiveMode": "Never",
            }
        },
    )
    credentials = asyncio.run(from_kubeconfig(path))
    assert credentials.server == "https://api:6443"
    assert credentials.server_hostname == "api.internal"
    assert _authorization(credentials) == "Bearer from-exec"
    (tmp_path / "credential.json").write_text(credential("renewed"))
    monkeypatch.setattr("dra_driver.kube.credentials.TOKEN_REREAD_SECONDS", -1.0)
    assert _authorization(credentials) == "Bearer renewed"


def test_a_kubeconfig_without_its_context_says_so(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({"current-context": "gone", "contexts": [], "clusters": [], "users": []}))
    with pytest.raises(ValueError, match="no context named 'gone'"):
        asyncio.run(from_kubeconfig(path))
    with pytest.raises(ValueError, match="http"):
        kube.ApiClient(Credentials("api.example:443", False, static(None)))


def test_tls_server_name_and_insecure_skip_tls_verify_are_read(tmp_path: Path, ca: Path) -> None:
    """The name the server's certificate is checked against; with insecure-skip-tls-verify
    nothing is checked, and the client certificate is still loaded (test_kube_client shows
    both against a TLS server)."""
    path = write_kubeconfig(
        tmp_path / "config",
        {
            "server": "https://10.0.0.1:6443",
            "certificate-authority": str(ca),
            "tls-server-name": "api.internal",
        },
        {"token": "t0"},
    )
    named = asyncio.run(from_kubeconfig(path))
    assert named.server_hostname == "api.internal"
    assert (
        isinstance(named.ssl_context, ssl.SSLContext) and named.ssl_context.verify_mode == ssl.CERT_REQUIRED
    )
    path = write_kubeconfig(
        tmp_path / "config",
        {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True},
        {"client-certificate": str(ca), "client-key": str(ca.parent / "other-key.pem")},
    )
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-out", str(ca.parent / "other-key.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    with pytest.raises(ssl.SSLError):  # the key does not match: proof that the certificate is loaded
        asyncio.run(from_kubeconfig(path))


def test_a_cluster_without_a_server_says_so(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", {"certificate-authority-data": ""}, {"token": "t"})
    with pytest.raises(ValueError, match="has no server"):
        asyncio.run(from_kubeconfig(path))
