"""Runtime: what serving imports. The selector turns a tuning database into a dense lookup table; a dense projection
runs the kernel it picks for one op, bound to a rank's weight."""

from k3tune.runtime.dense import DenseProjection
from k3tune.runtime.selector import Choice, Selector

__all__ = ["Choice", "DenseProjection", "Selector"]
