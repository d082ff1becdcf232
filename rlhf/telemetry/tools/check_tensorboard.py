"""Cross-checks a run directory written by rtrun-rlhf-telemetry with TensorBoard's own reader.

Not part of CI (it needs the tensorboard wheel). Usage, once by hand:

    pip install --target ~/.cache/rtrun-anchors/tb tensorboard
    cargo run -p rtrun-rlhf-telemetry --example telemetry_demo -- /tmp/run 20
    cargo run -p rtrun-rlhf-telemetry --example telemetry_demo -- /tmp/run 30 12   # resume
    PYTHONPATH=~/.cache/rtrun-anchors/tb python3 rlhf/telemetry/tools/check_tensorboard.py /tmp/run

TensorBoard's TensorFlow-free record reader checks both CRCs of every record; the accumulator
then applies the SessionLog START purge of a resumed run. Every scalar tag must hold exactly the
(step, value) series of metrics.jsonl (values compared at float32 precision).
"""

import glob
import json
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader


def main(run_dir):
    files = sorted(glob.glob(run_dir + "/events.out.tfevents.*"))
    events = sum(1 for f in files for _ in event_file_loader.LegacyEventFileLoader(f).Load())
    print(f"{events} records with valid CRCs in {len(files)} event file(s)")

    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    with open(run_dir + "/metrics.jsonl") as lines:
        rows = [json.loads(line) for line in lines]
    tags = accumulator.Tags()["scalars"]
    for tag in tags:
        got = [(e.step, e.value) for e in accumulator.Scalars(tag)]
        want = [(row["step"], float(row[tag])) for row in rows if tag in row]
        assert len(got) == len(want), f"{tag}: {len(got)} events, {len(want)} JSONL records"
        for (step, value), (want_step, want_value) in zip(got, want):
            assert step == want_step, f"{tag}: step {step}, expected {want_step}"
            assert abs(value - want_value) <= 1e-6 * max(1.0, abs(want_value)), (tag, step)
    print(f"{len(tags)} scalar tags match metrics.jsonl: {', '.join(tags)}")


if __name__ == "__main__":
    main(sys.argv[1])
