"""The claim config's fields, written once: the table both checkers are made from.

Each row is one field of `opaque.parameters` in one of the two API forms this driver reads
(ours, `gpu.dra-driver.dev/v1alpha1`, and NVIDIA's, `resource.nvidia.com/v1beta1`): the object
it belongs to, its name, the check its value gets and the refusal's reason. The node's parsers
(config.py, nvidia_config.py) take each object's allowed fields from here and run each
row's check (`dra_driver.sharing.config.check_value`); the chart's claim-config admission policy
is generated from the same rows (`dra_driver.sharing.policy_cel`, `make policy`), so a new
config field is one row here (plus what it does on the node). RULES lists the policy's
validations, the claim-wide ones (over all requests and configs of a claim, or a class with
its config) among them, each with where the node enforces it.

Data only: no parsing, no I/O, no imports from the parsers (they import this).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

OURS: Final = "ours"
NVIDIA: Final = "nvidia"
GPU_KIND: Final = "GpuConfig"
MIG_KIND: Final = "MigDeviceConfig"

# The bounds of every memory quantity a claim config sets (a pinned-memory limit, the
# /dev/shm size). 1Ti is more memory than any GPU has, so a larger limit could never limit
# anything (MPS would take 1Ei as "1073741824G" and run without one).
MIN_MEMORY: Final = 2**20
MAX_MEMORY: Final = 2**40

# --------------------------------------------------------------------------- the reasons

LIMIT_REASON: Final = (
    "must be a quantity from 1Mi to 1Ti, e.g. 10Gi (an MPS limit is counted in whole MiB, "
    "and no GPU has more than 1Ti of memory for it to limit)"
)
SHM_REASON: Final = "must be a quantity from 1Mi to 1Ti, e.g. 1Gi: the size of the claim's /dev/shm tmpfs"
PERCENTAGE_REASON: Final = "must be a whole number from 1 to 100"
ZERO_PERCENTAGE_REASON: Final = (
    "must be a whole number from 1 to 100 (0, which NVIDIA's driver accepts, would leave the "
    "claim's MPS clients no streaming multiprocessors)"
)
PER_DEVICE_REASON: Final = (
    "keys must be a device index (0, 1, ...) among the devices this config applies to, or a "
    'device UUID (GPU-... or MIG-...); values a quantity from 1Mi to 1Ti, e.g. 10Gi'
)
MULTI_USER_REASON: Final = (
    "true is not supported: this driver's MPS daemon runs in single-user mode, where a client "
    "of a second user waits until the first user's clients are gone; run the claim's "
    "containers as one user and remove multiUser (or set it to false)"
)
BOOL_REASON: Final = "must be true or false"
INTERVAL_REASON: Final = (
    "only Default can be honoured: a GPU's time slice is set with nvidia-smi compute-policy for "
    "the whole GPU, outside any one claim, so this driver leaves every GPU at its default; remove "
    "interval or write Default"
)


class Check(enum.Enum):
    """What a field's value must be."""

    STRUCTURE = "structure"  # read by the parser's own code (apiVersion, kind, strategy, objects)
    PERCENTAGE = "percentage"  # a whole number from 1 to 100
    MEMORY = "memory"  # a quantity (string or whole number) from MIN_MEMORY to MAX_MEMORY
    MEMORY_MAP = "memory-map"  # device index or UUID -> a MEMORY
    FALSE = "false"  # a bool that must be false (null: left out)
    DEFAULT = "default"  # the string "Default" (null: left out)


@dataclass(frozen=True)
class Field:
    """One field of `opaque.parameters`. `parent`: the dotted path of its object ("" for
    parameters itself); `echo`: the refusal quotes the value (ours, as Python's repr);
    `kinds`: the NVIDIA kinds that have the field (empty: all); `zero_reason`: the reason
    given for 0 where it differs; `true_reason`: for FALSE, the reason given for true."""

    form: str
    parent: str
    name: str
    check: Check
    reason: str = ""
    echo: bool = False
    kinds: tuple[str, ...] = ()
    zero_reason: str = ""
    true_reason: str = ""


FIELDS: Final = (
    # ours
    Field(OURS, "", "apiVersion", Check.STRUCTURE),
    Field(OURS, "", "kind", Check.STRUCTURE),
    Field(OURS, "", "sharing", Check.STRUCTURE),
    Field(OURS, "sharing", "strategy", Check.STRUCTURE),
    Field(OURS, "sharing", "mps", Check.STRUCTURE),
    Field(OURS, "sharing.mps", "defaultActiveThreadPercentage", Check.PERCENTAGE, PERCENTAGE_REASON,
          echo=True),
    Field(OURS, "sharing.mps", "defaultPinnedDeviceMemoryLimit", Check.MEMORY, LIMIT_REASON),
    Field(OURS, "sharing.mps", "shmSize", Check.MEMORY, SHM_REASON),
    # NVIDIA's
    Field(NVIDIA, "", "apiVersion", Check.STRUCTURE),
    Field(NVIDIA, "", "kind", Check.STRUCTURE),
    Field(NVIDIA, "", "sharing", Check.STRUCTURE),
    Field(NVIDIA, "sharing", "strategy", Check.STRUCTURE),
    Field(NVIDIA, "sharing", "timeSlicingConfig", Check.STRUCTURE, kinds=(GPU_KIND,)),
    Field(NVIDIA, "sharing", "mpsConfig", Check.STRUCTURE),
    Field(NVIDIA, "sharing.mpsConfig", "defaultActiveThreadPercentage", Check.PERCENTAGE, PERCENTAGE_REASON,
          zero_reason=ZERO_PERCENTAGE_REASON),
    Field(NVIDIA, "sharing.mpsConfig", "defaultPinnedDeviceMemoryLimit", Check.MEMORY, LIMIT_REASON),
    Field(NVIDIA, "sharing.mpsConfig", "defaultPerDevicePinnedMemoryLimit", Check.MEMORY_MAP,
          PER_DEVICE_REASON),
    Field(NVIDIA, "sharing.mpsConfig", "multiUser", Check.FALSE, BOOL_REASON, true_reason=MULTI_USER_REASON),
    Field(NVIDIA, "sharing.timeSlicingConfig", "interval", Check.DEFAULT, INTERVAL_REASON),
)


