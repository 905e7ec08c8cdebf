"""A handler for ``oncely consume --tracing`` tests, imported by the command as
``module:function``: importing it sets the global tracer provider (the real SDK), as an
application configures OpenTelemetry, with every finished span appended as a JSON line to the
file named by ``ONCELY_TEST_SPANS`` (so the test process can read the consumer's spans)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class _ToFile(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(os.environ["ONCELY_TEST_SPANS"], "a") as out:
            for span in spans:
                parent = span.parent
                out.write(
                    json.dumps(
                        {
                            "name": span.name,
                            "kind": span.kind.name,
                            "trace_id": span.context.trace_id,
                            "span_id": span.context.span_id,
                            "parent_id": None if parent is None else parent.span_id,
                            "attributes": dict(span.attributes or {}),
                        }
                    )
                    + "\n"
                )
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(_ToFile()))
trace.set_tracer_provider(_provider)


async def charge(payload: dict[str, Any]) -> None:
    with trace.get_tracer("the-shop").start_as_current_span("charge"):
        pass
