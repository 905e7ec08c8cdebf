"""The ``core`` section of ``bench/run.py``: the pure decision path per message, no I/O (key
validation, payload fingerprint, claim decision)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from cases import BenchError, order, timed, us_per

import oncely
from oncely._core.flows import Step, decide
from oncely._core.keys import validate_key
from oncely._core.records import Status
from oncely._core.state import apply_claim, claim_event


def run_core(n: int, rounds: int) -> list[dict[str, Any]]:
    limits = oncely.Limits()
    keys = [f"order-{i:08d}" for i in range(n)]
    payloads = [order(i) for i in range(n)]
    fps = [oncely.fingerprint(p) for p in payloads]
    token = os.urandom(16).hex()
    lease_ms, keep_ms = 30_000, 7 * 86_400_000
    now = time.time_ns() // 1_000_000
    done = [
        apply_claim(
            None, claim_event("bench", k, fp, token, 0, keep_ms, True, Status.COMPLETED), now
        )[1].record
        for k, fp in zip(keys, fps, strict=True)
    ]

    def validate() -> None:
        for k in keys:
            validate_key(k, limits)

    def fingerprint() -> None:
        for p in payloads:
            oncely.fingerprint(p)

    def decide_new() -> None:
        for k, fp in zip(keys, fps, strict=True):
            claim = apply_claim(
                None, claim_event("bench", k, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.PROCEED:
                raise BenchError("a new key must proceed")

    def decide_dup() -> None:
        for k, fp, rec in zip(keys, fps, done, strict=True):
            claim = apply_claim(
                rec, claim_event("bench", k, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.DUPLICATE:
                raise BenchError("a completed key must be a duplicate")

    def whole() -> None:
        for k, p in zip(keys, payloads, strict=True):
            key = validate_key(k, limits)
            fp = oncely.fingerprint(p)
            claim = apply_claim(
                None, claim_event("bench", key, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.PROCEED:
                raise BenchError("a new key must proceed")

    steps: list[tuple[str, Callable[[], None]]] = [
        ("validate_key", validate),
        ("fingerprint (~300 B dict)", fingerprint),
        ("apply_claim + decide (new key)", decide_new),
        ("apply_claim + decide (duplicate)", decide_dup),
        ("total: validate + fingerprint + decide (new)", whole),
    ]
    for _, fn in steps:  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name, _ in steps}
    for _ in range(rounds):
        for name, fn in steps:
            samples[name].append(us_per(timed(fn), n))
    return [{"step": name, "us": samples[name]} for name, _ in steps]
