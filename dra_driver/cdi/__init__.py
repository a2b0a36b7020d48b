"""CDI (Container Device Interface) specs for the GPUs a claim got.

Import from the three modules that do the work, which do not mix:

* `dra_driver.cdi.spec`: the data types (`CdiSpec`, `Device`, `ContainerEdits`, ...), the
  `cdiVersion` rules (`minimum_version`) and the name rules (vendor, class, device, claim UID);
* `dra_driver.cdi.builders`: what a container gets (pure: `build_claim_spec`, `build_static_spec`);
* `dra_driver.cdi.files`: the JSON form and the files (`write_spec`, `remove_claim_spec`,
  `claim_uids_in`), the only I/O.

This package module re-exports nothing: one way to import each name.
"""
