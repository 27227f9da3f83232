"""The attention backends' names, for config checks that must not import the kernels themselves."""

IMPLS: tuple[str, ...] = ("auto", "reference", "xla", "pallas", "cudnn")  # "auto": the best available for the device
# quantized KV storage: name -> (storage dtype, largest code); one scale per token and KV head (lcx.kernels.quant)
QUANT_DTYPES: dict[str, tuple[str, float]] = {"int8": ("int8", 127.0), "fp8": ("float8_e4m3fn", 448.0)}
# bit-packed KV storage below 8 bits: name -> bits per code; scales and zeros per group (lcx.kernels.lowbit)
LOWBIT_DTYPES: dict[str, int] = {"int4": 4, "int2": 2}
