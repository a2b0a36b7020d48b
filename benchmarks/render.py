"""Renders docs/performance.md from the measured files in benchmarks/results/*.json.

`python -m benchmarks.render` rewrites the page; `python -m benchmarks.render --check` exits 1
if the committed page differs from what the files give (tests/unit/test_performance_page.py
does the same in `make test`). Every figure on the page comes from a results file, so the page
cannot drift from what was measured; each table says the commit, date, load and command the
file records, and says so where the file records none.

It must NOT measure anything, read git, the clock or the machine (the page would then change
without a results file changing), nor carry a figure of its own: the words here are labels.
A results file it has no layout for is still rendered, as a flat table of its values.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

Row = tuple[str, ...]


class ResultsError(ValueError):
    """A results file lacks a value its layout shows: re-run the benchmark or fix the layout."""


def get(data: Any, path: str) -> Any:
    """`data` at a dotted path (`current.prepare_sequential.p50_ms`, `runs.0.started`)."""
    value = data
    for key in path.split("."):
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ResultsError(f"no value at {path!r} (missing {key!r})") from e
    return value


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return f"{fmt(value[0])}-{fmt(value[1])}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items()) or "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Row, rows: Iterable[Row]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def values(data: Any, rows: Sequence[tuple[str, str]]) -> list[str]:
    return table(("what", "measured"), ((label, fmt(get(data, path))) for label, path in rows))


# -- provenance -------------------------------------------------------------------------

_PROVENANCE = (
    ("commit", "measured.commit"),
    ("date", "measured.date"),
    ("load average (1 min) at the end", "measured.load_average_1m"),
    ("cores", "measured.cores"),
    ("host", "measured.host"),
    ("command", "measured.command"),
    ("commit", "commit"),
    ("code", "plugin_code"),
    ("code", "code.current"),
    ("compared with", "code.baseline"),
    ("and with", "code.nvidia"),
    ("compared with", "baseline.ref"),
    ("date", "date"),
    ("host", "host"),
    ("machine", "machine"),
    ("contention note", "contention"),
    ("command", "command"),
    ("what", "what"),
)


def provenance(data: Any) -> list[str]:
    found = []
    for label, path in _PROVENANCE:
        try:
            found.append(f"{label}: {fmt(get(data, path))}")
        except ResultsError:
            continue
    missing = [
        word
        for word, paths in (
            ("commit", ("measured.commit", "commit", "plugin_code", "code.current")),
            ("date", ("measured.date", "date")),
        )
        if not any(_has(data, p) for p in paths)
    ]
    if missing:
        found.append(" and ".join(missing) + ": not recorded in the file")
    return ["Measured at: " + "; ".join(found) + ".", ""]


def _has(data: Any, path: str) -> bool:
    try:
        get(data, path)
    except ResultsError:
        return False
    return True


# -- layouts, one per results file --------------------------------------------------------


def _prepare(d: Any) -> list[str]:
    rows: list[Row] = []
    cycles = next((k for k in d["current"] if k.startswith("rss_kib_after_") and k.endswith("_cycles")),
                  "rss_kib_after_1000_cycles")
    n = int(cycles.removeprefix("rss_kib_after_").removesuffix("_cycles"))
    for label, key in (
        ("Prepare, one at a time", "prepare_sequential"),
        ("Unprepare, one at a time", "unprepare_sequential"),
        ("Prepare, 16 at once", "prepare_16_concurrent"),
        ("Unprepare, 16 at once", "unprepare_16_concurrent"),
        ("an empty call", "plugin_empty_call"),
        ("an empty call, 16 at once", "plugin_empty_16_concurrent"),
    ):
        rows.append(
            tuple(
                [label]
                + [
                    fmt(get(d, f"{side}.{key}.{q}"))
                    for side in ("current", "baseline")
                    for q in ("p50_ms", "p99_ms")
                ]
            )
        )
    for label, key in (
        ("start to registered (s)", "start_to_registered_s"),
        ("CPU from exec to registered (s)", "start_cpu_s"),
        ("CPU per Prepare (ms)", "cpu_ms_per_prepare"),
        ("CPU per Unprepare (ms)", "cpu_ms_per_unprepare"),
        ("CPU per cycle of a pod that lives 1 s, status writes included (ms)", "cpu_ms_per_paced_cycle"),
        ("CPU when idle (ms per s)", "idle_cpu_ms_per_second"),
        ("RSS after warm-up (KiB)", "rss_kib_after_warmup"),
        (f"RSS after {n:,} more cycles (KiB)", cycles),
    ):
        if key.startswith(("start_cpu", "cpu_", "idle_")) and key not in d["current"]:
            continue  # results from before these were measured
        rows.append((label, fmt(get(d, f"current.{key}")), "", fmt(get(d, f"baseline.{key}")), ""))
    lines = table(("call (ms)", "current p50", "current p99", "baseline p50", "baseline p99"), rows)
    floor = [
        (name, fmt(get(d, f"floor.{name}.p50_ms")), fmt(get(d, f"floor.{name}.p99_ms")))
        for name in get(d, "floor")
    ]
    lines += ["The machine's floor in the same run (ms):", "", *table(("call", "p50", "p99"), floor)]
    if "profile" in d.get("current", {}):
        lines += ["Where ours spends its CPU (its first start, `--profile`):", "",
                  *_profile(d["current"]["profile"])]
    return lines


def _profile(windows: Any) -> list[str]:
    """benchmarks.plugin_profile windows: per-thread CPU, and the Python samples' shares by
    package (plugin_profile._charged_area) and by function (the leaf)."""
    lines: list[str] = []
    for name, w in windows.items():
        samples = w["samples"]
        threads = ", ".join(f"{t['name']} {fmt(t['cpu_ms'])}" for t in w["threads"][:8]) or "none"
        lines += [f"- **{name}**: {fmt(w['seconds'])} s, {fmt(w['process_cpu_ms'])} ms of CPU (threads, ms: "
                  f"{threads}); {fmt(samples.get('samples', 0))} samples holding the GIL"
                  + (f" ({samples['error']})" if "error" in samples else "")]
        for what, key in (("package", "area"), ("function, self", "self")):
            shares = "; ".join(f"{k} {v:.0%}" for k, v in samples.get(key, [])[:8])
            if shares:
                lines.append(f"  - by {what}: {shares}")
    return [*lines, ""]


def _node_rss(d: Any) -> list[str]:
    """The figures, where the RSS is, and with --profile where the CPU goes."""
    flat = {k: v for k, v in d.items() if k not in ("profile", "served_rss_kib_by_mapping", "health_monitor")}
    lines = _flat(flat)
    if "served_rss_kib_by_mapping" in d:
        rows = [(str(n), fmt(kib)) for n, kib in d["served_rss_kib_by_mapping"][:12]]
        lines += ["Where the served RSS is (KiB, /proc/PID/smaps):", "", *table(("mapping", "RSS"), rows)]
    if "profile" in d:
        lines += ["Where the CPU goes (`--profile`):", "", *_profile(d["profile"])]
    return lines


_THREE_SIDES = (("ours", "current"), ("NVIDIA's", "nvidia"), ("the example's", "baseline"))


def _nvml_rss(d: Any) -> list[str]:
    """The process's memory after each NVML step (KiB), and what each added."""
    if "error" in d:
        return [f"Not measured: {d['error']}.", ""]
    rows: list[Row] = []
    before: dict[str, int] = {}
    for step in d["steps"]:
        rows.append((step["step"], *(f"{step[k]} ({step[k] - before[k]:+d})" if before else str(step[k])
                                     for k in ("VmRSS", "RssAnon", "RssFile"))))
        before = step
    lines = [f"GPUs: {d['gpus']}.", "", *table(("after", "RSS", "anonymous", "files"), rows)]
    if "libcuda_mapped_by_the_cuda_version_query" in d:
        mapped = d["libcuda_mapped_by_the_cuda_version_query"]
        lines += [f"libcuda mapped before the CUDA version query: {fmt(mapped['before'])}; after: "
                  f"{fmt(mapped['after'])}.", ""]
    if "calls" in d:
        calls = [(name, fmt(c["n"]), fmt(c["wall_ms_per_call"]), fmt(c["cpu_ms_per_call"]))
                 for name, c in d["calls"].items()]
        lines += table(("call", "calls", "wall ms per call", "CPU ms per call"), calls)
    return lines


