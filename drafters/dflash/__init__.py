"""Block drafters: DFlash, DFlash2 (dynamic conv + candidate selector) and the backbone DSpark builds on."""

from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec

__all__ = ["DFlashDrafter", "DFlashSpec"]
