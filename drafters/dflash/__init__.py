"""Block drafters: DFlash, DFlash2 (dynamic conv + candidate selector) and the backbone DSpark builds on."""

from drafters.dflash.model import DFlashDrafter
from drafters.dflash.spec import DFlashSpec

__all__ = ["DFlashDrafter", "DFlashSpec"]
