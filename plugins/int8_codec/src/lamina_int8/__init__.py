"""lamina-int8-codec: int8 gradients with one absmax scale per block, summed in two
phases with error feedback (``codec="int8"`` once installed)."""

from lamina_int8.codec import BLOCK, Int8Codec, Int8Sum, dequantize, quantize

__all__ = ["BLOCK", "Int8Codec", "Int8Sum", "dequantize", "quantize"]
