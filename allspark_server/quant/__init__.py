"""InstantQuant: weight formats and their reference math (formats.py), the user's scheme (scheme.py)."""
from allspark_server.quant.formats import FORMATS, GROUP_SIZES, QuantizedWeight, dequantize, quantize
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

__all__ = ["FORMATS", "GROUP_SIZES", "QuantConfigError", "QuantScheme", "QuantizedWeight", "dequantize",
           "quantize"]
