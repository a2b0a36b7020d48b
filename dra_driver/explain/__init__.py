"""Why a pod's claims cannot be allocated, and where they could be: the scheduler's DRA
allocator replayed on plain API objects (ResourceSlices, DeviceClasses, ResourceClaims).

`celenv` evaluates CEL selectors with Kubernetes' DRA functions (cel-expr-python plus a
quantity/semver shim), `state` turns slices and allocated claims into pools, devices,
counters and holders, `allocator` searches an allocation per node as the scheduler does,
`why` counts per node and request what matches, what is held and why the rest is out,
and `render` writes it for a person.

Every module here is pure: JSON in, frozen dataclasses out. None of them may read the API
server, a node or a file: the command (dra_driver.commands.why) does the reading.
"""