def _prepare_three(d: Any) -> list[str]:
    """Ours, NVIDIA's plugin and the example's from one run, with ours divided by each."""
    sides = [(name, key) for name, key in _THREE_SIDES if key in d]
    ratios = [(name, key) for name, key in sides if key != "current"]
    rows: list[Row] = []
    for label, key in (
        ("Prepare, one at a time", "prepare_sequential"),
        ("Unprepare, one at a time", "unprepare_sequential"),
        ("Prepare, 16 at once", "prepare_16_concurrent"),
        ("Unprepare, 16 at once", "unprepare_16_concurrent"),
        ("an empty call", "plugin_empty_call"),
        ("an empty call, 16 at once", "plugin_empty_16_concurrent"),
    ):
        rows.append(
            (
                label,
                *(fmt(get(d, f"{side}.{key}.{q}")) for _, side in sides for q in ("p50_ms", "p99_ms")),
                *(fmt(get(d, f"current_to_{side}")[f"{key}.p50"]) for _, side in ratios),
            )
        )
    for label, key, ratio in (
        ("start to registered (s)", "start_to_registered_s", "start_to_registered"),
        ("CPU from exec to registered (s)", "start_cpu_s", "start_cpu"),
        ("CPU per Prepare (ms)", "cpu_ms_per_prepare", "cpu_ms_per_prepare"),
        ("CPU per Unprepare (ms)", "cpu_ms_per_unprepare", "cpu_ms_per_unprepare"),
        ("CPU per cycle of a pod that lives 1 s, status writes included (ms)", "cpu_ms_per_paced_cycle",
         "cpu_ms_per_paced_cycle"),
        ("CPU when idle (ms per s)", "idle_cpu_ms_per_second", "idle_cpu_ms_per_second"),
        ("RSS after warm-up (KiB)", "rss_kib_after_warmup", "after_warmup"),
        ("RSS after 1,000 more cycles (KiB)", "rss_kib_after_1000_cycles", "after_1000_cycles"),
    ):
        rows.append(
            (
                label,
                *(v for _, side in sides for v in (fmt(get(d, f"{side}.{key}")), "")),
                *(fmt(get(d, f"current_to_{side}.{ratio}")) for _, side in ratios),
            )
        )
    header = (
        "call (ms)",
        *(f"{name} {q}" for name, _ in sides for q in ("p50", "p99")),
        *(f"ours / {name} (p50)" for name, _ in ratios),
    )
    lines = table(header, rows)
    lines += [f"NVIDIA's 16 claims were allocated, in turn: {fmt(get(d, 'nvidia_devices'))}.", ""]
    floor = [
        (name, fmt(get(d, f"floor.{name}.p50_ms")), fmt(get(d, f"floor.{name}.p99_ms")))
        for name in get(d, "floor")
    ]
    lines += ["The machine's floor in the same run (ms):", "", *table(("call", "p50", "p99"), floor)]
    if "profile" in d.get("current", {}):
        lines += ["Where ours spends its CPU (its first start, `--profile`):", "",
                  *_profile(d["current"]["profile"])]
    return lines


