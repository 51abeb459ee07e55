"""`forgebench generate`: from a run (its recipe's `generate`) or from a GGUF file, streamed.
With --json a GGUF model prints one JSON line per token ({"event": "token", "id", "text",
"logprob"}) as it is generated and the result ({"event": "done", ...}) as the last line.
`forgebench decide RUN "request"`: a decision run's chosen option (or "abstain") as JSON.

No torch at module top level. The GGUF path under llama.cpp numerics without --lora runs the
torch-free C decoder (engine/llm/native_lm.py: the same tokens, no torch import for a greedy
reply); otherwise, or where the C decoder does not serve the file bit for bit, it loads the torch
model (engine.models.gguf_model). Both decode with engine.llm.generate.
"""

from __future__ import annotations

import json
import sys

from engine.errors import ForgebenchError


def cmd_generate(args) -> int:
    if args.model:
        return cmd_generate_gguf(args)
    # a run's hook: imported here, since the recipes' config schemas (pydantic) take a
    # noticeable part of a GGUF reply's start
    from engine.jobs import recipe_hook
    from engine.rundir import RunDir

    if not args.run_dir:
        raise ForgebenchError("give a run directory or --model FILE.gguf",
                              where="arguments", hint="forgebench generate RUN_DIR --prompt ...")
    run = RunDir(args.run_dir).require()
    generate = recipe_hook(run, "generate", "does not generate text",
                           "use 'forgebench sample' for generator runs")
    result = generate(run, run.checkpoint(args.checkpoint), args)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    return 0


def cmd_decide(args) -> int:
    """`forgebench decide RUN "request"`: the run's recipe's `decide`, printed as JSON."""
    from engine.jobs import recipe_hook
    from engine.rundir import RunDir

    run = RunDir(args.run_dir).require()
    decide = recipe_hook(run, "decide", "does not make decisions", "use an lm-decision run")
    options = [o.strip() for o in args.options.split(",") if o.strip()] if args.options else None
    result = decide(run, run.checkpoint(args.checkpoint), args.request,
                           question=args.question, option_ids=options)
    print(json.dumps(result, indent=2))
    return 0


def _prompt_ids(model, tokenizer, args) -> list[int]:
    if not args.chat:
        return tokenizer.encode(args.prompt, add_special=True, parse_special=True)
    from engine.llm.chat import encode_prompt, render_chat

    messages = ([{"role": "system", "content": args.system}] if args.system else []) \
        + [{"role": "user", "content": args.prompt}]
    text = render_chat(model.gguf, messages, add_generation_prompt=True,
                       enable_thinking=False if args.no_think else None)
    return encode_prompt(tokenizer, text)


def cmd_generate_gguf(args) -> int:
    """`forgebench generate --model FILE.gguf --prompt ...`: stream the continuation to stdout.

    Weights default to "dense-cache": every decoded token reads every weight, so keeping each
    layer dequantized after its first use makes decoding ~3x faster than "packed" (which
    dequantizes them all again per token) for f32 copies of the weights (~1 GB for
    gemma-3-270m); loading stays instant either way, since the cache fills as layers first run.
    """
    from engine.llm.generate import generate
    from engine.lm_load import load_generator, model_memory
    from engine.sampling import SamplingSettings

    numerics = args.numerics or "llamacpp"
    weights = getattr(args, "weights", "dense-cache")
    model, tokenizer = load_generator(args.model, numerics, weights, args.lora,
                                      cartridge=getattr(args, "cartridge", None))
    prompt = _prompt_ids(model, tokenizer, args)
    settings = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                repetition_penalty=args.repetition_penalty)
    emit = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    token_line = (lambda event: print(json.dumps({"event": "token", **event.as_dict()},
                                                 ensure_ascii=False), flush=True)) \
        if args.json else None
    result = generate(model, tokenizer, prompt, max_new_tokens=args.max_tokens, settings=settings,
                      seed=args.seed, stop=args.stop, on_text=emit, on_token=token_line)
    if args.json:
        # one line per token as it is generated, then the result as the last line
        out = {"event": "done"} | result.as_dict() | {
            "model": str(args.model), "numerics": numerics, "settings": settings.as_dict(),
            "seed": args.seed, "weights": weights, "memory": model_memory(model),
            "cartridge": getattr(args, "cartridge", None)}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0
