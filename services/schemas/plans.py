"""Catch-up plans: what a replica fetches, in order, to go from its version to a target."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import WireModel
from .versions import ObjectRef


class PlanStep(WireModel):
    """Fetch these objects and apply them; afterwards the replica is at ``to_version``."""

    kind: Literal["anchor", "delta", "squashed"] = Field(
        description="'anchor': load a full checkpoint; 'delta': apply one published delta; "
        "'squashed': apply one compacted delta spanning several versions."
    )
    from_version: int | None = Field(description="Version it applies to; None for an anchor.")
    to_version: int = Field(description="Version reached after this step.")
    objects: list[ObjectRef]
    bytes: int = Field(description="Sum of the objects' sizes.")


class CatchUpPlan(WireModel):
    """``GET /v1/plan?from=&to=``: the cheapest path by bytes."""

    from_version: int | None = Field(description="Replica's current version; None: it has none.")
    to_version: int
    steps: list[PlanStep] = Field(description="In apply order; empty when already there.")
    total_bytes: int = Field(description="Bytes to download in all.")
    full_bytes: int | None = Field(
        description="Bytes of a full checkpoint at to_version, for comparison; None if unknown."
    )
