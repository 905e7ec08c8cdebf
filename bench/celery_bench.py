"""Celery workers with and without oncely, side by side: ``python bench/celery_bench.py``.

One ``celery worker -P prefork -c <--concurrency>`` (``acks_late``, results ignored) on the
machine's RabbitMQ drains ``--messages`` pre-published messages of one task whose effect is
one Redis ``INCR``, three ways, in rounds with a rotating order:

``bare``
    a plain task;
``by hand``
    a Task base class of a few lines doing what a team would write by hand on the same Redis:
    a ``SET key NX PX`` claim before the task, a ``SET key done`` after it, a duplicate
    acknowledged unrun (two round trips, as oncely's two-phase mode);
``oncely``
    ``oncely.integrations.celery.IdempotentTask`` on the Redis store.

The worker starts once; each round publishes to a new queue and then tells the worker to
consume it (``add_consumer``), so the clock runs from the first delivery to the last effect,
without the worker's start-up. Reports messages per second (medians of the rounds) and each
against ``by hand``; writes ``bench/results/celery.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from worker_rounds import rotating_rounds, write_table

HERE = Path(__file__).resolve().parent
VARIANTS = ("bare", "by hand", "oncely")
TASKS = {"bare": "bench.bare", "by hand": "bench.by_hand", "oncely": "bench.oncely"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/celery_bench.py")
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    prefix = f"bench_cq_{uuid.uuid4().hex[:8]}"
    os.environ["ONCELY_BENCH_CELERY_PREFIX"] = prefix
    sys.path.insert(0, str(HERE))
    bench_app = importlib.import_module("celery_bench_app")  # after the prefix is set

    app = bench_app.app
    warm = f"{prefix}_warm"
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "celery_bench_app", "worker", "-P", "prefork",
            "-c", str(args.concurrency), "-Q", warm, "--loglevel", "warning",
            "--without-mingle", "--without-gossip", "-n", f"{prefix}@%h",
        ],
        cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
        start_new_session=True,
    )  # fmt: skip
    client = redis.Redis.from_url(bench_app.REDIS_URL)
    queues: list[str] = [warm]
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=[f"{prefix}@{os.uname().nodename}"], timeout=0.5):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit("the Celery worker did not start")
        node = f"{prefix}@{os.uname().nodename}"

        def one_round(variant: str) -> float:
            space = f"{prefix}_{uuid.uuid4().hex[:8]}"
            queues.append(space)
            task = app.signature(TASKS[variant])
            with app.producer_or_acquire() as producer:
                for n in range(args.messages):
                    task.clone(args=(space, n)).apply_async(queue=space, producer=producer)
            counter = f"{prefix}:effects:{space}"
            began = time.perf_counter()
            app.control.add_consumer(space, destination=[node], reply=True, timeout=10)
            while int(client.get(counter) or 0) < args.messages:
                time.sleep(0.005)
            took = time.perf_counter() - began
            app.control.cancel_consumer(space, destination=[node], reply=True, timeout=10)
            return args.messages / took

        med = rotating_rounds(VARIANTS, args.rounds, one_round)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        with app.connection_for_write() as connection:
            for name in queues:
                connection.default_channel.queue_delete(name)
        for name in client.scan_iter(match=f"{prefix}*"):
            client.delete(name)
        client.close()
    write_table(
        med,
        title="Celery workers with and without oncely",
        command="python bench/celery_bench.py " + " ".join(argv or sys.argv[1:]),
        setup=f"{args.messages} messages a round, celery worker -P prefork -c "
        f"{args.concurrency}, acks_late, {args.rounds} rounds",
        out=args.out,
        name="celery.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
