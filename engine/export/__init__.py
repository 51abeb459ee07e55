"""Export: a trained run as a file llama.cpp serves (GGUF, merged or adapter) or a bundle, with
the staged equivalence report. Sits above the recipes (it loads what they trained).

Reading order: bundle (export_run, the folder contract) -> from_pretrain / merge / lora_export
(the GGUF each kind of run becomes) -> equivalence (the staged report). See docs/architecture.md.
"""