class Policy(enum.Enum):
    """Which of the chart's policies checks a rule."""

    CLAIM = "claim"  # the claim-config policy: a claim, template or class as written
    BOTH = "both"  # that one, and the class-config policy with each class's config beside the claim's
    CLASSES = "classes"  # the class-config policy alone: a class written, beside each other class


class Shape(enum.Enum):
    """How a rule's CEL variable lists its refusals."""

    MESSAGES = "messages"  # a list of refusals
    PER_SLOT = "per-slot"  # a list per request (its slots' refusals)
    PER_CONFIG = "per-config"  # one string per config entry, "" where it is valid


@dataclass(frozen=True)
class Rule:
    """One validation of the claim-config policy, in the order they are checked: `variable`
    names the CEL variable (policy_skeleton.yaml, or made from FIELDS) that lists its
    refusals; `node`, where the plugin refuses the same on the node ("" : a rule of the
    policy's own, for a claim the node would run, not as asked); `policy`: BOTH where a
    DeviceClass's config together with the claim's may break it."""

    variable: str
    shape: Shape
    refuses: str
    node: str
    policy: Policy = Policy.CLAIM


RULES: Final = (
    Rule("vfioErrors", Shape.MESSAGES, "a request for NVIDIA's VFIO class under this driver's domain "
         "(no such class: the claim would wait for ever)", ""),
    Rule("nvidiaDriverErrors", Shape.MESSAGES, "an entry for NVIDIA's driver on requests of this driver's "
         "classes only (the claim would run without its sharing)", ""),
    Rule("kindErrors", Shape.PER_SLOT, "NVIDIA's kind against the class of each request or alternative",
         "nvidia_config.per_device", policy=Policy.BOTH),
    Rule("nvidiaErrors", Shape.PER_CONFIG, "NVIDIA's form, field by field (the FIELDS rows)",
         "nvidia_config.parse_nvidia_config"),
    Rule("ourErrors", Shape.PER_CONFIG, "our form, field by field (the FIELDS rows)",
         "config.parse_gpu_config"),
    Rule("shareLimitErrors", Shape.PER_SLOT, "a pinned limit above a share's memory", "policy._share_mps",
         policy=Policy.BOTH),
    Rule("shareStrategyErrors", Shape.PER_SLOT, "a config other than MPS for a share", "policy._share_mps",
         policy=Policy.BOTH),
    Rule("adminErrors", Shape.PER_SLOT, "adminAccess on a dynamic MIG slice", "claim_steps.ClaimSteps.plan"),
    Rule("perDeviceErrors", Shape.PER_SLOT, "an index key of NVIDIA's per-device limits beyond the devices "
         "its config applies to", "nvidia_config.per_device", policy=Policy.BOTH),
    Rule("percentageErrors", Shape.PER_SLOT, "two MPS thread percentages in one claim",
         "policy._share_thread_percentage", policy=Policy.BOTH),
    Rule("classPercentageErrors", Shape.MESSAGES, "two classes of this driver with different MPS thread "
         "percentages (a claim of both would have two)", "policy._share_thread_percentage",
         policy=Policy.CLASSES),
)


def fields(form: str, parent: str, kind: str | None = None) -> tuple[Field, ...]:
    """The rows of one object, in the order they are checked and listed; `kind`: only the
    fields an NVIDIA object of that kind has."""
    return tuple(
        f for f in FIELDS
        if f.form == form and f.parent == parent and (kind is None or not f.kinds or kind in f.kinds)
    )


def allowed(form: str, parent: str, kind: str | None = None) -> tuple[str, ...]:
    """The names an object may hold, as its refusal of an unknown field lists them."""
    return tuple(f.name for f in fields(form, parent, kind))


def values(form: str, parent: str) -> tuple[Field, ...]:
    """The rows of one object whose values a row's check decides (not the parser's own code)."""
    return tuple(f for f in fields(form, parent) if f.check is not Check.STRUCTURE)


def reasons(form: str | None = None) -> tuple[str, ...]:
    """Every row's refusal, of one form or both (the generated policy carries each verbatim)."""
    rows = (f for f in FIELDS if form is None or f.form == form)
    return tuple(dict.fromkeys(r for f in rows for r in (f.reason, f.zero_reason, f.true_reason) if r))