_FAR_SIDES = (("the example's", "baseline"), ("ours, HTTP/1.1", "http1"), ("ours, HTTP/2", "current"))


def _far_api(d: Any) -> list[str]:
    """Each side a column: Prepare one and 16 at once, Go's own GETs beside, connections."""
    rows: list[Row] = []
    for label, key in (
        ("Prepare, one at a time", "prepare_sequential"),
        ("Prepare, 16 at once", "prepare_16_concurrent"),
        ("Unprepare, 16 at once", "unprepare_16_concurrent"),
        ("kubelet-client's GET of a claim (Go)", "get_go"),
        ("... 16 at once", "get_go_16_concurrent"),
    ):
        rows.append((label, *(f"{fmt(get(d, f'{side}.{key}.p50_ms'))} / {fmt(get(d, f'{side}.{key}.p99_ms'))}"
                              for _, side in _FAR_SIDES)))
    rows.append(("TCP connections the plugin opened",
                 *(fmt(get(d, f"{side}.tcp_connections")) for _, side in _FAR_SIDES)))
    if "rss_kib_after_calls" in d["current"]:
        rows.append(("the plugin's RSS after the calls (KiB)",
                     *(fmt(get(d, f"{side}.rss_kib_after_calls")) for _, side in _FAR_SIDES)))
    lines = table(("p50 / p99 (ms)", *(name for name, _ in _FAR_SIDES)), rows)
    ratios = get(d, "ratios")
    return [*lines, *table(("ratio of 16 at once, p50", "measured"),
                           ((k.removesuffix("_16_concurrent_p50").replace("_", " "), fmt(v))
                            for k, v in ratios.items() if k.endswith("_16_concurrent_p50")))]


def _node(d: Any) -> list[str]:
    ops = "kubelet_dra_grpc_operations"
    return values(
        d,
        (
            ("node start to Ready (s)", "node_start.to_ready_s"),
            ("node start to driver registered (s)", "node_start.to_driver_registered_s"),
            ("pods of each kind", "pods_each"),
            ("pod create to Running, no claim: median (s)", "pod_create_to_running_no_claim.median_s"),
            ("... p90 (s)", "pod_create_to_running_no_claim.p90_s"),
            (
                "pod create to Running, one GPU claim: median (s)",
                "pod_create_to_running_one_gpu_claim.median_s",
            ),
            ("... p90 (s)", "pod_create_to_running_one_gpu_claim.p90_s"),
            ("claim / no claim, median", "claim_to_no_claim_median"),
            (
                "the kubelet's NodePrepareResources per call, p50 (ms)",
                f"{ops}.NodePrepareResources.single_calls.p50_ms",
            ),
            ("... p90 (ms)", f"{ops}.NodePrepareResources.single_calls.p90_ms"),
            (
                "the kubelet's NodeUnprepareResources per call, p50 (ms)",
                f"{ops}.NodeUnprepareResources.single_calls.p50_ms",
            ),
            ("... p90 (ms)", f"{ops}.NodeUnprepareResources.single_calls.p90_ms"),
        ),
    )


