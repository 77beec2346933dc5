"""Runtime: what serving imports. The selector turns a tuning database into a dense lookup table."""

from k3tune.runtime.selector import Choice, Selector

__all__ = ["Choice", "Selector"]
