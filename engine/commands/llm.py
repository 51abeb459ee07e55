"""CLI handlers for the language-model text tools: `forgebench tokenize` and `forgebench
inspect-sft`. (`verify-grads` lives beside them in `engine.checks.verify_grads`.)"""

from __future__ import annotations

import json


def cmd_tokenize(args) -> int:
    """Print what a GGUF model's tokenizer makes of TEXT: ids, and per token its piece (the text
    it stands for) and its vocabulary entry, as JSON."""
    from engine.llm.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(args.model)
    ids = tok.encode(args.text, add_special=not args.no_bos, parse_special=not args.no_special)
    tokens = [{"id": i, "piece": tok.token_piece(i), "token": tok.tokens[i],
               "control": tok.is_control(i)} for i in ids]
    fields = {"model": str(args.model), "tokenizer": tok.describe(), "n_tokens": len(ids),
              "ids": ids}
    # one line per field and per token: readable, and still one JSON document
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in fields.items()]
    rows = ",\n".join("  " + json.dumps(t, ensure_ascii=False) for t in tokens)
    print("{\n" + "\n".join(lines) + '\n "tokens": [\n' + rows + "\n ]\n}")
    return 0


def cmd_verify_grads(args) -> int:
    """Run the LoRA gradient checks (`engine.checks.verify_grads`); exit 1 if any fails."""
    from engine.checks import verify_grads

    results = verify_grads.run_checks(args.target, samples=args.samples)
    print(json.dumps(results, indent=1) if args.json else verify_grads.format_results(results))
    return 0 if verify_grads.all_passed(results) else 1


def cmd_inspect_sft(args) -> int:
    """Print the first samples of an lm-sft config's data as the trainer will see them, with
    the supervised tokens between ⟦ ⟧, and the dataset's counts."""
    from engine.config import load_config
    from engine.errors import ForgebenchError
    from engine.llm.sft_data import inspect_samples

    config = load_config(args.config)
    if getattr(config, "recipe", None) != "lm-sft":
        raise ForgebenchError("inspect-sft needs an lm-sft config", path=args.config,
                              where="field 'recipe'")
    if config.mode == "cpt":
        raise ForgebenchError("inspect-sft shows chat samples, and a mode \"cpt\" run has "
                              "none: every token of its packed documents is a target",
                              path=args.config, where="field 'mode'",
                              hint="the run's data_encoded event counts its documents and "
                                   "blocks")
    if not config.model.gguf:
        raise ForgebenchError("inspect-sft reads the tokenizer and chat template of a GGUF base",
                              path=args.config, where="field 'model.gguf'",
                              hint="set model.gguf (run-directory bases have no chat template)")
    data = config.data
    data_path = config.resolve_path(data.path, "field 'data.path'")
    model_path = config.resolve_path(config.model.gguf, "field 'model.gguf'")
    report = inspect_samples(model_path, data_path, keys=data,
                             n=args.n, max_len=data.max_len, truncation=data.truncation,
                             system=data.system, split="train" if data_path.is_dir() else None,
                             enable_thinking=data.enable_thinking)
    if args.json:
        print(json.dumps(report, ensure_ascii=False, indent=1))
        return 0
    print(f"model: {report['model']}\ntemplate: {report['template']}\ndata: {report['data']}")
    for sample in report["samples"]:
        print(f"\n--- line {sample['line']}: {sample['input_tokens']} input tokens, "
              f"{sample['supervised_tokens']} supervised"
              + (" (truncated)" if sample["truncated"] else "") + " ---")
        print(sample["marked"])
    s = report["summary"]
    print(f"\n{s['examples']} examples: {s['kept']} kept, {s['truncated']} truncated, "
          f"{s['dropped']} dropped (max_len {report['max_len']}, {report['truncation']}); "
          f"{s['input_tokens']} input tokens, {s['supervised_tokens']} supervised, "
          f"longest {s['longest']}")
    return 0
