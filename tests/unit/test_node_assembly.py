"""The node daemon's assembly: `dra-driver kubelet-plugin` fills `NodeOptions` directly (one
field per click parameter, nothing copied), its refusals, what the daemon imports before it
registers with the kubelet, the publisher lease's wait, and the start benchmark's CPU reading."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from benchmarks.start import cpu_seconds
from dra_driver.commands.kubelet_plugin import kubelet_plugin
from dra_driver.node.options import NodeOptions
from dra_driver.plugin.lock import Lease


def test_every_option_is_a_field_of_the_options_object() -> None:
    params = {p.name for p in kubelet_plugin.params}
    fields = {f.name for f in dataclasses.fields(NodeOptions)}
    assert params == fields, f"only options: {params - fields}; only fields: {fields - params}"


def test_defaults_derived_from_other_options() -> None:
    opts = NodeOptions("n", "gpu.example.com", Path("/k"), Path("/c"), memory_shares_only=True,
                       simulate="l4", dynamic_mig=True)
    assert opts.state == Path("/run/gpu.example.com/state")
    assert opts.shares, "--memory-shares-only implies --memory-shares"
    assert opts.simulated_mig_state == Path("/run/gpu.example.com/state/simulated-mig.json")
    assert opts.health is not None and opts.health.max_effect == "NoSchedule"
    assert NodeOptions("n", "d", Path("/k"), Path("/c"), health_monitor=False).health is None


def test_simulated_health_events_need_simulated_gpus(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        kubelet_plugin, ["--node-name", "n", "--simulate-health-events", str(tmp_path / "events")]
    )
    assert result.exit_code == 2, result.output
    assert "--simulate-health-events" in result.output and "only with --simulate" in result.output


_IMPORTED_AT_REGISTRATION = """
import json, sys
import dra_driver.commands.kubelet_plugin
print(json.dumps(sorted(sys.modules)))
"""


def test_the_slice_publisher_and_probe_server_are_not_imported_before_registration() -> None:
    """What the command imports before it runs: the publisher (with its API capability checks)
    and the probe server come after the kubelet registration."""
    done = subprocess.run([sys.executable, "-c", _IMPORTED_AT_REGISTRATION], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    modules = set(json.loads(done.stdout))
    early = {m for m in modules if m.startswith(("controller", "dra_driver.probes"))}
    assert not early, f"imported before registration: {sorted(early)}"


_IMPORTED_BY_THE_DAEMON = """
import json, sys
import dra_driver.commands.kubelet_plugin, dra_driver.node.daemon, dra_driver.probes
import dra_driver.node.publishing
print(json.dumps(sorted(sys.modules)))
"""


def test_the_daemon_never_imports_aiohttp() -> None:
    """aiohttp is installed (the kubernetes package depends on it) but the daemon's HTTP is
    h11's: imported, aiohttp and its helpers held 11 MiB of every node's memory. h2 is
    imported only once an API server chose HTTP/2 (dra_driver.kube.transport), not at start."""
    done = subprocess.run([sys.executable, "-c", _IMPORTED_BY_THE_DAEMON], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    modules = set(json.loads(done.stdout))
    assert "h11" in modules and "dra_driver.kube.transport" in modules
    assert not {"h2", "hpack", "hyperframe", "dra_driver.kube.http2"} & modules, "h2 imported at start"
    heavy = {m for m in modules if m.split(".")[0] in ("aiohttp", "yarl", "multidict", "kubernetes")}
    assert not heavy, f"the daemon imports {sorted(heavy)}"


def test_the_second_lease_holder_waits_until_the_first_releases(tmp_path: Path) -> None:
    async def main() -> None:
        first, second = Lease(tmp_path / "lease"), Lease(tmp_path / "lease")
        assert first.try_acquire()
        told = asyncio.Event()
        waiting = asyncio.create_task(second.wait_held(0.01, told.set))
        await asyncio.wait_for(told.wait(), 5)
        assert not waiting.done() and not second.held
        first.release()
        await asyncio.wait_for(waiting, 5)
        assert second.held
        second.release()

    asyncio.run(main())


def test_start_benchmark_reads_this_process_cpu() -> None:
    before, times_before = cpu_seconds(os.getpid()), os.times()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after, times_after = cpu_seconds(os.getpid()), os.times()
    spent = (times_after.user + times_after.system) - (times_before.user + times_before.system)
    assert after - before >= 0.25
    assert abs((after - before) - spent) < 0.05
