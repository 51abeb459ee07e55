"""DPO parity with an independent implementation: TRL's DPOTrainer on transformers + PEFT.

The same random tiny llama goes into both (test_peft_parity builds it: the engine's Llama and
LlamaForCausalLM + PEFT LoRA with identical weights and adapter factors). TRL runs its own
pipeline for one batch: its dataset preparation (tokenizing prompt + chosen/rejected with a
word-level tokenizer, appending EOS), its collator (chosen and rejected right-padded into one
[2B, T] batch with a completion mask) and `DPOTrainer.compute_loss`, with a frozen reference
model. The engine gets the same token ids, packs them without padding and runs lm-dpo's own
functions (`pair_logps` for the reference, `forward_pairs` + `preference_loss` for the policy).

The reference is the adapters' starting state (merged into a plain model for TRL); the policy's
adapters are then moved away from it, so the margins are not zero and the loss is not ln 2.
Loss and every adapter gradient must agree within 1e-5 relative in f32, for the sigmoid (DPO),
IPO and length-normalised (TRL's "sigmoid_norm") losses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_peft_parity import HF_NAME, TARGETS, _models, worst_adapter_grad_difference

from engine.llm.sft_data import IGNORE_INDEX, EncodedSample

pytestmark = pytest.mark.trl
torch.set_num_threads(2)

WORDS = [f"w{i}" for i in range(3, 96)]
# (prompt, chosen, rejected) in words; TRL appends EOS to both responses
PAIRS = [("w10 w11 w12 w13 w14 w15", "w20 w21 w22 w23", "w30 w31"),
         ("w40 w41 w42", "w50 w51", "w60 w61 w62 w63 w64")]


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def _engine_pair(prompt_ids: list[int], response_ids: list[int]) -> EncodedSample:
    sequence = prompt_ids + response_ids
    labels = [t if i >= len(prompt_ids) - 1 else IGNORE_INDEX
              for i, t in enumerate(sequence[1:])]          # position i predicts token i+1
    return EncodedSample(sequence[:-1], labels, False, 0, sequence)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm"])
def test_dpo_loss_and_adapter_grads_match_trl(tmp_path, loss_type):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from engine.recipes.lm_dpo import EncodedPair, forward_pairs, pair_logps
    from engine.train.preference import PreferenceLoss, preference_loss

    engine, adapters, peft_model = _models(tie=False)
    reference_hf = copy.deepcopy(peft_model).merge_and_unload().eval()   # the starting policy
    for p in reference_hf.parameters():
        p.requires_grad_(False)

    trainer = DPOTrainer(
        model=peft_model, ref_model=reference_hf, processing_class=_tokenizer(),
        train_dataset=Dataset.from_list([{"prompt": p, "chosen": " " + c, "rejected": " " + r}
                                         for p, c, r in PAIRS]),
        args=DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(PAIRS),
                       loss_type=[loss_type], beta=0.1, max_length=None, report_to=[],
                       use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0,
                       seed=0))
    batch = next(iter(trainer.get_train_dataloader()))      # both pairs (means: any order)
    pairs = [EncodedPair(_engine_pair(r["prompt_ids"], r["chosen_ids"]),
                         _engine_pair(r["prompt_ids"], r["rejected_ids"]), f"pair {i}")
             for i, r in enumerate(trainer.train_dataset)]  # TRL's own token ids
    assert batch["input_ids"].shape[0] == 2 * len(pairs)
    assert all(p.chosen.sequence[-1] == 1 and p.rejected.sequence[-1] == 1 for p in pairs)

    reference = pair_logps(engine, pairs, micro_batch=len(pairs), precision="none")
    generator = torch.Generator().manual_seed(5)        # move the policy off the reference
    with torch.no_grad():
        for i in range(2):
            for target in TARGETS:
                ours = adapters[f"layers.{i}.{target}"]
                theirs = peft_model.get_submodule(
                    f"base_model.model.model.layers.{i}.{HF_NAME[target]}")
                ours.lora_b.add_(torch.randn(ours.lora_b.shape, generator=generator) * 0.05)
                theirs.lora_B["default"].weight.copy_(ours.lora_b)

    peft_model.train()
    trl_loss = trainer.compute_loss(peft_model, batch)
    trl_loss.backward()

    settings = PreferenceLoss(beta=0.1, loss="ipo" if loss_type == "ipo" else "sigmoid",
                              length_normalized=loss_type == "sigmoid_norm")
    chosen, rejected, chosen_n, rejected_n = forward_pairs(engine, pairs)
    terms = preference_loss(settings, chosen, rejected, reference["chosen"],
                            reference["rejected"], chosen_n, rejected_n)
    loss = terms.losses.mean()
    loss.backward()

    metrics = trainer._metrics["train"]
    assert abs(terms.margins.mean().item()) > 1e-3      # a live comparison, not ln 2 at rest
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(terms.margins.mean().item(), metrics["rewards/margins"][-1],
                               rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(chosen.mean().item(), metrics["logps/chosen"][-1],
                               rtol=1e-5, atol=0)
    worst = worst_adapter_grad_difference(adapters, peft_model)
    print(f"{loss_type}: loss {loss.item():.8f} vs TRL {trl_loss.item():.8f}; worst relative "
          f"adapter-gradient difference {worst:.2e}")


def test_the_parity_check_fails_when_the_reference_is_the_raw_base(tmp_path):
    """The twin: TRL's reference here is the untuned base (what switching the adapter off
    gives), the engine's the starting policy; their losses then differ, so the parity test
    above can fail."""
    from engine.recipes.lm_dpo import EncodedPair, forward_pairs, pair_logps
    from engine.train.preference import PreferenceLoss, preference_loss

    engine, adapters, peft_model = _models(tie=False)
    ids = [[10, 11, 12], [20, 21]], [[10, 11, 12], [30, 31, 32]]
    pair = EncodedPair(_engine_pair(*ids[0]), _engine_pair(*ids[1]), "pair 0")
    with_adapters = pair_logps(engine, [pair], 1, "none")
    with torch.no_grad():
        saved = {name: a.lora_b.clone() for name, a in adapters.items()}
        for a in adapters.values():
            a.lora_b.zero_()                              # the adapter "off": the raw base
    raw_base = pair_logps(engine, [pair], 1, "none")
    with torch.no_grad():
        for name, a in adapters.items():
            a.lora_b.copy_(saved[name])
    settings = PreferenceLoss()
    c, r, cn, rn = forward_pairs(engine, [pair])
    right = preference_loss(settings, c, r, with_adapters["chosen"], with_adapters["rejected"],
                            cn, rn).losses
    wrong = preference_loss(settings, c, r, raw_base["chosen"], raw_base["rejected"],
                            cn, rn).losses
    assert torch.allclose(right, torch.tensor([0.6931472]), atol=1e-6)   # policy == reference
    assert not torch.allclose(right, wrong, rtol=1e-5, atol=0)
