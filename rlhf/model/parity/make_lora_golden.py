"""Checks rtrun's LoRA adapter against `peft` and writes its golden.

`cargo run -p rtrun-rlhf-model --example write_parity_models qwen3-lora` writes qwen3-lora/: a
peft adapter directory for the qwen3 case's checkpoint (adapter_config.json,
adapter_model.safetensors, saved by rtrun), the fixed inputs and rtrun's logits of the adapted
model. This script loads the base with transformers and the adapter with
`PeftModel.from_pretrained`, runs the same inputs (positions cumsum(mask) - 1), fails if the
logits at real tokens differ from rtrun's by more than 1e-5, and writes golden.safetensors,
which rlhf/model/tests/parity.rs holds rtrun to (no Python in CI). It also checks that
`merge_and_unload` gives the same logits.

    ~/.cache/rtrun/parity-venv/bin/pip install peft
    ~/.cache/rtrun/parity-venv/bin/python rlhf/model/parity/make_lora_golden.py
"""

import pathlib

import peft
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
TOLERANCE = 1e-5


def main() -> None:
    case = HERE / "qwen3-lora"
    inputs = load_file(case / "inputs.safetensors")
    ours = load_file(case / "ours.safetensors")
    base = AutoModelForCausalLM.from_pretrained(HERE / "qwen3", dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, case).eval()
    ids = inputs["input_ids"].long()
    mask = inputs["attention_mask"].long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        merged = model.merge_and_unload()
        merged_logits = merged(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    real = mask.bool()
    diff = (logits - ours["logits"])[real].abs().max().item()
    merged_diff = (merged_logits - logits)[real].abs().max().item()
    print(f"qwen3-lora: max |logit diff| vs peft {diff:.3e}, peft merged vs unmerged {merged_diff:.3e}")
    if diff > TOLERANCE or merged_diff > TOLERANCE:
        raise SystemExit(f"qwen3-lora: differs by {max(diff, merged_diff):.3e} > {TOLERANCE}")
    save_file(
        {"logits": logits.contiguous()},
        str(case / "golden.safetensors"),
        metadata={"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    )
    print(f"ok: peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
