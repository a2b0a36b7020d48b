"""Another process's (or thread's) CPU time, to the nanosecond, from the kernel's CPU-time clocks.

utime+stime in /proc/<pid>/stat are counted in clock ticks (10 ms here): a thread that
wakes briefly on a timer is charged a whole tick whenever the tick finds it running, so a
reading of an idle process over seconds is a handful of ticks and says little. The kernel's
CPU-time clock of a process (`clock_gettime` with the clock id glibc's `clock_getcpuclockid`
makes: the pid complemented, shifted by 3, CPUCLOCK_SCHED; Python has no
`clock_getcpuclockid`) sums the scheduler's own runtime of all its threads, ended ones
included. Where the clock is refused (another user's process), the ticks are read instead.

This module only reads; it decides nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_CPUCLOCK_SCHED = 2


def process_cpu_ns(pid: int) -> int:
    """CPU time of process `pid` (all its threads, ended ones included), in nanoseconds."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        return _ticks_ns(Path(f"/proc/{pid}/stat"))


def thread_cpu_ns(pid: int, tid: int) -> int:
    """CPU time of thread `tid` of process `pid`, in nanoseconds: the first field of its
    schedstat (the same runtime; a thread's CPU-time clock is readable only from its own
    process)."""
    try:
        return int((Path(f"/proc/{pid}/task/{tid}") / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _ticks_ns(Path(f"/proc/{pid}/task/{tid}/stat"))


def _ticks_ns(stat: Path) -> int:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
