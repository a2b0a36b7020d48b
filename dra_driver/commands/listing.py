"""Reading the cluster for the read-only commands (`status`, `explain`): one client for the
whole read, objects listed page by page, progress on stderr, API failures as one clear error;
a resource the server may not serve (a custom resource whose CRD is not installed) read as
absent rather than as a failure.

It must NOT write, cache or interpret what it lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, TypeVar

import click

from dra_driver import kube
from dra_driver.jsontypes import JSON

RESOURCE_API: Final = "/apis/resource.k8s.io/v1"
PAGE: Final = 500

T = TypeVar("T")
Progress = Callable[[str], None]


def progress_on_stderr(line: str) -> None:
    click.echo(f"\r{line}", err=True, nl=False)


def read_cluster(
    kubeconfig: str | None, read: Callable[[kube.ApiClient, Progress], Awaitable[T]], failed: str
) -> T:
    """`read(api, progress)` on one client from `kubeconfig`, closed after; an API, network or
    timeout error becomes a ClickException that starts with `failed`."""

    async def run() -> T:
        api = await kube.load_client(kubeconfig)
        try:
            return await read(api, progress_on_stderr)
        except (kube.ApiException, OSError, TimeoutError) as e:
            raise click.ClickException(f"{failed}: {e}") from None
        finally:
            await api.close()

    result = asyncio.run(run())
    click.echo("\r", err=True, nl=False)
    return result


async def list_all(
    api: kube.ApiClient, path: str, what: str, query: Mapping[str, str], progress: Callable[[str], None]
) -> list[JSON]:
    items, _ = await kube.list_all(
        api, path, query, progress=lambda n: progress(f"reading {what}: {n} so far"), page=PAGE
    )
    return items


async def list_if_served(
    api: kube.ApiClient, path: str, what: str, query: Mapping[str, str], progress: Callable[[str], None]
) -> list[JSON] | None:
    """As `list_all`, but None where the server does not serve `path` (404) or these credentials
    may not list it (403, said on stderr): the command then shows nothing of it."""
    try:
        return await list_all(api, path, what, query, progress)
    except kube.ApiException as e:
        if e.status == 403:
            click.echo(f"\rwarning: {what} cannot be listed with these credentials: not shown", err=True)
            return None
        if e.status == 404:
            return None
        raise
