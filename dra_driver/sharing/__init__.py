"""GPU sharing for prepared claims: the claim's sharing configuration, what it adds to the CDI
spec, and the node-side machinery (per-claim MPS daemons). `policy.Sharing` is the one seam
the prepare transaction uses."""
