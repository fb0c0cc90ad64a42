"""KnormPress: keep the entries whose keys have the smallest L2 norm (Devoto et al. 2024, "A
simple and effective L2 norm-based strategy for KV cache compression"; kvpress's ``KnormPress``).

It reads only the keys (no attention, no window): the proof that
:meth:`Press.score_entries <sparkv.presses.base.Press.score_entries>` sees more than attention.
By default it has no observation window (``window=0``: nothing is forced, as in kvpress); with a
window, the context's last ``window`` tokens are kept as by the other presses.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sparkv.presses.base import Press
from sparkv.presses.scoring import ScoreInputs


class KnormPress(Press):
    """Scores each entry by the negated L2 norm of its key (low-norm keys draw attention)."""

    name: ClassVar[str] = "knorm"

    def __init__(self, window: int = 0, compression_ratio: float | None = None) -> None:
        super().__init__(window, 1, "max", compression_ratio)

    @property
    def needs_attention(self) -> bool:
        return False

    def score_entries(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
