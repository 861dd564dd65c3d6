"""One request in order: its context, admission, the dispatch queue, dispatch, relay, settle."""
