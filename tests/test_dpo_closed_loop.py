"""The closed loop on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1): SFT → blind A/B with a
scripted rater → DPO on its judgements → a second blind session on held-out prompts.

The rule the rater checks: an answer that ends with a question beats one that does not (both or
neither: a tie). The lm-sft adapter learns answers of which a quarter end with a follow-up
question, so its samples sometimes do and its greedy answers mostly do not. Session 1 compares
six sampled answers of that SFT checkpoint per prompt, on prompts neither training saw (the
seed is the recorded point of the comparison); the rater answers through `ABSession.answer`,
the same fsynced ratings store the app writes. "Train on these preferences" is then done as
the app does it (export with card, `dpo_config_for`, a real `forgebench run`). Session 2,
greedy like the app's text sessions, puts the tuned model against its reference (the SFT
checkpoint) on prompts held out of all of it: the tuned model must win at least 80% (ties
half) with a 95% Wilson interval above 0.5.
"""

from __future__ import annotations

import json

import pytest
from lm_pretrain_support import forgebench

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

TOPICS = """cat river moon bread violin forest train garden winter clock bridge candle desert
island ladder mirror orchard pencil rainbow saddle teapot tunnel volcano wagon whale anchor
basket castle dolphin engine feather glacier harbor jacket kettle lantern meadow needle owl piano
apple beetle cactus drum eagle fern goat hammer igloo jungle kite lemon mountain nest ocean
pumpkin rabbit scarf tiger valley windmill yacht zebra barn cloud dragonfly elephant fountain
comet lighthouse pebble tulip canyon compass falcon lagoon marble parrot quilt reef spoon
thimble umbrella walnut""".split()
# three disjoint sets: the SFT data, the first blind session, and the held-out second session
SFT_TOPICS, SESSION_TOPICS, HELD_OUT = TOPICS[:40], TOPICS[40:72], TOPICS[72:]
# six sampled systems (15 pairs per prompt): the start asks on about 6% of its samples, and
# three gave 6 preferences
SEEDS = (1, 2, 3, 4, 5, 6)
# an answer with its question is about 20 tokens; at 24 a model that carried on past the "?"
# and one that stopped could not be told apart
MAX_TOKENS = 32


def prompt(topic: str) -> str:
    return f"Tell me one thing about the {topic}."


def sft_answer(i: int, topic: str) -> str:
    fact = f"The {topic} is something many people find interesting."
    return fact + (f" Would you like to hear more about the {topic}?" if i % 4 == 0 else "")


def ends_with_question(text: str) -> bool:
    return text.strip().endswith("?")


def rate(session) -> None:
    """The scripted rater: the answer that ends with a question wins; else a tie."""
    while not session.finished:
        left, right = (ends_with_question(side.output) for side in
                       session.sides(session.current()))
        session.answer("left" if left and not right else "right" if right and not left
                       else "tie")


