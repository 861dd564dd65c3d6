"""A request's fairness id: whose service it is, in the engine's token-fair scheduler. The gateway sends its team in
this header (llm-d's name) on every request to our engines; an engine reads it from no one else (only the gateway and
its peers hold the engine's API key), and never from the client: the gateway builds each hop's headers itself."""

FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
MAX_FAIRNESS_ID_CHARS = 128  # a team id is 21; the bound keeps one request from making the engine hold a long key
