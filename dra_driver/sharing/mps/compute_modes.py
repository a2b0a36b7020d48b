"""The compute modes a whole-GPU MPS claim changes, recorded so that they can be put back.

Where the operator lets the driver change compute mode, the GPUs of a claim's
`exclusive_gpus` are set to exclusive-process before its daemon starts (one context, the
MPS server's, so a process of the pod cannot step around MPS). The mode found is written to
the claim's `compute-mode.json` before the change (a crash between the two leaves a record
of a mode never changed, which restoring skips), and put back when the claim stops and no
other claim's record names the GPU; a GPU whose mode cannot be set refuses the claim.

NVML is `dra_driver.gpu.compute_mode`'s; this module decides when and records. It must not
start or stop daemons, nor remove the claim's directory (the record goes with it, last).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.gpu import compute_mode
from dra_driver.gpu.compute_mode import ComputeModeError, ComputeModes
from dra_driver.sharing.mps.errors import MpsError
from dra_driver.sharing.mps.layout import ClaimDirs
from dra_driver.sharing.mps.settings import MpsSettings

log = structlog.get_logger(__name__)

Records = Mapping[str, Mapping[str, int]]  # claim UID -> {GPU UUID: the mode found}


def recorded_modes(claims: Iterable[tuple[str, ClaimDirs]]) -> dict[str, dict[str, int]]:
    """Claim UID -> {GPU UUID: the mode found before it was set exclusive}."""
    out = {}
    for uid, dirs in claims:
        try:
            raw = json.loads(dirs.compute_mode_file.read_text())
            out[uid] = {str(k): int(v) for k, v in raw.items()}
        except FileNotFoundError:
            continue
        except (ValueError, AttributeError, TypeError) as e:
            log.error("unreadable compute-mode record", claim_uid=uid, error=str(e))
    return out


def set_exclusive(compute: ComputeModes, dirs: ClaimDirs, settings: MpsSettings, others: Records) -> None:
    """Set the claim's `exclusive_gpus` to exclusive-process, each mode found recorded first;
    `others`: the other claims' records (a GPU one of them changed keeps the mode it found)."""
    uid = settings.claim_uid
    try:
        mine = {str(k): int(v) for k, v in json.loads(dirs.compute_mode_file.read_text()).items()}
    except FileNotFoundError:
        mine = {}
    except ValueError:
        mine = {}
    try:
        for gpu in settings.exclusive_gpus:
            if gpu not in mine:
                # another claim already changed it: the mode to restore is the one it found
                found = next((r[gpu] for r in others.values() if gpu in r), None)
                mine[gpu] = compute.get(gpu) if found is None else found
                write_file_atomic(dirs.compute_mode_file, json.dumps(mine).encode())  # before the change
            if compute.get(gpu) != compute_mode.EXCLUSIVE_PROCESS:
                compute.set(gpu, compute_mode.EXCLUSIVE_PROCESS)
                log.info(
                    "GPU set to exclusive-process compute mode for the claim's MPS daemon",
                    claim_uid=uid,
                    gpu=gpu,
                    was=compute_mode.name(mine[gpu]),
                )
    except ComputeModeError as e:
        raise MpsError(
            f"{e}: this whole-GPU MPS claim needs its GPUs in exclusive-process compute mode (so no "
            "process can use the GPU around MPS); let the driver change compute mode on this node, or "
            "run the plugin with --no-mps-exclusive-compute-mode to accept that"
        ) from e


def restore_modes(
    compute: ComputeModes | None, dirs: ClaimDirs, claim_uid: str, others: Callable[[], Records]
) -> None:
    """Put back the modes the claim recorded, but not on a GPU another claim's record names
    (`others`, read only once the claim's own record is known; that claim restores it)."""
    try:
        mine = {str(k): int(v) for k, v in json.loads(dirs.compute_mode_file.read_text()).items()}
    except FileNotFoundError:
        return
    except ValueError as e:
        log.error("unreadable compute-mode record; modes left alone", claim_uid=claim_uid, error=str(e))
        return
    if compute is None:
        log.warning(
            "the claim changed compute modes, but this plugin may not change them: left as they are",
            claim_uid=claim_uid,
            modes={g: compute_mode.name(m) for g, m in mine.items()},
        )
        return
    still = {g for r in others().values() for g in r}
    for gpu, mode in mine.items():
        if gpu in still:
            continue  # another claim's daemon holds it; that claim restores it
        try:
            if compute.get(gpu) != mode:  # not changed (a refused claim): nothing to undo
                compute.set(gpu, mode)
        except ComputeModeError as e:
            raise MpsError(f"restoring the compute mode of the claim's GPU failed: {e}") from e
        log.info("GPU compute mode restored", claim_uid=claim_uid, gpu=gpu, mode=compute_mode.name(mode))