def _flood_rows(current: Any, baseline: Any | None) -> list[Row]:
    rows: list[Row] = []
    for phase in ("quiet", "flood", "elsewhere"):
        for call in ("prepare_sequential", "unprepare_sequential"):
            base = fmt(get(baseline, f"{phase}.{call}.p50_ms")) if baseline and phase in baseline else ""
            rows.append(
                (
                    phase,
                    call,
                    fmt(get(current, f"{phase}.{call}.p50_ms")),
                    fmt(get(current, f"{phase}.{call}.p90_ms")),
                    base,
                )
            )
    return rows


def _probe_flood(d: Any) -> list[str]:
    lines = table(
        ("phase", "call", "p50 ms", "p90 ms", "baseline p50 ms"), _flood_rows(d["current"], d.get("baseline"))
    )
    return lines + _floods(d["floods"])


def _floods(floods: Sequence[Any]) -> list[str]:
    rows = [
        (f["side"], f["target"], fmt(f["sent"]), fmt(f["achieved_per_second"]), fmt(f["statuses"]))
        for f in floods
    ]
    return table(("side", "probes aimed at", "sent", "per s", "answers"), rows)


def _probe_flood_h200(d: Any) -> list[str]:
    lines: list[str] = []
    for run in d["runs"]:
        lines += [f"Run started {run['started']}, {fmt(run['method'])}:", ""]
        lines += table(("phase", "call", "p50 ms", "p90 ms", ""), _flood_rows(run["current"], None))
        lines += _floods(run["floods"])
    return lines


def _health_storm(d: Any) -> list[str]:
    return values(
        d,
        (
            ("informational XIDs offered per s", "storm_events_per_second_offered"),
            ("... storm seconds", "storm_seconds"),
            ("events handled per s in the storm", "events_handled_per_second_in_storm"),
            (
                "last storm event handled after the storm's end (s)",
                "last_storm_event_handled_after_storm_end_s",
            ),
            ("a fatal XID in the storm: to Unhealthy (s)", "fatal_xid_to_unhealthy_s"),
            ("... to the slice's taint (s)", "fatal_xid_to_slice_taint_s"),
            ("capacity (events per s)", "capacity_events_per_second"),
            ("plugin CPU per event at capacity (µs)", "plugin_cpu_us_per_event_at_capacity"),
            (
                "a fatal XID behind the burst: to the slice's taint (s)",
                "fatal_xid_behind_backlog_to_slice_taint_s",
            ),
            ("... burst events still unread then", "burst_events_unread_at_that_taint"),
            ("plugin CPU idle (cores)", "plugin_cpu_cores_idle"),
            ("... storm alone (cores)", "plugin_cpu_cores_storm_alone"),
            ("Prepare in the storm / quiet, p50", "storm_to_quiet_p50"),
            ("... p99", "storm_to_quiet_p99"),
            ("slice writes in the storm", "slice_writes_storm"),
        ),
    )


def _huge_prepare(d: Any) -> list[str]:
    return values(
        d,
        (
            ("claims in one call", "claims"),
            ("Prepare (s)", "prepare_seconds"),
            ("Prepare errors", "prepare_errors"),
            ("Unprepare (s)", "unprepare_seconds"),
            ("RSS before (KiB)", "rss_kib_before"),
            ("... after Prepare", "rss_kib_after_prepare"),
            ("... after Unprepare", "rss_kib_after_unprepare"),
            ("... peak", "peak_rss_kib"),
        ),
    )


def _held_claims(d: Any) -> list[str]:
    rows = ["| claims held | Prepare p50 (ms) | p90 (ms) |", "|---|---|---|"]
    rows += [f"| {x['held']} | {x['prepare_ms_p50']} | {x['prepare_ms_p90']} |" for x in d["levels"]]
    return [*rows, "", f"{d['rounds']} single-claim calls per level."]


def _helm(d: Any) -> list[str]:
    return values(
        d,
        (
            ("image size (MB)", "image.size_uncompressed_mb"),
            ("... gzip archive (MB)", "image.oci_archive_gzip_mb"),
            ("image build, cold (s)", "image.build_cold_s"),
            ("... after a source change (s)", "image.build_after_a_source_change_s"),
            ("Helm build, cold (s)", "helm_build_cold_s"),
            ("install to slices published (s)", "install_to_slices_published_s"),
            ("install to plugin pods ready (s)", "install_to_plugin_pods_ready_s"),
            (
                "upgrade under load: overlap of the two plugin pods (s)",
                "upgrade.overlap_of_two_plugin_pods_on_the_load_node_s",
            ),
            ("... kubelet calls in the overlap", "upgrade.kubelet_calls_during_overlap"),
            ("... failed calls", "upgrade.failed_calls"),
            ("... lost claims", "upgrade.lost_claims"),
            ("uninstall to no slices (s)", "uninstall_to_no_slices_s"),
        ),
    )


