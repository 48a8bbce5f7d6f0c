"""A base for test drafters that keep no per-request state (their drafts depend on the sequence only)."""

from __future__ import annotations

from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.tree import Verdict


class StatelessDrafter:
    """No target features needed; ``begin`` / ``commit`` / ``release`` have nothing to do."""

    needs = TargetNeeds()

    def begin(self, features: TargetFeatures) -> None:
        pass

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        pass

    def release(self, request_ids: list[int]) -> None:
        pass
