"""The table of scripts/bench-rlhf.sh from its JSONL report: engine vs HF `generate` per model
and batch size (best tokens/s over the rounds, tokens identical in every round), GRPO vs
TRL per seed (median seconds per rollout step, held-out reward gain), and SFT vs TRL's
SFTTrainer per seed and layout (training tokens/s). Usage: report.py REPORT"""

import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
if any("hf" in r for r in rows):
    print("\n## Engine vs Hugging Face `generate` (greedy, 64 new tokens, tokens/s, best round)\n")
    print("| model | batch | HF generate | rtrun engine | ratio | identical |")
    print("|---|---:|---:|---:|---:|:---:|")
for model in ["tiny", "27m"]:
    for batch in [1, 16, 64]:
        hf = [r["tokens_per_s"] for r in rows if r.get("hf") == model and r["batch"] == batch]
        ours = [r for r in rows if r.get("engine") == model and r["batch"] == batch]
        if not hf or not ours:
            continue
        same = all(r["identical_to_hf"] for r in ours)
        best = max(r["tokens_per_s"] for r in ours)
        print(f"| {model} | {batch} | {max(hf):.0f} | {best:.0f} | {best / max(hf):.2f}x | "
              f"{'yes' if same else 'NO'} |")

ours = {r["rtrun_seed"]: r for r in rows if "rtrun_seed" in r}
trl = {r["trl_seed"]: r for r in rows if "trl_seed" in r}
if ours:
    print("\n## GRPO rollout step vs TRL GRPOTrainer (16 prompts x 8 samples, 4 optimizer steps)\n")
    print("| seed | TRL s/step | rtrun s/step | ratio | TRL held-out | rtrun held-out |")
    print("|---:|---:|---:|---:|---|---|")
    ratios, gains = [], ([], [])
    for seed in sorted(ours):
        o, t = ours[seed], trl.get(seed)
        if t is None:
            continue
        ratio = t["seconds_per_rollout_median"] / o["seconds_per_rollout_median"]
        ratios.append(ratio)
        gains[0].append(t["heldout_reward_end"] - t["heldout_reward_start"])
        gains[1].append(o["heldout_reward_end"] - o["heldout_reward_start"])
        print(f"| {seed} | {t['seconds_per_rollout_median']:.3f} | "
              f"{o['seconds_per_rollout_median']:.3f} | {ratio:.2f}x | "
              f"{t['heldout_reward_start']:.3f} -> {t['heldout_reward_end']:.3f} | "
              f"{o['heldout_reward_start']:.3f} -> {o['heldout_reward_end']:.3f} |")
    if ratios:
        print(f"\nmean over seeds: step ratio {statistics.mean(ratios):.2f}x; held-out gain "
              f"TRL {statistics.mean(gains[0]):+.3f}, rtrun {statistics.mean(gains[1]):+.3f}")
        phases = {k: statistics.mean(ours[s]["phase_seconds_median"][k] for s in ours)
                  for k in next(iter(ours.values()))["phase_seconds_median"]}
        print("rtrun phase medians (s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))

sft = [r for r in rows if "rtrun_sft_seed" in r and "pair_mode" not in r and "lora" not in r]
trl_sft = {r["trl_sft_seed"]: r for r in rows if "trl_sft_seed" in r}
if sft:
    print("\n## SFT vs TRL SFTTrainer (32 samples per step, micro-batches of 8, tokens/s)\n")
    print("| seed | rtrun layout | TRL tokens/s | rtrun tokens/s | ratio | TRL loss | rtrun loss |")
    print("|---:|---|---:|---:|---:|---|---|")
    by_layout = {}
    for r in sft:
        t = trl_sft.get(r["rtrun_sft_seed"])
        if t is None:
            continue
        ratio = r["tokens_per_s"] / t["tokens_per_s"]
        by_layout.setdefault(r["layout"], []).append(ratio)
        print(f"| {r['rtrun_sft_seed']} | {r['layout']} | {t['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s']:.0f} | {ratio:.2f}x | {t['loss_first']:.3f} -> "
              f"{t['loss_last']:.3f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    for layout, ratios in by_layout.items():
        print(f"\nmean over seeds, {layout}: {statistics.mean(ratios):.2f}x TRL's tokens/s", end="")
    print()

lora = [r for r in rows if r.get("lora")]
trl_lora = {r["trl_lora_seed"]: r for r in rows if "trl_lora_seed" in r}
if lora:
    print("\n## SFT with LoRA (r 16, alpha 32, every projection) vs TRL SFTTrainer + peft "
          "(1 rank, unpacked, tokens/s)\n")
    print("| seed | TRL+peft tokens/s | rtrun tokens/s | ratio | loss at steps 1 / 10 / 20 / 30 / "
          "last: TRL | rtrun | largest curve gap |")
    print("|---:|---:|---:|---:|---|---|---:|")
    ratios = []
    for r in lora:
        t = trl_lora.get(r["rtrun_sft_seed"])
        if t is None:
            continue
        ratio = r["tokens_per_s"] / t["tokens_per_s"]
        ratios.append(ratio)
        points = lambda c: " / ".join(f"{c[i]:.3f}" for i in (0, 9, 19, 29, len(c) - 1) if i < len(c))
        gap = max(abs(a - b) for a, b in zip(t["losses"], r["losses"]))
        print(f"| {r['rtrun_sft_seed']} | {t['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{ratio:.2f}x | {points(t['losses'])} | {points(r['losses'])} | {gap:.3f} |")
    if ratios:
        print(f"\nmean over seeds: {statistics.mean(ratios):.2f}x TRL+peft's tokens/s")
    for r in rows:
        if "peft_adapter_check" in r:
            print(f"\npeft {r['peft_version']} loads {r['peft_adapter_check']}/adapter onto the base: "
                  f"largest logit gap to the merged export {r['max_logit_gap']:.2e} "
                  f"({'within' if r['ok'] else 'OUTSIDE'} 1e-5)")

pairs = [r for r in rows if "pair_mode" in r]
trl_pairs = {(r["trainer"], r["trl_pair_seed"]): r for r in rows if "trl_pair_seed" in r}
if pairs:
    print("\n## Reward model and DPO vs TRL RewardTrainer / DPOTrainer (32 pairs per step, tokens/s)\n")
    print("| trainer | seed | rtrun layout | TRL tokens/s | rtrun tokens/s | ratio | TRL loss | rtrun loss |")
    print("|---|---:|---|---:|---:|---:|---|---|")
    by = {}
    for r in pairs:
        t = trl_pairs.get((r["pair_mode"], r["rtrun_sft_seed"]))
        if t is None:
            continue
        ratio = r["tokens_per_s"] / t["tokens_per_s"]
        by.setdefault((r["pair_mode"], r["layout"]), []).append(ratio)
        print(f"| {r['pair_mode']} | {r['rtrun_sft_seed']} | {r['layout']} | "
              f"{t['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {ratio:.2f}x | "
              f"{t['loss_first']:.3f} -> {t['loss_last']:.3f} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    for (mode, layout), ratios in by.items():
        print(f"\nmean over seeds, {mode}, {layout}: {statistics.mean(ratios):.2f}x TRL's tokens/s", end="")
    print()
for r in rows:
    if "hf_rm_check" in r:
        print(f"\nExported reward model loaded by transformers ({r['hf_rm_check']}): held-out pair "
              f"accuracy {r['transformers_accuracy']:.4f} (rtrun {r['rtrun_accuracy']:.4f}), mean "
              f"margin {r['transformers_margin']:.6f} (rtrun {r['rtrun_margin']:.6f})")

streamed = [r for r in rows if "streamed" in r and not r["streamed"].startswith("tools-")]
if streamed:
    print("\n## Async and partial rollouts against the sync step (main job, same seed and data)\n")
    print("| seed | sync wall s | sync final | async reaches it at s | ratio | async final | "
          "async on the dock: reaches it at s | ratio | final | "
          "tail: sync step s | partial step s | cut |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["seed"], r["streamed"]): r for r in streamed}
    for seed in sorted({r["seed"] for r in streamed}):
        sync = by.get((seed, "sync"))
        tail, part = by.get((seed, "tail-sync")), by.get((seed, "tail-partial"))
        cells = [str(seed)]
        for variant in ("async", "async-dock"):
            asyn = by.get((seed, variant))
            if sync and asyn:
                target = sync["evals"][-1][2]
                reached = next((t for _, t, reward in asyn["evals"] if reward >= target), None)
                if variant == "async":
                    cells += [f"{sync['wall_s']:.1f}", f"{target:.3f}"]
                cells += [f"{reached:.1f}" if reached is not None else "not reached",
                          f"{reached / sync['wall_s']:.2f}x" if reached is not None
                          else f"({asyn['wall_s'] / sync['wall_s']:.2f}x wall)",
                          f"{asyn['evals'][-1][2]:.3f}"]
            else:
                cells += ["—"] * (5 if variant == "async" else 3)
        if tail and part:
            cut = 1 - part["step_s_mean"] / tail["step_s_mean"]
            cells += [f"{tail['step_s_mean']:.3f}", f"{part['step_s_mean']:.3f}", f"{cut:.0%}"]
        else:
            cells += ["—"] * 3
        print("| " + " | ".join(cells) + " |")
    for r in streamed:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phase_s_median"].items())
        print(f"\n{r['streamed']} seed {r['seed']}: phase medians (s) {phases}; response length "
              f"mean {r['response_length_mean']:.1f}, step max {r['response_length_max']:.1f}; "
              f"max staleness {r['max_staleness']:.0f}, stale groups dropped {r['stale_dropped']:.0f}")

tools = {(r["seed"], r["streamed"]): r for r in rows if str(r.get("streamed", "")).startswith("tools-")}
if tools:
    print("\n## Tool use against the same checkpoint without tools (held-out accuracy)\n")
    print("| seed | with the calculator: before -> every 20 steps -> after | calls per sample | "
          "without tools: the same |")
    print("|---:|---|---:|---|")
    for seed in sorted({s for s, _ in tools}):
        w, n = tools.get((seed, "tools-tools")), tools.get((seed, "tools-none"))
        cell = lambda r: " -> ".join(f"{a:.3f}" for _, a in r["accuracy"]) if r else "—"
        calls = f"{w['tool_calls_per_sample']:.2f}" if w else "—"
        print(f"| {seed} | {cell(w)} | {calls} | {cell(n)} |")
