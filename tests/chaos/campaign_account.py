"""The bad-input campaign's account (:mod:`tests.chaos.campaign`): the consumer's log read as it
arrives (:class:`LogBook`), where every copy ended (:func:`account`), the invariants broken and
the expectations missed (:class:`Findings`), and the per-class table and ``VERDICT`` line
(:class:`Report`).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.campaign_brokers import DeadCopy, Sent
from tests.chaos.campaign_plan import DEAD, SPECS, Copy, Logical, Plan

WARNING_LEVELS = ("warning", "error", "critical")
_SETTLE_FAILED = re.compile(r"could not \w+ a message \(")


# ---------------------------------------------------------------------- the consumer's log


class LogBook:
    """The consumer's stderr, parsed as it arrives: every line must be one JSON object."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.bad: list[bytes] = []
        self.acks: list[dict[str, Any]] = []
        self.ack_idents: set[str] = set()
        self._seen = 0

    def feed(self, lines: list[bytes]) -> None:
        fresh, self._seen = lines[self._seen : len(lines)], len(lines)
        for raw in fresh:
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:
                self.bad.append(raw)
                continue
            if not isinstance(record, dict):
                self.bad.append(raw)
                continue
            self.records.append(record)
            if record.get("broker_action") == "ack":
                self.acks.append(record)
                ident = ident_of(record)
                if ident is not None:
                    self.ack_idents.add(ident)


def ident_of(record: dict[str, Any]) -> str | None:
    transport = record.get("transport")
    if not isinstance(transport, dict):
        return None
    for name in ("entry_id", "stream_seq"):
        if transport.get(name) is not None:
            return str(transport[name])
    return None


# ---------------------------------------------------------------------- the account


@dataclass
class Row:
    cls: str
    expected: str
    sent: int = 0
    dropped: int = 0
    processed: int = 0
    duplicate: int = 0
    dead: int = 0
    no_reason: int = 0
    queued: int = 0
    effects: int = 0
    lost: int = 0
    extra: int = 0
    ok: bool = True


COUNTS = ("sent", "dropped", "processed", "duplicate", "dead", "no_reason", "queued", "effects")
COUNTS += ("lost", "extra")
HEAD = ("class", "sent", "expected", "processed", "duplicate", "dead-lettered", "still queued")
HEAD += ("effects", "lost", "dropped by broker", "ok")


def _cells(r: Row, ok: str) -> tuple[str, ...]:
    dead = f"{r.dead}" + (f" ({r.no_reason} without reason)" if r.no_reason else "")
    lost = f"{r.lost}" + (f" (+{r.extra} extra)" if r.extra else "")
    counts = (str(r.processed), str(r.duplicate), dead, str(r.queued), str(r.effects), lost)
    return (r.cls, str(r.sent), r.expected, *counts, str(r.dropped), ok)


