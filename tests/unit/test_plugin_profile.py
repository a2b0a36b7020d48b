"""benchmarks.plugin_profile's pure part: shares of py-spy's collapsed stacks."""

from benchmarks.plugin_profile import IN_DISPATCH, summarize

COLLAPSED = """\
thread (0x1): MainThread;run (/x/site-packages/grpc/aio/_server.py:10);\
prepare (/x/dra_driver/plugin/state.py:5);\
dumps (/usr/lib/python3.11/json/__init__.py:2) 6
thread (0x1): MainThread;run (/x/site-packages/grpc/aio/_server.py:10) 2
thread (0x2): nvml-health;_run (/x/dra_driver/health/monitor.py:3) 2
not a sample line
"""


def test_self_inclusive_area_and_threads_are_shares_of_all_samples() -> None:
    summary = summarize(COLLAPSED)
    assert summary["samples"] == 10
    assert summary["self"][0] == ["__init__.py:dumps", 0.6]
    assert dict(summary["inclusive"])["_server.py:run"] == 0.8  # on 8 of 10 stacks, counted once each
    # a sample is charged to the innermost frame of ours on its stack (json called from the plugin's state)
    assert dict(summary["area"]) == {"dra_driver.plugin": 0.6, "grpc": 0.2, "dra_driver.health": 0.2}
    assert dict(summary["threads"]) == {"thread (0x1): MainThread": 0.8, "thread (0x2): nvml-health": 0.2}


def test_a_sample_in_the_event_loops_dispatch_is_charged_to_it_not_to_the_caller_of_the_loop() -> None:
    loop = "run (/x/dra_driver/signals.py:1);Handle._run (/usr/lib/python3.11/asyncio/events.py:80)"
    collapsed = f"{loop} 3\n{loop};prepare (/x/dra_driver/plugin/state.py:5) 1\n"
    assert dict(summarize(collapsed)["area"]) == {IN_DISPATCH: 0.75, "dra_driver.plugin": 0.25}


def test_nothing_sampled_gives_empty_shares() -> None:
    assert summarize("") == {"samples": 0, "self": [], "inclusive": [], "area": [], "threads": []}