def _slices(d: Any) -> list[str]:
    rows: list[Row] = []
    for c in d["cases"]:
        cpu = c["cpu_seconds_to_published"]
        rows.append(
            (
                c["profile"],
                fmt(c["nodes"]),
                fmt(c["devices"]),
                fmt(c["seconds_to_published"]),
                fmt(c.get("seconds_to_first_slice")),
                fmt(cpu.get("kube-apiserver")),
                fmt(cpu.get("controller")),
                fmt(cpu.get("etcd")),
                fmt(c["controller_writes"]),
                fmt(c["apiserver_rss_mib"]),
                fmt(c["slice_bytes_per_node"]),
                fmt(c["load_average_start_end"]),
            )
        )
    header = (
        "profile",
        "nodes",
        "devices",
        "to published (s)",
        "first slice (s)",
        "CPU s: API server",
        "controller",
        "etcd",
        "writes",
        "API server RSS MiB",
        "bytes per node",
        "load at start-end",
    )
    return table(header, rows)


def _scheduler(d: Any) -> list[str]:
    lines: list[str] = []
    for c in d["cases"]:
        gates = c.get("scheduler_feature_gates_added") or []
        lines += [
            f"{c['profile']}, {c['nodes']} nodes; reference mean {fmt(c['reference_pods_per_s_mean'])} pods/s"
            + (f"; scheduler gates added: {fmt(gates)}" if gates else "")
            + (
                f"; 1-minute load {fmt(c['load_average_1min']['min'])}-{fmt(c['load_average_1min']['max'])}"
                if "load_average_1min" in c
                else ""
            ),
            "",
        ]
        rows: list[Row] = []
        for s in c["shapes"]:
            per_pod = s["cpu_s"]["kube-scheduler"] * 1000 / s["bound"] if s["bound"] else None
            rows.append(
                (
                    s["shape"],
                    fmt(s.get("subrequests")),
                    f"{s['bound']}/{s['pods']}",
                    fmt(s["pods_per_s"]),
                    fmt(s.get("vs_reference")),
                    fmt(round(per_pod) if per_pod is not None else None),
                    fmt(s.get("load_average_1m")),
                )
            )
        header = (
            "shape",
            "subrequests",
            "bound/asked",
            "pods/s",
            "x reference",
            "scheduler CPU ms/pod",
            "load at start, end",
        )
        lines += table(header, rows)
    return lines


def _scheduler_cannot_fit(d: Any) -> list[str]:
    """One row per claim that cannot fit: its CPU per attempt against a plain pod that cannot fit."""
    rows: list[Row] = []
    for c in d["cases"]:
        for s in c["shapes"]:
            if s["scheduler_cpu_ms_per_unschedulable_attempt"] is None:
                continue
            claim = c["claims"].get(s["shape"], {})
            selector = any(sub.get("selectors") for r in claim.get("requests", [])
                           for sub in r.get("firstAvailable") or [r.get("exactly") or {}])
            rows.append((
                c["profile"], s["shape"], fmt(s["k"]), fmt(s["subrequests"]),
                "-" if not claim else ("yes" if selector else "no"),
                fmt(s["attempts"].get("unschedulable")),
                fmt(s["scheduler_cpu_ms_per_unschedulable_attempt"]),
                fmt(s.get("cpu_per_attempt_vs_reference")),
                fmt(s.get("cpu_per_attempt_vs_reference_bound_pod")),
                fmt(s.get("load_average_1m")),
            ))
    header = ("profile", "shape", "K", "subrequests", "fail-fast selector", "attempts",
              "scheduler CPU ms per attempt", "x a plain pod that cannot fit", "x a plain bound pod",
              "load at start, end")
    return table(header, rows)


def _why_cpu(d: Any) -> list[str]:
    rows = [
        (name, fmt(get(c, "cpu_s.p50")), fmt(get(c, "cpu_s.max")), fmt(get(c, "wall_s.p50")),
         fmt(get(c, "wall_s.max")))
        for name, c in get(d, "commands").items()
    ]
    lines = table(("command", "CPU p50 (s)", "CPU max (s)", "wall p50 (s)", "wall max (s)"), rows)
    return [*lines, f"Runs of each: {fmt(get(d, 'runs'))}; limit {fmt(get(d, 'limit_cpu_s'))} s of CPU per "
            f"`why`, every run within it: {fmt(get(d, 'within_limit'))}.", ""]