@dataclass
class Report:
    broker: str
    seed: int
    messages: int
    flags: list[str]
    rows: list[Row]
    violations: list[str]
    mismatches: list[str]
    notes: list[str]
    alive: bool
    exit_code: int | None
    elapsed_s: float
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.mismatches

    def table(self) -> str:
        total = Row("TOTAL", "")
        for row in self.rows:
            for name in COUNTS:
                setattr(total, name, getattr(total, name) + getattr(row, name))
        lines = [HEAD, *(_cells(r, "ok" if r.ok else "FAIL") for r in self.rows), _cells(total, "")]
        widths = [max(len(line[i]) for line in lines) for i in range(len(HEAD))]
        rule = "  ".join("-" * w for w in widths)
        out = []
        for i, line in enumerate(lines):
            cells = [
                c.ljust(w) if j in (0, 2) else c.rjust(w)
                for j, (c, w) in enumerate(zip(line, widths, strict=True))
            ]
            out.append("  ".join(cells).rstrip())
            if i in (0, len(lines) - 2):
                out.append(rule)
        return "\n".join(out)

    def verdict(self) -> str:
        sent = sum(r.sent for r in self.rows)
        failing = [r.cls for r in self.rows if not r.ok]
        return (
            f"VERDICT {self.broker}: {'PASS' if self.ok else 'FAIL'}: sent={sent} "
            f"dropped by broker={sum(r.dropped for r in self.rows)} "
            f"processed={sum(r.processed for r in self.rows)} "
            f"duplicate={sum(r.duplicate for r in self.rows)} "
            f"dead-lettered={sum(r.dead for r in self.rows)} "
            f"(without reason={sum(r.no_reason for r in self.rows)}) "
            f"still queued={sum(r.queued for r in self.rows)} "
            f"lost={sum(r.lost for r in self.rows)} "
            f"consumer={'alive' if self.alive else 'DEAD'} exit={self.exit_code}; "
            f"{len(self.rows) - len(failing)}/{len(self.rows)} classes as expected; "
            f"{len(self.violations)} invariant violations, {len(self.mismatches)} expectation "
            f"differences ({self.elapsed_s:.1f}s)"
        )

    def render(self) -> str:
        parts = [
            f"bad-input campaign on {self.broker}: seed={self.seed} messages>={self.messages} "
            f"flags={' '.join(self.flags) or '(none of the new ones)'}",
            self.table(),
        ]
        if self.violations:
            parts.append("INVARIANT VIOLATIONS:\n" + "\n".join(f"  - {v}" for v in self.violations))
        if self.mismatches:
            parts.append("EXPECTATIONS NOT MET:\n" + "\n".join(f"  - {m}" for m in self.mismatches))
        if self.reasons:
            parts.append(
                "a dead-letter reason of each class:\n"
                + "\n".join(f"  {c}: {r[:160]}" for c, r in self.reasons.items())
            )
        if self.notes:
            parts.append("notes:\n" + "\n".join(f"  - {n}" for n in self.notes))
        parts.append(self.verdict())
        return "\n".join(parts)


def short(items: Iterable[object], limit: int = 3, width: int = 240) -> str:
    items = list(items)
    shown = "; ".join(str(i)[:width] for i in items[:limit])
    return shown + (f"; ... {len(items) - limit} more" if len(items) > limit else "")


def _numbers(ns: list[int]) -> str:
    return ",".join(map(str, ns[:8])) + (f",... ({len(ns)})" if len(ns) > 8 else "")


