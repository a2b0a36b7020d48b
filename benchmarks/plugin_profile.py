"""Where a plugin process spends its CPU: py-spy samples and per-thread CPU time.

For issue 50 ("where Python cannot, show where the time goes, measured"): a window of the
plugin's life (its Prepare/Unprepare cycles, or idle) is sampled by py-spy (a sampling
profiler in its own process, here reading the target's memory without stopping it, so the
target's CPU is not changed by being profiled) and the CPU of each of the target's OS
threads is read before and after (benchmarks.cpu_clock). Only samples of the thread holding
the GIL are kept (`--gil`: a thread waiting in epoll, on a queue or in NVML's event wait
holds none), so a share is of the plugin's Python CPU, not of the wall clock. py-spy sees
Python threads only (time in C called from Python is counted to the Python frame calling
it); gRPC core's own threads (named by gRPC, e.g. `event_engine`) appear in the per-thread
table alone.

`summarize` is pure: collapsed stacks (py-spy's `raw` format) in, shares out. This module
must not decide anything about the plugin; it only measures. Without py-spy (`PY_SPY` or
`py-spy` on PATH or beside the interpreter) the samples are left out and said so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import cpu_clock

SAMPLE_RATE_HZ = 997  # not a multiple of the plugin's timers, so periodic work is not aliased
TOP = 25
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy executable: $PY_SPY, on PATH, beside this interpreter, or in a bin/ beside
    an entry of sys.path (a `pip install --target` tree, as carried to the GPU host)."""
    candidates = [os.environ.get("PY_SPY", ""), shutil.which("py-spy") or "",
                  str(Path(sys.executable).parent / "py-spy")]
    candidates += [str(Path(p) / "bin" / "py-spy") for p in sys.path if p]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def thread_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """{tid: (its name, CPU time in ns)} of each live thread of `pid` (benchmarks.cpu_clock)."""
    threads: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            ns = cpu_clock.thread_cpu_ns(pid, int(task.name))
        except OSError:  # the thread ended between the listing and the read
            continue
        threads[int(task.name)] = (stat[stat.index("(") + 1 : stat.rindex(")")], ns)
    return threads


def thread_cpu_ms(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]
) -> list[dict[str, Any]]:
    """Each thread's CPU between two `thread_cpu` readings (threads born in between count
    from zero), the busiest first."""
    rows = [
        (round((ns - before.get(tid, (name, 0))[1]) / 1e6, 2), tid, name)
        for tid, (name, ns) in after.items()
    ]
    busiest = sorted(rows, reverse=True)
    return [{"tid": tid, "name": name, "cpu_ms": ms} for ms, tid, name in busiest if ms > 0]


def _frame_key(frame: str) -> str:
    """'function (path/to/module.py:123)' -> 'module.py:function' (lines merged)."""
    match = _FRAME.match(frame)
    if not match:
        return frame
    return f"{Path(match['file']).name}:{match['function']}"


def _area(frame: str) -> str:
    """The package a frame's file belongs to: dra_driver.<sub>, grpc, asyncio, ... ."""
    match = _FRAME.match(frame)
    if not match:
        return "other"
    parts = Path(match["file"]).with_suffix("").parts
    for root in ("dra_driver", "controller"):
        if root in parts:
            rest = parts[parts.index(root) + 1 :]
            return ".".join((root, *rest[:1]))
    if "site-packages" in parts:
        rest = parts[parts.index("site-packages") + 1 :]
        return rest[0] if rest else "other"
    return parts[-2] if len(parts) > 1 and parts[-2] not in ("lib", "python3.11") else "stdlib"


# Where a thread hands control to a callback: the event loop's handle, a pool worker's item, a
# thread's target. Frames above the last one are the dispatcher's, not the work's.
_DISPATCH = ("events.py:Handle._run", "thread.py:_WorkItem.run", "threading.py:Thread.run")
IN_DISPATCH = "C run by the event loop or a thread (asyncio's tasks, grpc's Cython)"


def _charged_area(frames: list[str]) -> str:
    """The package a sample is charged to: the innermost frame of ours (dra_driver,
    controller) below the last dispatch; else the leaf's package; a sample in the dispatch
    frame itself is C code it called."""
    keys = [_frame_key(f) for f in frames]
    last = max((i for i, k in enumerate(keys) if k in _DISPATCH), default=-1)
    work = frames[last + 1 :]
    if not work:
        return IN_DISPATCH
    ours = [f for f in work if _area(f).startswith(("dra_driver", "controller"))]
    return _area(ours[-1] if ours else work[-1])


