"""How K/V are stored: the formats and the bytes each takes (`kvformat`, no torch) and the
quantized layouts, KIVI's included (`quant`).

May import: errors only.
"""
