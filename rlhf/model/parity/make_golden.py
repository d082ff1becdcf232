"""Checks rtrun's tiny checkpoints against Hugging Face transformers and writes golden files.

For each case directory (llama, qwen2, qwen3) written by
`cargo run -p rtrun-rlhf-model --example write_parity_models`, this script
  1. loads the checkpoint rtrun saved (config.json + safetensors, sharded for qwen2) with
     transformers' AutoModelForCausalLM in float32,
  2. runs the fixed inputs of inputs.safetensors with the same positions rtrun uses
     (cumsum(mask) - 1, padding clamped to 0),
  3. compares the logits at real tokens and the response log-probs with rtrun's own outputs
     (ours.safetensors) and fails if they differ by more than 1e-4,
  4. encodes a fixed string with the saved tokenizer.json through transformers,
  5. writes golden.safetensors (logits, response_log_probs, tokenizer_ids) that the Rust test
     tests/parity.rs compares against in CI (which never runs Python).

See README.md in this directory for how to set up the environment and rerun it.
"""

import pathlib
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

HERE = pathlib.Path(__file__).resolve().parent
TOLERANCE = 1e-4
TOKENIZER_TEXT = "The policy model writes an answer, and the critic guesses the score: 2 + 2 = 4."


def run_case(case_dir: pathlib.Path) -> float:
    inputs = load_file(case_dir / "inputs.safetensors")
    ours = load_file(case_dir / "ours.safetensors")
    model = AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    input_ids = inputs["input_ids"].long()
    mask = inputs["attention_mask"].long()
    action_mask = inputs["action_mask"].long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits.float()
    num_actions = action_mask.shape[1]
    seq = input_ids.shape[1]
    response_logits = logits[:, seq - 1 - num_actions : seq - 1]
    targets = input_ids[:, seq - num_actions :]
    log_probs = torch.log_softmax(response_logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_probs = log_probs * action_mask.float()

    real = mask.bool()
    logit_diff = (logits - ours["logits"])[real].abs().max().item()
    logprob_diff = (log_probs - ours["response_log_probs"]).abs().max().item()
    print(f"{case_dir.name}: max |logit diff| {logit_diff:.3e}, max |log-prob diff| {logprob_diff:.3e}")
    worst = max(logit_diff, logprob_diff)
    if worst > TOLERANCE:
        raise SystemExit(f"{case_dir.name}: rtrun and transformers differ by {worst:.3e} > {TOLERANCE}")

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(case_dir / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(TOKENIZER_TEXT, add_special_tokens=False), dtype=torch.int64)
    if tokenizer.decode(ids.tolist()) != TOKENIZER_TEXT:
        raise SystemExit(f"{case_dir.name}: tokenizer does not round-trip the fixed text")

    save_file(
        {
            "logits": logits.contiguous(),
            "response_log_probs": log_probs.contiguous(),
            "tokenizer_ids": ids,
        },
        str(case_dir / "golden.safetensors"),
        metadata={
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizer_text": TOKENIZER_TEXT,
        },
    )
    return worst


def run_reward_case(case_dir: pathlib.Path) -> float:
    """A reward model saved by rtrun loads as *ForSequenceClassification with the same scores."""
    inputs = load_file(case_dir / "inputs.safetensors")
    ours = load_file(case_dir / "ours.safetensors")
    model = AutoModelForSequenceClassification.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    input_ids = inputs["input_ids"].long()
    mask = inputs["attention_mask"].long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        rewards = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits.float().squeeze(-1)
    diff = (rewards - ours["rewards"]).abs().max().item()
    print(f"{case_dir.name}: max |reward diff| {diff:.3e}")
    if diff > TOLERANCE:
        raise SystemExit(f"{case_dir.name}: rtrun and transformers rewards differ by {diff:.3e} > {TOLERANCE}")
    save_file({"rewards": rewards.contiguous()}, str(case_dir / "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    return diff


def main() -> None:
    cases = sys.argv[1:] or ["llama", "qwen2", "qwen3", "qwen2-sw", "mistral-sw", "qwen2-rm"]
    for name in cases:
        if name.endswith("-rm"):
            run_reward_case(HERE / name)
        else:
            run_case(HERE / name)
    print(f"ok: transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
