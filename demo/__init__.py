"""`make demo`: the driver end to end on a real control plane and real nodes (run: `python -m demo.run`)."""
