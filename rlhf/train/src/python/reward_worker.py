"""rtrun's Python reward worker: loads a reward function from a file and scores batches.

Protocol (one JSON object per line): rtrun writes `{"queries": [...], "prompts": [...],
"labels": [...]}` on stdin; the worker answers `{"rewards": [...]}` (plus `"scores"` and
`"extra_logs"` when the function returns a dict), or `{"error": "<traceback>"}`. The first
line it writes says whether the function loaded: `{"ready": true}` or `{"error": ...}`.
The function takes OpenRLHF's arguments, `reward_func(queries, prompts, labels)`, and
returns a list (or a tensor or array) of floats, or a dict with `rewards`.
"""

import importlib.util
import json
import sys
import traceback


def numbers(value):
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(x) for x in value]


# The protocol's own stream: what the reward function prints goes to stderr instead.
PROTOCOL = sys.stdout
sys.stdout = sys.stderr


def answer(obj):
    PROTOCOL.write(json.dumps(obj) + "\n")
    PROTOCOL.flush()


def main():
    path, name = sys.argv[1], sys.argv[2]
    try:
        spec = importlib.util.spec_from_file_location("rtrun_reward", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        function = getattr(module, name)
    except BaseException:
        answer({"error": traceback.format_exc()})
        return
    answer({"ready": True})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            out = function(request["queries"], request["prompts"], request["labels"])
            if isinstance(out, dict):
                reply = {"rewards": numbers(out["rewards"])}
                if "scores" in out:
                    reply["scores"] = numbers(out["scores"])
                logs = out.get("extra_logs") or {}
                reply["extra_logs"] = {k: numbers(v) for k, v in logs.items()}
            else:
                reply = {"rewards": numbers(out)}
            answer(reply)
        except BaseException:
            answer({"error": traceback.format_exc()})


main()
