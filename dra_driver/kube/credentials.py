"""Where the API server is and who we are to it (`Credentials`), from a kubeconfig or the pod.

The in-cluster service account is read here (its token re-read as the kubelet rotates it),
and so are kubeconfigs with a token, a token file, client certificates,
insecure-skip-tls-verify and tls-server-name. Exec plugins, auth providers and basic auth go
through the official loader, imported only for them: the whole generated client would add
to every plugin's start-up and memory, and a plugin in a pod never needs it.

It must not open connections or send requests (`dra_driver.kube` does), nor cache a token
past TOKEN_REREAD_SECONDS.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dra_driver.jsontypes import JSON

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0  # bound service-account tokens are rotated by the kubelet

Authorization = Callable[[], Awaitable[str | None]]
Material = tuple[str | None, bytes | None]  # a file path, or the bytes themselves


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and who we are to it, as read from a kubeconfig or a pod."""

    server: str
    ssl_context: ssl.SSLContext | bool  # True: system CAs; False: no verification, no client cert
    authorization: Authorization
    server_hostname: str | None = None  # tls-server-name: the name the server's certificate must carry


def static(value: str | None) -> Authorization:
    async def authorization() -> str | None:
        return value

    return authorization


def _token_file(path: Path) -> Authorization:
    """A bearer token re-read now and then: the kubelet rotates projected tokens in place."""
    cached: list[tuple[float, str]] = []

    async def authorization() -> str | None:
        now = time.monotonic()
        if not cached or now - cached[0][0] > TOKEN_REREAD_SECONDS:
            cached[:] = [(now, path.read_text().strip())]
        return f"Bearer {cached[0][1]}"

    return authorization


def unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def _tls(verify: bool, ca: Material, cert: Material, key: Material) -> ssl.SSLContext:
    """The TLS side of a kubeconfig. The client certificate is loaded whether or not the
    server's is verified: with insecure-skip-tls-verify it is still who we are."""
    if verify:
        ca_file, ca_data = ca
        context = ssl.create_default_context(
            cafile=ca_file, cadata=ca_data.decode() if ca_data is not None else None
        )
    else:
        context = unverified()
    (cert_file, cert_data), (key_file, key_data) = cert, key
    if cert_file is None and cert_data is None:
        return context
    with tempfile.TemporaryDirectory(prefix="dra-kubeconfig-") as tmp:  # ssl reads only files
        if cert_data is not None:
            cert_file = str(Path(tmp) / "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = str(Path(tmp) / "key.pem")
            Path(key_file).write_bytes(key_data)
        assert cert_file is not None
        context.load_cert_chain(cert_file, key_file)
    return context


def in_cluster(env: Mapping[str, str], account: Path) -> Credentials:
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return Credentials(
        server=f"https://{host}:{port}",
        ssl_context=ssl.create_default_context(cafile=str(account / "ca.crt")),
        authorization=_token_file(account / "token"),
    )


def _entry(doc: JSON, kind: str, name: str, where: Path) -> JSON:
    for item in doc.get(f"{kind}s") or []:
        if item.get("name") == name:
            found: JSON = item.get(kind) or {}
            return found
    raise ValueError(f"kubeconfig {where}: no {kind} named {name!r}")


def _material(section: JSON, key: str, base: Path) -> Material:
    """A file path (relative to the kubeconfig) or inline base64 data, as the kubeconfig has it."""
    if section.get(f"{key}-data"):
        return None, base64.b64decode(section[f"{key}-data"])
    if section.get(key):
        return str(base / section[key]), None
    return None, None


async def from_kubeconfig(path: Path) -> Credentials:
    import yaml  # here: a plugin in a pod uses its service account and never needs YAML

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read kubeconfig {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"kubeconfig {path} is not a YAML mapping")
    context = _entry(doc, "context", doc.get("current-context", ""), path)
    cluster = _entry(doc, "cluster", context.get("cluster", ""), path)
    user = _entry(doc, "user", context.get("user", ""), path)
    if "server" not in cluster:
        raise ValueError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")
    if any(k in user for k in ("exec", "auth-provider", "username")):
        return await _through_official_loader(path, user)
    base = path.parent
    tls = _tls(
        verify=not cluster.get("insecure-skip-tls-verify"),
        ca=_material(cluster, "certificate-authority", base),
        cert=_material(user, "client-certificate", base),
        key=_material(user, "client-key", base),
    )
    if user.get("token"):
        authorization = static(f"Bearer {user['token']}")
    elif user.get("tokenFile"):
        authorization = _token_file(base / user["tokenFile"])
    else:
        authorization = static(None)
    return Credentials(cluster["server"], tls, authorization, cluster.get("tls-server-name") or None)


async def _through_official_loader(path: Path, user: JSON) -> Credentials:
    """Kubeconfigs with exec plugins, auth providers or basic auth: the official client's
    loader. An exec plugin's token is fetched again every TOKEN_REREAD_SECONDS (the loader
    keeps it until its expiry, if the plugin gave one). A client certificate that an exec
    plugin gives is read once, at start."""
    from kubernetes.aio import client, config  # heavy: imported only for these kubeconfigs

    cfg = client.Configuration()
    loader = await config.load_kube_config(
        config_file=str(path), client_configuration=cfg, persist_config=False
    )
    tls = _tls(
        verify=bool(cfg.verify_ssl),
        ca=(cfg.ssl_ca_cert, None),
        cert=(cfg.cert_file, None),
        key=(cfg.key_file, None),
    )
    fetched = [time.monotonic()]

    async def authorization() -> str | None:
        now = time.monotonic()
        if "exec" in user and now - fetched[0] > TOKEN_REREAD_SECONDS:
            await loader.load_from_exec_plugin()  # a plugin that fails logs and leaves the old token
            cfg.api_key["BearerToken"] = getattr(loader, "token", None) or cfg.api_key.get("BearerToken")
            fetched[0] = now
        header: str | None = cfg.api_key.get("BearerToken")
        if header is None and cfg.username:
            header = cfg.get_basic_auth_token()
        return header

    return Credentials(cfg.host, tls, authorization, getattr(cfg, "tls_server_name", None) or None)
