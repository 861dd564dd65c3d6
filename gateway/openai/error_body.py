"""The OpenAI error envelope as a model, for the OpenAPI document: what every refusal of the inference routes and the
admin API answers (common/http/errors.py writes it)."""

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
