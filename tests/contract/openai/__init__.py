"""The OpenAI surface: the openai client, the OpenAPI document, schemathesis and every bad input."""
