"""k3tune: autotunes the decode path of Kimi K3 for serving.

Pipeline: plan -> search -> measure -> store -> select -> decode.
Serving code imports only :mod:`k3tune.runtime`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
