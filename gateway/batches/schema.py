"""The body of POST /v1/batches, as OpenAI's API takes it: checked by the route, published in the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Required

from pydantic import Field, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenweir.gateway.openai.strict import STRICT


@with_config(STRICT)
class CreateBatchRequest(TypedDict, total=False):
    input_file_id: Required[Annotated[str, Field(min_length=1, max_length=256)]]  # uploaded with purpose "batch"
    endpoint: Required[str]  # /v1/chat/completions, /v1/completions or /v1/embeddings
    completion_window: Required[str]  # "24h"
    metadata: dict[str, str] | None  # up to 16 pairs
    output_expires_after: dict[str, Any] | None  # accepted as OpenAI's is; output files here are kept until deleted


CREATE_BATCH: TypeAdapter[CreateBatchRequest] = TypeAdapter(CreateBatchRequest)
