"""What TensorBoard shows of a run's metrics.tensorboard_dir, read with its own EventAccumulator
(every event kept): each scalar tag with its step count, first and last step and last value, and
each histogram tag with its steps and last bucket counts. In the venv of validation/peer_venv.sh:

    validation/peer_venv.sh --run validation/tensorboard_capture.py RUN/tensorboard
"""

import sys

from tensorboard.backend.event_processing import event_accumulator


def main(directory):
    acc = event_accumulator.EventAccumulator(
        directory, size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    tags = acc.Tags()
    print(f"{'scalar tag':<36} {'steps':>5} {'first':>5} {'last':>5}  last value")
    for tag in tags["scalars"]:
        events = acc.Scalars(tag)
        print(f"{tag:<36} {len(events):>5} {events[0].step:>5} {events[-1].step:>5}  {events[-1].value:.6g}")
    if tags["histograms"]:
        print(f"\n{'histogram tag':<36} {'steps':>5} {'first':>5} {'last':>5}  last: buckets, count, first buckets")
    for tag in tags["histograms"]:
        events = acc.Histograms(tag)
        h = events[-1].histogram_value
        counts = " ".join(f"{c:g}" for c in h.bucket[:8]) + (" ..." if len(h.bucket) > 8 else "")
        print(f"{tag:<36} {len(events):>5} {events[0].step:>5} {events[-1].step:>5}  {len(h.bucket)}, {h.num:g}, "
              f"{counts}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tensorboard_capture.py TENSORBOARD_DIR")
    main(sys.argv[1])
