"""Model families: one file each (llama.py covers Llama and, with qwen.py's switches, Qwen2/3;
gemma3.py), shared blocks, the frozen packed-quant linear, and the GGUF loader."""
