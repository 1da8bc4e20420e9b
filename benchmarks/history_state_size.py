"""The carried user histories of an online run (``data.stream.histories: carry``, docs/online.md
"User histories"): bytes per event in rank 0's memory and in a checkpoint's ``histories.npz``.

``--users`` users of ``--length`` events each (63-bit item and action keys, as hashed ids are;
float times), written by ``formats.history.save_state`` and read back by ``load_state`` as a
resume does; memory: ``tracemalloc``'s traced bytes of the state ``load_state`` builds (Python's
deques, ints and floats). Usage:

    .venv/bin/python benchmarks/history_state_size.py [--users 20000] [--length 50] [--record]
"""

from __future__ import annotations

import io
import random
import tracemalloc
from collections import deque

import harness


def run(users: int, length: int) -> None:
    from recsys_dist.data.formats.history import load_state, save_state

    rng = random.Random(0)
    state = {}
    for _ in range(users):
        items = deque((rng.getrandbits(63) for _ in range(length)), maxlen=length)
        times = deque((1.6e9 + rng.random() * 1e7 for _ in range(length)), maxlen=length)
        actions = deque((rng.getrandbits(63) for _ in range(length)), maxlen=length)
        state[rng.getrandbits(63)] = ((items, times, actions), 1.7e9, [])
    f = io.BytesIO()
    save_state(state, length, "exclude", "key", f)
    disk = len(f.getvalue())
    del state
    f.seek(0)
    tracemalloc.start()
    loaded = load_state(f, length, "exclude", "key")
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    events = users * length
    assert len(loaded) == users
    print(f"{users} users x {length} events = {events} events\n")
    print("| where | bytes per event | total MiB |\n| --- | ---: | ---: |")
    print(f"| rank 0's memory (Python objects) | {memory / events:.1f} | {memory / 2**20:.1f} |")
    print(f"| histories.npz | {disk / events:.1f} | {disk / 2**20:.1f} |")


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "history_state_size", "200 users x 10 events")
    p.add_argument("--users", type=int, default=20000)
    p.add_argument("--length", type=int, default=50, help="events per user (data.schema.history.max_length)")
    args = p.parse_args(argv)
    if args.smoke:
        args.users, args.length = 200, 10
    with harness.Results(args, argv, title="carried user histories: bytes per event, memory and disk"):
        run(args.users, args.length)


if __name__ == "__main__":
    main()
