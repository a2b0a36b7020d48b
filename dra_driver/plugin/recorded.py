"""The dynamic MIG instances the checkpoint records now, for describing created devices
(`mig_steps.CreatedDevices`) between Prepares.

Re-reads the checkpoint only when the file changed (it is replaced by a rename on every
save: a new inode). Must not write the checkpoint nor take its lock: a stale answer for a
moment is fine here, a blocked event loop is not.
"""

from __future__ import annotations

from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.prepared import MigRecord
from dra_driver.plugin.state import NodePreparer


class RecordedInstances:
    def __init__(self, preparer: NodePreparer) -> None:
        self.preparer = preparer
        self._seen: tuple[int, int, int] | None = None
        self._records: list[MigRecord] = []

    def __call__(self) -> list[MigRecord]:
        try:
            st = self.preparer.steps.checkpoint_path.stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._seen:
                cp = self.preparer.read_checkpoint()
                self._records = [r for e in cp.claims.values() for r in e.mig]
                self._seen = key
        except (OSError, ckpt.CheckpointUnreadable, ckpt.CheckpointRefused):
            return []
        return self._records
