"""Cartridges (Eyuboglu et al., arXiv 2506.06266): a trained KV prefix that stands in for a long
document in the context of an unchanged base model.

- `engine.cartridge.prefix`: the cartridge file (safetensors, per-layer K and V rows plus the
  metadata that ties it to its base), its rows from a prefill, and `CartridgeModel`, the base
  seen through a cartridge (every generator, the chat worker and the server take it as a model);
- `engine.cartridge.self_study`: the self-study data (chunks, seed prompt families, sampled
  conversations, the teacher's top-k log-probs), the top-k distillation loss and the held-out
  comparison (no document / whole document / cartridge).

The recipe that trains one is engine/recipes/lm_cartridge.py.
"""
