"""``oncely demo``: the same duplicate-ridden workload through three consumers.

An at-least-once broker in a SQLite file (:mod:`oncely.testing.file_broker`) delivers a seeded
workload of payments (:mod:`oncely.demo.workload`) with every duplicate source of R1 injected:
producer retries, acknowledgements lost on the way back, workers SIGKILLed after their writes
and before their acknowledgement, handlers outliving their lock, a copy handed to two workers at
once, and ids reused for changed content. Three consumers (:mod:`oncely.demo.consumers`) take it
in turn: a naive one, oncely's transactional mode and oncely's two-phase mode. The report
(:mod:`oncely.demo.report`) is read from the databases::

    from oncely.demo import DemoOptions, run_demo

    report = run_demo(DemoOptions(messages=600, workers=3, seed=7))
    report.to_dict()["naive"]["extra_effects"]     # > 0: payments applied twice
    report.to_dict()["oncely-two-phase"]["lost"]   # 0

Or from a shell: ``python -m oncely.demo --messages 600 --workers 3 --seed 7 [--json]``.
"""

from oncely.demo.consumers import CONSUMERS, ConsumerName
from oncely.demo.report import ConsumerReport, DemoReport, Injected
from oncely.demo.run import DemoError, DemoOptions, run_demo

__all__ = [
    "CONSUMERS",
    "ConsumerName",
    "ConsumerReport",
    "DemoError",
    "DemoOptions",
    "DemoReport",
    "Injected",
    "run_demo",
]