def _packing(d: Any) -> list[str]:
    rows: list[Row] = []
    for family, variants in d["families"].items():
        cells: list[str] = [family, fmt(variants["after-list"]["graphs"])]
        for form in ("list", "ga"):
            before, after = variants[f"before-{form}"], variants[f"after-{form}"]
            worst = after["worst"]
            cells += [
                f"{fmt(before['efficiency'])} ({before['bound']}/{before['best']})",
                f"{fmt(after['efficiency'])} ({after['bound']}/{after['best']})",
                f"{worst['graph']}: {worst['bound']}/{worst['best']}" if worst else "-",
            ]
        rows.append(tuple(cells))
    header = ("family", "graphs", "list form, before", "list form, after", "worst graph after (list)",
              "GA layers, before", "GA layers, after", "worst graph after (GA)")
    return table(header, rows)


def _scheduler_model(d: Any) -> list[str]:
    rows: list[Row] = [(c["profile"], s["shape"], f"{s['bound']}/{s['pods']}", fmt(s.get("model_bound")),
                        fmt(s.get("cpu_vs_reference")))
                       for c in d["cases"] for s in c["shapes"]]
    header = ("profile", "shape", "bound/asked (real scheduler)", "the model's bound", "CPU/pod x reference")
    return [*_scheduler(d), "", "The allocator model beside the real scheduler:", "", *table(header, rows)]


def _flat(d: Any) -> list[str]:
    rows: list[Row] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list) and len(value) > 4:
            rows.append((path, f"({len(value)} values)"))
        else:
            rows.append((path, fmt(value)))

    walk(d, "")
    return table(("value", "measured"), rows)


Layout = Callable[[Any], list[str]]

