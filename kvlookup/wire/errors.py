"""The one error every wire decoder raises for input it cannot use."""

from __future__ import annotations


class WireError(ValueError):
    """A frame, message, batch or event that cannot be applied.

    reason: a short label for metrics (``kvlookup_rejected_frames_total{reason=...}``), e.g.
    ``undecodable``, ``invalid_fields``, ``batch_shape``. detail: what was wrong, for the log (and
    ``str(error)``).
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
