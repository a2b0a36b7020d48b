"""The node daemon assembled: the kubelet plugin (`dra_driver.plugin`) joined to the slice
publisher (`controller`), from the options `dra-driver kubelet-plugin` parses.

This is the only package that knows both halves; it holds wiring and start order, not logic
(the loops live beside what they keep). It must not parse command lines (`commands` does).
"""