# file stem -> (title, what it is, layout); the order here is the page's
LAYOUTS: dict[str, tuple[str, str, Layout]] = {
    "prepare": (
        "Prepare and Unprepare",
        (
            "`python -m benchmarks.prepare`: calls from a grpc-go client as the kubelet's, the current "
            "plugin and a baseline commit's in one interleaved run."
        ),
        _prepare,
    ),
    "prepare_nvidia_h200": (
        "Prepare and Unprepare: ours, NVIDIA's plugin and the example driver, 16-core H200 host",
        (
            "`python -m benchmarks.prepare --example --nvidia` on the GPU host (`H200_FOR=bench` carry, "
            "hack/h200/run.sh's H200_BENCH): NVIDIA's gpu-kubelet-plugin v0.5.0 through the host's NVML "
            "and its one GPU (benchmarks.nvidia_driver says what it is given), ours and dra-example-driver "
            "v0.2.0 on 16 simulated GPUs, in one interleaved run with the same kubelet-side client."
        ),
        _prepare_three,
    ),
    "prepare_nvidia_h100": (
        "Prepare and Unprepare: ours, NVIDIA's plugin and the example driver, 16-core H100 host",
        (
            "The same three-driver run as above on an H100 host, with this session's code (HTTP/2 for a "
            "far API server, the packing order, NVML chosen once), in the call of node_rss_h100.json."
        ),
        _prepare_three,
    ),
    "prepare_http2_near": (
        "Prepare and Unprepare beside the plugin before HTTP/2, API server near",
        (
            "`python -m benchmarks.prepare --baseline-ref 841d822 --starts 4`: the baseline is the last "
            "commit that spoke only HTTP/1.1 to the API server; the current plugin, on loopback, finds "
            "the API server near and keeps to HTTP/1.1 (dra_driver.kube.transport)."
        ),
        _prepare,
    ),
    "far_api": (
        "16 Prepares at once with the API server 200 ms away",
        (
            "`python -m benchmarks.far_api`: every byte to and from the API server 200 ms later each "
            "way (a TCP relay); dra-example-driver v0.2.0, this plugin before HTTP/2 (841d822: 8 "
            "HTTP/1.1 connections) and now, interleaved in one run."
        ),
        _far_api,
    ),
    "node": (
        "Pods through a real kubelet",
        (
            "`python -m benchmarks.node`: pod create to Running through the real kubelet and "
            "scheduler, pods with and without a GPU claim interleaved."
        ),
        _node,
    ),
    "prepare_f5272b8_example": (
        "Prepare and Unprepare before issue 37's node work, beside the example driver",
        (
            "`python -m benchmarks.prepare --example --current-ref f5272b8`: the commit before the "
            "metrics port got its own thread, and dra-example-driver v0.2.0, in one interleaved run."
        ),
        _prepare,
    ),
    "prepare_example_h100": (
        "Prepare and Unprepare beside the example driver, 16-core H100 host",
        (
            "The same benchmark with `--example` on the GPU host (`H200_FOR=bench` carry, "
            "hack/h200/run.sh's H200_BENCH), where the 2-core machine's contention is gone."
        ),
        _prepare,
    ),
    "node_rss": (
        "The plugin's memory on this machine's GPUs",
        "`python -m benchmarks.node_rss [--simulate PROFILE]`: as the chart runs it, KiB from /proc.",
        _node_rss,
    ),
    "node_rss_h100": (
        "The plugin's memory on a real GPU, 16-core H100 host",
        "The same benchmark on the GPU host, real NVML, in the call of prepare_nvidia_h100.json.",
        _node_rss,
    ),
    "node_rss_h200": (
        "The plugin's memory on a real GPU, 16-core H200 host",
        "The same benchmark on the GPU host, real NVML, in the call of prepare_nvidia_h200.json.",
        _node_rss,
    ),
    "nvml_rss_h100": (
        "What NVML adds to a process's memory, 16-core H100 host",
        "`python -m benchmarks.nvml_rss` on the GPU host (`H200_BENCH=nvml_rss`): a fresh interpreter's "
        "KiB from /proc after each NVML step the plugin takes.",
        _nvml_rss,
    ),
    "nvml_rss_h200": (
        "What NVML adds to a process's memory, 16-core H200 host",
        "`python -m benchmarks.nvml_rss` on the GPU host (`H200_BENCH=nvml_rss`): a fresh interpreter's "
        "KiB from /proc after each NVML step the plugin takes.",
        _nvml_rss,
    ),
    "huge_prepare": ("One call with many claims", "`python -m benchmarks.huge_prepare`.", _huge_prepare),
    "held_claims": (
        "Prepare with many claims held",
        (
            "`python -m benchmarks.held_claims`: one claim's Prepare with 0 to 500 others prepared on the "
            "node. Before the checkpoint kept its last file and each entry's text (b4a2ae1, same machine, "
            "same day): 3.02, 5.87, 10.04, 17.15 ms at 0, 100, 250, 500 held."
        ),
        _held_claims,
    ),
    "probe_flood": (
        "Prepare under a probe flood",
        (
            "`python -m benchmarks.probe_flood`: GET /livez at a fixed rate, phases quiet / flood / "
            "the same flood aimed at another process."
        ),
        _probe_flood,
    ),
    "probe_flood_h200": (
        "Prepare under a probe flood, 16-core H200 host",
        "The same benchmark on the GPU host, one fresh machine per run.",
        _probe_flood_h200,
    ),
    "probe_flood_h100": (
        "Prepare under a probe flood, 16-core H100 host",
        "The same benchmark on the GPU host (`H200_BENCH=probe_flood`), with its defaults.",
        _probe_flood,
    ),
    "health_storm": (
        "Health event storm",
        (
            "`python -m benchmarks.health_storm`: informational XIDs at a fixed rate on one GPU, a "
            "fatal XID inside the storm and behind a burst."
        ),
        _health_storm,
    ),
    "why_cpu": (
        "`kubectl gpu why` on the demo's cluster",
        (
            "`python -m benchmarks.why_cpu`: each command typed in the shell `make demo DEMO_ARGS=--keep` "
            "prints, interleaved; CPU is user + system of the process (os.wait4). Before 8e9e6f7 (its "
            "parent 132825c, same machine, same day, `/usr/bin/time`, 3 runs): `kubectl-gpu why` on the "
            "pending pod 0.30-0.34 s."
        ),
        _why_cpu,
    ),
    "helm": ("Image and Helm chart", "tests/node/test_helm.py with `DRA_HELM_FIGURES` set.", _helm),
    "slices": (
        "ResourceSlice publishing",
        (
            "`python -m benchmarks.slices [--full]`: `dra-driver controller --simulate-fleet N` from "
            "its start until every slice is seen."
        ),
        _slices,
    ),
    "slices_profile_before": (
        "ResourceSlice publishing before 04bacb9 (profiled)",
        (
            "`python -m benchmarks.slices --profile-controller`, kept as the before of the publisher's "
            "fleet-scale work."
        ),
        _slices,
    ),
    "scheduler_500_dgx1": (
        "Scheduler, 500 dgx1-v100 nodes",
        (
            "`python -m benchmarks.scheduler --size 500:5000 --profile dgx1-v100 ...`; pods/s from the "
            "first creation to the last binding."
        ),
        _scheduler,
    ),
    "scheduler_500_hgx": (
        "Scheduler, 500 hgx-h200 nodes",
        "`python -m benchmarks.scheduler --size 500:5000 --profile hgx-h200 ...`.",
        _scheduler,
    ),
    "scheduler_500_dgx1_prequeueing": (
        "Scheduler, 500 dgx1-v100 nodes, SchedulerPreQueueingHints on",
        "`python -m benchmarks.scheduler ... --scheduler-feature-gate SchedulerPreQueueingHints=true`.",
        _scheduler,
    ),
    "scheduler_1000_mixed": (
        "Scheduler, 1,000 nodes, mixed fleet",
        "`python -m benchmarks.scheduler --size 1000:5000 --profile mixed ...`.",
        _scheduler,
    ),
    "scheduler_500_quiet2": (
        "Scheduler, 500 dgx1-v100 nodes, an earlier run",
        "`python -m benchmarks.scheduler --size 500:5000 --profile dgx1-v100 ...`.",
        _scheduler,
    ),
    "scheduler_500_quiet": (
        "Scheduler, 500 dgx1-v100 nodes, reference and share only",
        (
            "`python -m benchmarks.scheduler --size 500:5000 --profile dgx1-v100 --shape reference "
            "--shape share`."
        ),
        _scheduler,
    ),
    "scheduler_500": (
        "Scheduler, 500 nodes, every shape, under load",
        (
            "`python -m benchmarks.scheduler --size 500:5000 --profile dgx1-v100 --profile hgx-h200 "
            "--no-defaults --pprof-seconds 10`."
        ),
        _scheduler,
    ),
    "packing": (
        "NVLink packing: linked sets bound against the most that fit",
        (
            "`python -m benchmarks.packing`: efficiency = linked sets bound / the most disjoint linked "
            "sets (brute force), per graph family, through the allocator model on the published slices and "
            "the generated claim, before (GPUs by index, layers as coloured) and after "
            "dra_driver.gpu.packing; GA: a server without list-type attributes."
        ),
        _packing,
    ),
    "scheduler_i52_100": (
        "Scheduler, 100 random-topology nodes filled with linked claims: the packing model checked",
        (
            "`python -m benchmarks.scheduler --size 100:400 --profile random-2 --profile random-21 ...`: "
            "every node filled to its most disjoint linked sets, the real kube-scheduler's bound beside the "
            "allocator model's."
        ),
        _scheduler_model,
    ),
    "scheduler_i52_impossible_200": (
        "Scheduler, 200 nodes: claims that cannot fit, the generated claim and the 8-layer form",
        (
            "`python -m benchmarks.scheduler --size 200:100 ... --shape reference-impossible "
            "--shape impossible --shape impossible-8`: K one more than the fleet's largest linked set; "
            "`reference-impossible` is a plain one-GPU pod that cannot fit, `impossible` the claim "
            "`dra-driver claim --linked K` prints, `impossible-8` the same K over all 8 layers."
        ),
        _scheduler_cannot_fit,
    ),
    "scheduler_i52_impossible_list_200": (
        "Scheduler, 200 nodes: claims that cannot fit, the generated claim and the list form",
        (
            "`python -m benchmarks.scheduler --size 200:100 ... --shape reference-impossible "
            "--shape impossible --shape impossible-list`: as above, `impossible-list` the list form of "
            "deploy/examples/11 for that K, with the fail-fast selector where `dra-driver claim` adds it."
        ),
        _scheduler_cannot_fit,
    ),
    "start": (
        "Kubelet plugin start",
        "`python -m benchmarks.start`: CPU and wall from exec to the registration socket being served.",
        _flat,
    ),
    "scheduler": (
        "Scheduler, 100 nodes",
        "`python -m benchmarks.scheduler` (`make bench`), before the fitted shapes.",
        _scheduler,
    ),
}

