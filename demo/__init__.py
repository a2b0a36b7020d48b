"""`make demo`: the driver end to end on a real control plane (run: `python -m demo.run`)."""
