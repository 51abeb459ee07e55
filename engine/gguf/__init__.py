"""GGUF files: read (metadata + memory-mapped tensor table), dequantize, quantize, write."""