HEADER = """\
# Performance

Rendered by `python -m benchmarks.render` from `benchmarks/results/*.json`; do not edit by
hand (a unit test fails when this page and the files differ). How each figure is measured is
in the docstring of the benchmark named under its heading; what the figures led to is in
[performance-history.md](performance-history.md). Where a file records no commit or date, the
page says so: such figures are older than the habit of recording them, and `git log` on the
file tells when it was measured.
"""


def render(results: Path = RESULTS) -> str:
    files = {p.stem: p for p in sorted(results.glob("*.json"))}
    order = [s for s in LAYOUTS if s in files] + [s for s in files if s not in LAYOUTS]
    lines = [HEADER]
    for stem in order:
        title, what, layout = LAYOUTS.get(
            stem, (stem, "No layout for this file: its values as they are.", _flat)
        )
        data = json.loads(files[stem].read_text())
        try:
            body = layout(data)
        except (KeyError, ResultsError, TypeError) as e:
            raise ResultsError(f"benchmarks/results/{stem}.json: {e}") from e
        lines += [f"## {title}", "", f"`benchmarks/results/{stem}.json`. {what}", ""]
        lines += provenance(data) + body
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if docs/performance.md is not what the files give"
    )
    args = parser.parse_args(argv)
    text = render(RESULTS)
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} differs from benchmarks/results: run python -m benchmarks.render", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
