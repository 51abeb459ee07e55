"""Hugging Face checkpoint folders in and out: reading (checkpoint.py), conversion to GGUF as
llama.cpp's convert_hf_to_gguf.py writes it (convert.py, tokenizer.py)."""
