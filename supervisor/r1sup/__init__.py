"""r1sup: start vLLM, recover it from out-of-memory, keep it serving."""

__version__ = "0.1.0"
