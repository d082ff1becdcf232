"""Loads a reward model `train --mode rm` exported with transformers'
AutoModelForSequenceClassification and scores held-out preference pairs (`{"question", "chosen",
"rejected"}` per line) the way the trainer tokenizes them (chat template, response ending in EOS):
prints one JSON line with transformers' pair accuracy and mean margin, for comparison with the
run's last `eval/accuracy` and `eval/reward/margin`. Usage: hf_reward_model_check.py MODEL_DIR
PAIRS_JSONL RUN_DIR"""

import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_dir, pairs_path, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
eos = json.load(open(f"{model_dir}/generation_config.json"))["eos_token_id"]
eos = eos if isinstance(eos, list) else [eos]
pairs = [json.loads(line) for line in open(pairs_path) if line.strip()]
correct, margins = 0, []
for p in pairs:
    user = [{"role": "user", "content": p["question"]}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    scores = []
    for response in (p["chosen"], p["rejected"]):
        whole = tok.apply_chat_template(
            user + [{"role": "assistant", "content": response}], tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids += tok(whole[len(prompt):], add_special_tokens=False)["input_ids"]
        if ids[-1] not in eos:
            ids.append(eos[0])
        with torch.no_grad():
            scores.append(model(torch.tensor([ids])).logits[0, 0].item())
    correct += scores[0] > scores[1]
    margins.append(scores[0] - scores[1])
rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl") if line.strip()]
last = [r for r in rows if "eval/accuracy" in r][-1]
print(json.dumps({
    "hf_rm_check": type(model).__name__,
    "transformers_accuracy": correct / len(pairs),
    "transformers_margin": sum(margins) / len(margins),
    "rtrun_accuracy": last["eval/accuracy"],
    "rtrun_margin": last["eval/reward/margin"],
}))
