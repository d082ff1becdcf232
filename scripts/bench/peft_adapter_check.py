"""Loads what a LoRA run of `train` exported, with transformers and peft: the merged checkpoint
(EXPORT_DIR) and the base checkpoint (BASE_DIR) with the peft adapter (EXPORT_DIR/adapter) by
`PeftModel.from_pretrained` (a causal LM, or with the adapter's task_type SEQ_CLS a reward model:
AutoModelForSequenceClassification, its score head from the adapter's modules_to_save). Prints
one JSON line with the largest logit gap between the two over a few token sequences and `ok`
when it is within 1e-5 (exit status 1 otherwise).
Usage: peft_adapter_check.py EXPORT_DIR BASE_DIR"""

import json
import sys

import peft
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

export_dir, base_dir = sys.argv[1], sys.argv[2]
task = json.load(open(f"{export_dir}/adapter/adapter_config.json")).get("task_type")
auto = AutoModelForSequenceClassification if task == "SEQ_CLS" else AutoModelForCausalLM
extra = {"num_labels": 1} if task == "SEQ_CLS" else {}
merged = auto.from_pretrained(export_dir, dtype=torch.float32, **extra).eval()
base = auto.from_pretrained(base_dir, dtype=torch.float32, **extra)
adapted = PeftModel.from_pretrained(base, f"{export_dir}/adapter").eval()
vocab = merged.config.vocab_size
generator = torch.Generator().manual_seed(0)
ids = torch.randint(3, vocab, (4, 24), generator=generator)
with torch.no_grad():
    a = merged(input_ids=ids).logits
    b = adapted(input_ids=ids).logits
gap = (a - b).abs().max().item()
report = {"peft_adapter_check": export_dir, "peft_version": peft.__version__, "task_type": task,
          "max_logit_gap": gap, "ok": gap <= 1e-5}
print(json.dumps(report))
sys.exit(0 if report["ok"] else 1)
