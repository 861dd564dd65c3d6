"""The event as a pure function of a request's record and bill: every key one of the documented fields, the values
read from the record (its outcome, route, disaggregated hop, drafts), nothing of the record changed, the same event
for the same record twice."""

from __future__ import annotations

import copy
import dataclasses

from tokenweir.gateway.accounting.events import FIELDS
from tokenweir.gateway.accounting.request_event import MAX_CLIENT_STRING, Billed, request_event
from tokenweir.gateway.request.context import RequestRecord
from tokenweir.gateway.request.outcome import Outcome


def refused() -> RequestRecord:
    """A request refused before admission: no team, key or route."""
    outcome = Outcome("rejected", "invalid_api_key", 401)
    return RequestRecord(request_id="r-refused", kind="chat", t0=0.0, model="x" * 300, outcome=outcome)


def served() -> RequestRecord:
    """A stream served through a disaggregated pool, its output over the reservation, with speculative drafts."""
    record = RequestRecord(
        request_id="r-served",
        kind="chat",
        t0=0.0,
        team_id="t",
        key_id="k",
        model="m",
        stream=True,
        max_tokens=10,
        route=["m@decode-0"],
        served_model="m",
        upstream_id="tw-1",
        queue_s=0.0015,
        ttft_s=0.2,
        usage_source="upstream",
        finish_reason="length",
        prefill_instance="m@prefill-0",
        prefill_s=0.05,
    )
    record.note_drafts({"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1})
    return record


def fields_of(record: RequestRecord) -> dict[str, object]:
    return {f.name: copy.deepcopy(getattr(record, f.name)) for f in dataclasses.fields(record)}


def test_every_key_is_a_documented_field_and_the_record_is_left_as_it_was():
    transfer = {"fetched_tokens": 48, "fetched_bytes": 1 << 20, "fetch_ms": "2"}  # a non-number is no number
    for record, billed in ((refused(), Billed(0, 0)), (served(), Billed(30, 12, 16, 2_500_000_000))):
        before = fields_of(record)
        event = request_event(record, billed, ts=1.0, e2e_s=0.5, tpot_s=0.01, kv_transfer=transfer)
        assert set(event) <= set(FIELDS), set(event) - set(FIELDS)
        assert fields_of(record) == before
        assert request_event(record, billed, ts=1.0, e2e_s=0.5, tpot_s=0.01, kv_transfer=transfer) == event


def test_a_refused_request_names_what_it_knows_and_clips_the_clients_strings():
    event = request_event(refused(), Billed(0, 0), ts=1.0, e2e_s=0.0123456, tpot_s=None)
    assert (event["status"], event["reason"], event["http_status"]) == ("rejected", "invalid_api_key", 401)
    assert event["team"] is None and event["instance"] is None and event["upstream_request_id"] is None
    assert event["model"] == "x" * MAX_CLIENT_STRING + "..."
    assert (event["e2e_ms"], event["tpot_ms"], event["overrun_tokens"], event["cost"]) == (12.346, None, 0, None)
    assert "prefill_instance" not in event and "draft_tokens" not in event


def test_a_served_request_has_its_route_bill_disaggregated_hop_and_drafts():
    transfer = {"fetched_tokens": 48, "fetched_bytes": 1 << 20, "fetch_ms": "2"}
    billed = Billed(30, 12, 16, 2_500_000_000)
    event = request_event(served(), billed, ts=1.0, e2e_s=0.5, tpot_s=0.01, kv_transfer=transfer)
    assert (event["instance"], event["upstream_request_id"], event["served_model"]) == ("m@decode-0", "tw-1", "m")
    assert (event["prompt_tokens"], event["completion_tokens"], event["cached_tokens"]) == (30, 12, 16)
    assert event["overrun_tokens"] == 2  # 12 made past the 10 reserved
    assert event["cost"] == 2.5e-6  # femto-USD to USD, unrounded
    assert (event["queue_ms"], event["ttft_ms"], event["tpot_ms"]) == (1.5, 200.0, 10.0)
    assert (event["prefill_instance"], event["prefill_ms"]) == ("m@prefill-0", 50.0)
    assert (event["kv_fetched_tokens"], event["kv_fetched_bytes"], event["kv_fetch_ms"]) == (48, 1 << 20, None)
    assert (event["draft_tokens"], event["draft_acceptance"]) == (4, 0.75)
