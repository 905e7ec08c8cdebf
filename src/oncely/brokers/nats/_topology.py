"""What the NATS adapter declares: the stream that captures a subject, the dead-letter stream,
and the durable pull consumer of a group (see the package docstring)."""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta

import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext

from oncely.brokers._common import positive
from oncely.brokers.nats._settings import (
    DEAD_LETTER_WINDOW,
    UNAVAILABLE,
    check_subject,
    has_wildcard,
    seconds,
    stream_name_for,
    subject_matches,
    unavailable,
)
from oncely.errors import ConfigurationError


async def ensure_stream(
    js: JetStreamContext,
    subject: str,
    name: str | None,
    duplicate_window: timedelta | None,
) -> str:
    """The stream that captures ``subject``: the one named ``name`` or, without a name, any
    existing one; created (file storage, ``subject`` as its only subject) when missing."""
    if name is not None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.stream_info(name)
            return name
    else:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            return await js.find_stream_name_by_subject(subject)
    created = name if name is not None else stream_name_for(subject)
    config = api.StreamConfig(
        name=created,
        subjects=[subject],
        storage=api.StorageType.FILE,
        duplicate_window=seconds(duplicate_window),  # type: ignore[arg-type]
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        # Another process may have created it first (same config: accepted), or it clashes.
        with contextlib.suppress(nats.js.errors.NotFoundError):
            if await js.find_stream_name_by_subject(subject) == created:
                return created
        raise ConfigurationError(
            f"cannot create the JetStream stream {created!r} for subject {subject!r}: "
            f"{exc.description}"
        ) from None
    return created


class Topology:
    """The streams and the durable consumer a :class:`~oncely.brokers.nats.JetStream` reads
    through, checked when built and declared by :meth:`declare`."""

    __slots__ = (
        "ack_wait",
        "dead_letter",
        "dead_letter_stream_option",
        "duplicate_window",
        "group",
        "max_ack_pending",
        "max_age",
        "max_deliver",
        "resume",
        "source",
        "stream_option",
    )

    def __init__(
        self,
        source: str,
        *,
        group: str,
        dead_letter: str | None,
        ack_wait: timedelta,
        stream: str | None,
        dead_letter_stream: str | None,
        max_deliver: int,
        max_ack_pending: int | None,
        duplicate_window: timedelta | None,
    ) -> None:
        self.source = check_subject(source, "source")
        if not group or any(ch in group for ch in ". *>\t\r\n/\\"):
            raise ConfigurationError(
                f"group {group!r} must be a durable consumer name: no spaces, '.', '*', '>'"
            )
        self.group = group
        if dead_letter is None:
            if has_wildcard(source):
                raise ConfigurationError(
                    f"source {source!r} has a wildcard: name a dead_letter subject outside it"
                )
            dead_letter = f"{source}.dead"
        self.dead_letter = check_subject(dead_letter, "dead_letter")
        if has_wildcard(self.dead_letter):
            raise ConfigurationError("the dead_letter subject cannot have wildcards")
        if subject_matches(self.source, self.dead_letter):
            raise ConfigurationError(
                f"the dead-letter subject {self.dead_letter!r} matches the source "
                f"{self.source!r}: dead-lettered copies would be consumed again"
            )
        self.ack_wait = positive(ack_wait, "ack_wait")
        if max_deliver == 0 or max_deliver < -1:
            raise ConfigurationError("max_deliver must be positive, or -1 for no limit")
        self.max_deliver = max_deliver
        self.max_age: timedelta | None = None  # the stream's, read by declare()
        self.resume: tuple[datetime | None, int] | None = None
        """The stream (its creation time) and the sequence up to which the consumer had
        acknowledged everything, when last seen: where one deleted is declared again from."""
        if max_ack_pending is not None and max_ack_pending < 1:
            raise ConfigurationError("max_ack_pending must be at least 1")
        self.max_ack_pending = max_ack_pending
        if duplicate_window is not None:
            positive(duplicate_window, "duplicate_window")
        self.duplicate_window = duplicate_window
        self.stream_option = stream
        self.dead_letter_stream_option = dead_letter_stream

    async def declare(self, js: JetStreamContext) -> tuple[str, str]:
        """Declare what is missing and return the names of the main and the dead-letter
        stream; :attr:`max_deliver` becomes the consumer's as the server holds it."""
        try:
            stream = await ensure_stream(js, self.source, self.stream_option, self.duplicate_window)
            try:
                captor: str | None = await js.find_stream_name_by_subject(self.dead_letter)
            except nats.js.errors.NotFoundError:
                captor = None
            if captor == stream:
                raise ConfigurationError(
                    f"the stream {stream!r} captures the dead-letter subject "
                    f"{self.dead_letter!r}: dead-lettered copies would be consumed again; "
                    "choose a dead_letter subject outside the stream's subjects"
                )
            if captor is None:
                captor = await ensure_stream(
                    js, self.dead_letter, self.dead_letter_stream_option, DEAD_LETTER_WINDOW
                )
            stream_info = await js.stream_info(stream)
            stream_config = stream_info.config
            info = await self._ensure_consumer(js, stream, self._start(stream_info.created))
        except nats.js.errors.NotFoundError as exc:
            raise unavailable("declaration", exc) from None
        except nats.js.errors.BadRequestError as exc:
            raise ConfigurationError(f"JetStream refused the declaration: {exc}") from None
        except UNAVAILABLE as exc:
            raise unavailable("declaration", exc) from None
        self.max_deliver = info.config.max_deliver or -1
        self.note(info, stream_info.created)
        age = stream_config.max_age or 0.0  # seconds; 0: no limit
        self.max_age = timedelta(seconds=age) if age > 0 else None
        return stream, captor

    def note(self, info: api.ConsumerInfo, created: datetime | None) -> None:
        """Note how far the consumer of the stream created at ``created`` has acknowledged."""
        floor = info.ack_floor.stream_seq if info.ack_floor is not None else None
        if floor:
            self.resume = (created, floor)

    def _start(self, created: datetime | None) -> int | None:
        """The sequence a consumer declared again starts from: after what the one before
        had acknowledged, on the same stream (not one deleted and made again)."""
        if self.resume is None or created is None or self.resume[0] != created:
            return None
        return self.resume[1] + 1

    async def _ensure_consumer(
        self, js: JetStreamContext, stream: str, start: int | None = None
    ) -> api.ConsumerInfo:
        wanted = {
            "ack_wait": self.ack_wait.total_seconds(),
            "max_deliver": self.max_deliver,
        }
        if self.max_ack_pending is not None:
            wanted["max_ack_pending"] = self.max_ack_pending
        try:
            info: api.ConsumerInfo = await js.consumer_info(stream, self.group)
        except nats.js.errors.NotFoundError:
            # A consumer deleted under this transport resumes after what it acknowledged;
            # from the stream's start it would run again what the inbox may have forgotten.
            config = api.ConsumerConfig(
                durable_name=self.group,
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=(
                    api.DeliverPolicy.ALL if start is None else api.DeliverPolicy.BY_START_SEQUENCE
                ),
                opt_start_seq=start,
                filter_subject=self.source,
                **wanted,  # type: ignore[arg-type]
            )
            return await js.add_consumer(stream, config)
        config = info.config
        if config.deliver_subject:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} is a push consumer; oncely needs a "
                "pull consumer (delete it or choose another group)"
            )
        if config.ack_policy != api.AckPolicy.EXPLICIT:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} does not use explicit acks"
            )
        if config.filter_subject not in (None, "", self.source) or config.filter_subjects:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} reads {config.filter_subject!r}, "
                f"not {self.source!r}"
            )
        if any(getattr(config, field) != value for field, value in wanted.items()):
            for field, value in wanted.items():
                setattr(config, field, value)
            info = await js.add_consumer(stream, config)  # an update of the same durable
        return info
