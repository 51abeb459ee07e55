"""llama.cpp's CPU arithmetic: the torch reference (numerics, ggml_matmul) and its C build (native).

Reading order: cpu.py (which x86 features this machine has, hence which ggml kernels llama.cpp
runs here), numerics.py (activation quantizers, f16 dots, softmax, GELU, RoPE), ggml_matmul.py
(the quantized matmuls), native.py and ggml_kernels.c (the same arithmetic in C).
This package imports only torch, gguf, engine.gguf and engine.fsutil (the cache folder);
models and recipes import it.
"""
