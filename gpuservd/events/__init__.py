"""The daemon's events: their types (types.py) and the bus that fans them out to readers (bus.py)."""

from gpuservd.events.bus import PRIVATE_TYPES, EventBus, Subscription

__all__ = ["PRIVATE_TYPES", "EventBus", "Subscription"]