def test_dpo_from_blind_ratings_wins_a_held_out_blind_session(tmp_path, gemma_gguf):
    from app.viewmodels import ab as vm
    from app.viewmodels.workspace import Workspace
    from engine.config import recipe_module
    from engine.rundir import RunDir
    from engine.sampling import SamplingSettings
    from engine.train.lm_base import answer

    ws = Workspace.create(tmp_path / "ws", name="closed loop")
    data = ws.configs_dir / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": prompt(t), "response": sft_answer(i, t)})
                            + "\n" for i, t in enumerate(SFT_TOPICS)))
    # lr 5e-4 for 60 steps, so the start stops after its answers: p(end of turn) over the 40
    # training answers 0.785 after "?" and 0.826 after "interesting." (at 1e-3 for 30 steps
    # 0.22 after "?": the tuned model asked but ran on past the "?" into the token limit; at
    # 2e-3 the run swung from step to step and its last checkpoint never stopped). A cosine
    # 1e-3 run put 0.61 after "interesting." and its greedy answers asked on 8 of 12 held-out
    # prompts, leaving the tuned model nothing to win. Checkpoints every 20 steps show the fit.
    (ws.configs_dir / "sft.toml").write_text(f"""\
recipe = "lm-sft"
seed = 0
steps = 60
save_every = 20
[model]
gguf = "{gemma_gguf}"
weights = "dense-cache"
[data]
path = "sft.jsonl"
max_len = 96
[lora]
rank = 8
alpha = 16.0
targets = ["q", "v"]
[optim]
lr = 5e-4
[train]
window = 8
micro_batch = 8
""")
    sft = ws.runs_dir / "sft"
    forgebench("run", str(ws.configs_dir / "sft.toml"), "--out", str(sft), "--threads", "2",
               timeout=7200)
    checkpoint = RunDir(sft).latest_checkpoint()

    # session 1: six sampled answers of the SFT checkpoint per prompt (prompts it never saw)
    base, _ = recipe_module("lm-sft").load_trained(RunDir(sft), checkpoint)
    sampled = SamplingSettings(temperature=1.0, top_k=40)
    systems = {}
    for seed in SEEDS:
        # a draw per prompt: one generator seed for every prompt replays the same uniforms, so
        # all 32 answers of a system took the same branch and the session held three draws
        outputs = {prompt(t): answer(base, prompt(t), MAX_TOKENS, settings=sampled,
                                     seed=1000 * seed + i)
                   for i, t in enumerate(SESSION_TOPICS)}
        systems[f"sft/{checkpoint.name}#seed{seed}"] = {
            "run": str(sft), "checkpoint": checkpoint.name, "kind": "text",
            "settings": {"temperature": 1.0, "top_k": 40, "seed": seed,
                         "prompt_seed": "1000 * seed + prompt index", "max_tokens": MAX_TOKENS},
            "outputs": outputs}
    first = vm.ABSession.create(ws.root / "ratings", "sampled-sft", systems, "scripted",
                                allow_differences=("seed",),
                                generation={"max_tokens": MAX_TOKENS, "temperature": 1.0})
    rate(first)
    answers = first.store.answers()
    preferences = sum(a["choice"] != "tie" for a in answers)
    print(f"session 1: {len(answers)} pairs, {preferences} preferences, "
          f"{len(answers) - preferences} ties; SFT samples ending with '?': "
          f"{sum(ends_with_question(o) for s in systems.values() for o in s['outputs'].values())}"
          f" of {len(SEEDS) * len(SESSION_TOPICS)}")
    assert preferences >= 10

    # "Train on these preferences", as the pane does it: its 10 steps (40 of the 54 pairs). At
    # 30 steps the same run won 10 with 2 ties, those two tuned answers running on past the "?"
    # into gibberish, and from a start that asked more often 30 steps turned every held-out
    # answer to gibberish (the chosen log-probs fell with the rejected ones)
    dataset = first.export_preferences(vm.next_free(ws.datasets_dir, "preferences-sampled-sft"))
    config = vm.dpo_config_for(first, dataset, ws.configs_dir)
    text = config.read_text()       # four pairs a step: what two CPU cores can afford
    config.write_text(text.replace("window = 8", "window = 4").replace('weights = "auto"',
                                                                        'weights = "dense-cache"'))
    tuned = ws.runs_dir / "dpo"
    forgebench("run", str(config), "--out", str(tuned), "--threads", "2", timeout=7200)
    curve = [r for r in RunDir(tuned).metrics() if r.get("split") == "train"]
    print("step  loss    margin   accuracy")
    for r in curve:
        print(f"{r['step']:4d}  {r['loss']:.4f}  {r['reward_margin']:+.4f}  "
              f"{r['preference_accuracy']:.2f}")
    assert curve[-1]["reward_margin"] > 0

    # session 2: "Compare with the previous model", greedy, on held-out prompts
    held = vm.held_out_prompts([prompt(t) for t in HELD_OUT], tuned)
    (tuned_dir, tuned_ckpt), (ref_dir, ref_ckpt) = vm.comparison_systems(tuned)
    assert (ref_dir, ref_ckpt) == (str(sft), checkpoint.name)
    greedy = {"prompts": held, "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0}
    compared = {}
    for run_dir, name in ((tuned_dir, tuned_ckpt), (ref_dir, ref_ckpt)):
        run = RunDir(run_dir)
        model, _ = recipe_module(run.manifest()["recipe"]).load_trained(run,
                                                                        run.checkpoint(name))
        compared[vm.system_name(run.path, name)] = {
            "run": run_dir, "checkpoint": name, "kind": "text",
            "settings": {k: v for k, v in greedy.items() if k != "prompts"},
            "outputs": {p: answer(model, p, MAX_TOKENS) for p in held}}
    second = vm.ABSession.create(ws.root / "ratings", "tuned-vs-sft", compared, "scripted",
                                 generation=greedy)
    rate(second)
    row, = second.results()["pairs"]
    tuned_name = vm.system_name(tuned, tuned_ckpt)
    win = row["win_rate_a"] if row["a"] == tuned_name else 1 - row["win_rate_a"]
    low, high = (row["ci_low"], row["ci_high"]) if row["a"] == tuned_name else \
        (1 - row["ci_high"], 1 - row["ci_low"])
    print(f"session 2: tuned {tuned_name} vs {vm.system_name(sft, ref_ckpt)} on {len(held)} "
          f"held-out prompts: win rate {win:.3f}, 95% Wilson [{low:.3f}, {high:.3f}] "
          f"(wins {row['wins_a']}/{row['wins_b']}, ties {row['ties']})")
    for p in held:
        print(f"  {p!r}: tuned {compared[tuned_name]['outputs'][p]!r} | reference "
              f"{compared[vm.system_name(sft, ref_ckpt)]['outputs'][p]!r}")
    assert win >= 0.8 and low > 0.5
