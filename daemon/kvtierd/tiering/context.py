"""What every part of the tiering layer works with: one of each per ``Tiering``."""

from __future__ import annotations

import dataclasses

from kvtierd.store import Store
from kvtierd.tiering.below import Below
from kvtierd.tiering.common import Background, Reporter
from kvtierd.tiering.copies import Copier
from kvtierd.tiering.moves import MovementTable


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """The DRAM store, the tiers below it, the movement table, the copier, the fault
    reports and the worker pool the promoter, demoter, publisher, drainer and admin
    share."""

    store: Store
    below: Below
    moves: MovementTable
    copier: Copier
    report: Reporter
    work: Background
