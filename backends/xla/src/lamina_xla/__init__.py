"""lamina backend for XLA devices through torch_xla and PJRT (TPU; host CPU for testing)."""

from lamina_xla.backend import XlaBackend
from lamina_xla.handle import XlaHandle

__version__ = "0.1.0"

__all__ = ["XlaBackend", "XlaHandle", "__version__"]