class Findings:
    """What went wrong, grouped for the report: broken invariants by kind, and missed
    expectations by class and text (with the numbers of the messages that missed them)."""

    def __init__(self) -> None:
        self.broken: defaultdict[str, list[str]] = defaultdict(list)
        self.missed: defaultdict[str, defaultdict[str, list[int]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.reasons: dict[str, str] = {}  # one dead-letter reason per class, for the report

    def violations(self) -> list[str]:
        return [f"{kind}: {len(items)}: {short(items, 6)}" for kind, items in self.broken.items()]

    def mismatches(self) -> list[str]:
        out = []
        for cls, texts in self.missed.items():
            for text, ns in list(texts.items())[:3]:
                out.append(f"{cls} [{_numbers(ns)}]: {text}")
            if len(texts) > 3:
                out.append(f"{cls}: {len(texts) - 3} more kinds of difference")
        return out


def _expected_states(logical: Logical, sent: dict[str, Sent]) -> Counter[str]:
    expected = Counter(logical.states)
    for copy in logical.copies:
        if sent[copy.tag].dropped:
            for state in ("duplicate", DEAD + "key_conflict", *expected):
                if expected[state] > 0:
                    expected[state] -= 1
                    break
            expected["dropped"] += 1
    return +expected


def _is_processed(record: dict[str, Any]) -> bool:
    return record.get("outcome") in ("processed", "stale_reclaimed")


class Accounting:
    """Where every copy ended (see :func:`account`)."""

    def __init__(self, driver: Any, plan: Plan, sent: dict[str, Sent], book: LogBook) -> None:
        self.driver = driver
        self.plan = plan
        self.sent = sent
        self.book = book
        self.found = Findings()
        self.by_ident = {s.ident: tag for tag, s in sent.items() if s.ident is not None}
        self.spelled = {k: id(lg) for lg in plan.logicals for k in lg.spellings}
        self.acks_by_tag: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
        self.acks_by_logical: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        for record in book.acks:
            if driver.identifies_copies:
                tag = self.by_ident.get(ident_of(record) or "")
                if tag is not None:
                    self.acks_by_tag[tag].append(record)
                    continue
            elif isinstance(record.get("key"), str) and record["key"] in self.spelled:
                self.acks_by_logical[self.spelled[record["key"]]].append(record)
                continue
            self.found.broken["acknowledged lines that name no copy sent"].append(str(record))

    def dead_letters(self, dead: list[DeadCopy]) -> dict[str, list[DeadCopy]]:
        by_tag: defaultdict[str, list[DeadCopy]] = defaultdict(list)
        for copy in dead:
            if copy.tag is None or copy.tag not in self.sent:
                self.found.broken["dead-letter copies of no copy sent"].append(str(copy))
            else:
                by_tag[copy.tag].append(copy)
        return by_tag

    def check_reasons(self, logical: Logical, copy: Copy, copies: list[DeadCopy], row: Row) -> None:
        spec, found = logical.spec, self.found
        for dc in copies:
            if not dc.reason or not dc.outcome:
                row.no_reason += 1
                found.broken["dead-lettered without x-oncely-reason or x-oncely-outcome"].append(
                    str(dc)
                )
                continue
            found.reasons.setdefault(spec.name, f"{dc.outcome}: {dc.reason}")
            for pattern in spec.reasons + copy.reasons:
                if not re.search(pattern, dc.reason, re.IGNORECASE):
                    text = f"reason does not match /{pattern}/: {dc.reason[:200]!r}"
                    found.missed[spec.name][text].append(logical.n)
            for pattern in spec.forbid:
                if re.search(pattern, dc.reason, re.IGNORECASE):
                    text = f"reason matches /{pattern}/: {dc.reason[:200]!r}"
                    found.missed[spec.name][text].append(logical.n)

    def states(
        self, logical: Logical, dead: dict[str, list[DeadCopy]], left: set[str], row: Row
    ) -> tuple[Counter[str], list[dict[str, Any]]]:
        """The end state of each copy of ``logical``, and its acknowledged lines."""
        states: Counter[str] = Counter()
        lines = list(self.acks_by_logical.get(id(logical), []))
        unplaced = 0
        for copy in logical.copies:
            sent = self.sent[copy.tag]
            tagged = self.acks_by_tag.get(copy.tag, [])
            lines += tagged
            if copy.tag in dead:
                states[DEAD + (dead[copy.tag][0].outcome or "?")] += 1
                self.check_reasons(logical, copy, dead[copy.tag], row)
            elif sent.refused is not None:
                states["refused"] += 1
                text = f"the broker refused the publish: {sent.refused}"
                self.found.missed[logical.spec.name][text].append(logical.n)
            elif sent.dropped:
                states["dropped"] += 1
            elif copy.tag in left:
                states["queued"] += 1
            elif not self.driver.identifies_copies:
                unplaced += 1
            elif any(_is_processed(r) for r in tagged):
                states["processed"] += 1
            else:
                states["duplicate" if tagged else "lost"] += 1
        if not self.driver.identifies_copies:
            # RabbitMQ: the lines of the key fill the copies not placed otherwise.
            processed = sum(1 for r in lines if _is_processed(r))
            states["processed"] += min(processed, unplaced)
            states["duplicate"] += min(len(lines) - processed, unplaced - min(processed, unplaced))
            states["lost"] += max(0, unplaced - len(lines))
            states["extra"] += max(0, len(lines) - unplaced)
        return +states, lines

    def check_lines(self, logical: Logical, lines: list[dict[str, Any]]) -> None:
        spec, missed = logical.spec, self.found.missed[logical.spec.name]
        for record in lines:
            if not _is_processed(record):
                continue
            if logical.key is not None and record.get("key") != logical.key:
                missed[f"processed under key {record.get('key')!r}, not {logical.key!r}"].append(
                    logical.n
                )
            said = f"{record.get('reason')} {record.get('message')}"
            if spec.warns and (
                "result not stored" not in said or record.get("level") not in WARNING_LEVELS
            ):
                text = (
                    f"processed line at {record.get('level')} with reason "
                    f"{str(record.get('reason'))[:120]!r}: expected WARNING or ERROR saying "
                    "'result not stored'"
                )
                missed[text].append(logical.n)


def account(
    driver: Any,
    plan: Plan,
    sent: dict[str, Sent],
    book: LogBook,
    dead: list[DeadCopy],
    left: set[str],
    fx: Counter[tuple[str, str, int]],
) -> tuple[list[Row], Findings, list[str]]:
    """Where every copy ended, per class (one row each); the invariants broken and the
    expectations missed; notes for the report."""
    books = Accounting(driver, plan, sent, book)
    found = books.found
    notes: list[str] = []
    dead_by_tag = books.dead_letters(dead)
    left_tags = {books.by_ident.get(i, i) for i in left}
    settle_failures = sum(
        1 for r in book.records if _SETTLE_FAILED.search(str(r.get("message", "")))
    )
    rows = {s.name: Row(s.name, s.summary) for s in SPECS if driver.name in s.brokers}
    extra = 0
    for logical in plan.logicals:
        spec, row = logical.spec, rows[logical.spec.name]
        label = f"{spec.name} {logical.n}"
        states, lines = books.states(logical, dead_by_tag, left_tags, row)
        row.sent += len(logical.copies)
        row.dropped += states["dropped"]
        row.processed += states["processed"]
        row.duplicate += states["duplicate"]
        row.dead += sum(v for k, v in states.items() if k.startswith(DEAD))
        row.queued += states["queued"]
        row.lost += states["lost"]
        row.extra += states["extra"]
        extra += states["extra"]
        if states["lost"]:
            found.broken["lost (no outcome, not queued, not dead-lettered)"].append(label)
        if states["queued"]:
            found.broken["still queued at the end (stalled)"].append(label)
        observed = +Counter({k: v for k, v in states.items() if k != "extra"})
        expected = _expected_states(logical, sent)
        if observed != expected:
            found.missed[spec.name][f"ended {dict(observed)}, not {dict(expected)}"].append(
                logical.n
            )
        effects = fx[("effect", spec.name, logical.n)]
        runs = fx[("run", spec.name, logical.n)]
        row.effects += effects
        if effects > max(1, logical.effects):
            found.broken["more than one effect for one logical message"].append(
                f"{label}: {effects}"
            )
        elif effects != logical.effects:
            found.missed[spec.name][f"{effects} effects, not {logical.effects}"].append(logical.n)
        if runs != logical.runs:
            found.missed[spec.name][f"handler called {runs} times, not {logical.runs}"].append(
                logical.n
            )
        books.check_lines(logical, lines)
    if extra > settle_failures:
        found.broken["outcomes beyond the copies sent, not explained by failed settlements"] = [
            f"{extra} extra lines, {settle_failures} settlements failed"
        ]
    elif extra:
        notes.append(f"{extra} copies redelivered after a settlement failed (answered again)")
    unknown = [f"{k}: {v}" for k, v in fx.items() if k[1] not in rows]
    if unknown:
        found.broken["handler calls for no campaign class"] = unknown
    for row in rows.values():
        row.ok = not found.missed.get(row.cls) and not (row.lost or row.queued or row.no_reason)
    if book.bad:
        found.broken["consumer stderr lines that are not JSON objects"] = [
            repr(line) for line in book.bad
        ]
    forged = [
        str(r)
        for r in book.records
        if r.get("message") == "FORGED" or str(r.get("key", "")).startswith("forged-")
    ]
    if forged:
        found.broken["forged log lines"] = forged
    for r in book.records:
        loud = r.get("broker_action") == "dead_letter" or r.get("outcome") in (
            "key_conflict",
            "escalated",
        )
        if loud and r.get("level") not in WARNING_LEVELS:
            text = f"{r.get('outcome')}/{r.get('broker_action')} logged at {r.get('level')}"
            found.missed["(log)"][text].append(0)
    levels = Counter(str(r.get("level")) for r in book.records)
    notes.append(
        f"consumer log: {len(book.records)} JSON lines {dict(levels)}; "
        f"{settle_failures} settlements failed"
    )
    return list(rows.values()), found, notes