def summarize(collapsed: str, top: int = TOP) -> dict[str, Any]:
    """Shares of the samples in py-spy's raw (collapsed) output: each line is
    `frame;frame;...;leaf COUNT`, outermost first; with --threads the first frame names the
    thread. Self = the leaf frame; inclusive = anywhere on the stack (counted once a stack);
    area = `_charged_area`."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames[0].startswith(("thread (", "process ")):
            threads[frames[0]] += count
            frames = [f for f in frames if not f.startswith(("thread (", "process "))]
        if not frames:
            continue
        total += count
        self_counts[_frame_key(frames[-1])] += count
        for key in {_frame_key(f) for f in frames}:
            inclusive[key] += count
        areas[_charged_area(frames)] += count

    def shares(counter: Counter[str]) -> list[list[Any]]:
        return [[key, round(n / total, 4)] for key, n in counter.most_common(top)] if total else []

    return {"samples": total, "self": shares(self_counts), "inclusive": shares(inclusive),
            "area": shares(areas), "threads": shares(threads)}


def _python_thread_names(threads: list[list[Any]]) -> dict[int, str]:
    """{tid: name} from py-spy's thread frames, 'thread (TID): NAME' (the OS name of every
    Python thread is the interpreter's)."""
    names = {}
    for frame, _ in threads:
        match = re.match(r"thread \((\d+)\): (.+)", frame)
        if match:
            names[int(match[1])] = match[2]
    return names


@dataclass
class Window:
    """One profiled window: its seconds, per-thread CPU and the summary of its samples."""

    name: str
    seconds: float = 0.0
    process_cpu_ms: float = 0.0
    threads: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "process_cpu_ms": round(self.process_cpu_ms, 1),
                "threads": self.threads, "samples": self.samples}


@contextmanager
def profiled(pid: int, name: str, out_dir: Path) -> Iterator[Window]:
    """Profile `pid` for the duration of the with-block; the window is filled on exit. The raw
    samples are kept as out_dir/<name>.collapsed."""
    window = Window(name)
    executable = py_spy()
    raw = out_dir / f"{name}.collapsed"
    recorder = None
    if executable:
        recorder = subprocess.Popen(
            [executable, "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE_HZ), "--format", "raw",
             "--nonblocking", "--gil", "--threads", "--full-filenames", "--output", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        time.sleep(0.5)  # py-spy attaches (reads the interpreter's layout) before sampling
    before, process_before, t0 = thread_cpu(pid), cpu_clock.process_cpu_ns(pid), time.perf_counter()
    try:
        yield window
    finally:
        after, window.seconds = thread_cpu(pid), time.perf_counter() - t0
        window.threads = thread_cpu_ms(before, after)
        window.process_cpu_ms = (cpu_clock.process_cpu_ns(pid) - process_before) / 1e6
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                _, err = recorder.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                recorder.kill()
                err = b"py-spy did not stop in 30 s"
            window.samples = (summarize(raw.read_text()) if raw.exists()
                              else {"error": err.decode(errors="replace")[-500:]})
            named = _python_thread_names(window.samples.get("threads", []))
            for row in window.threads:
                row["name"] = named.get(row["tid"], row["name"])
        else:
            window.samples = {"error": "py-spy not found (PY_SPY, PATH, beside the interpreter)"}


def rss_by_mapping(pid: int, top: int = TOP) -> list[list[Any]]:
    """Where the process's resident memory is, from /proc/<pid>/smaps: KiB per mapped file
    (its basename), [heap], [stack] or [anon] (unnamed: malloc's arenas, Python's object
    arenas, thread stacks), the largest first."""
    sizes: Counter[str] = Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        # a mapping's first line: range perms offset dev inode [path]
        if head and "-" in head[0] and ":" not in head[0]:
            name = Path(head[5]).name if len(head) > 5 and head[5].startswith("/") else (
                head[5] if len(head) > 5 else "[anon]")
        elif head and head[0] == "Rss:":
            sizes[name] += int(head[1])
    return [[n, kib] for n, kib in sizes.most_common(top) if kib]
