"""`LLM`: offline generation (`LLM(model=...).generate(prompts, params)` runs every prompt to completion)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.sched.sampling_params import SamplingParams


class LLM:
    """Offline generation: `LLM(model=...).generate(prompts, params)` runs every prompt to completion."""

    def __init__(self, model: str = "", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    def generate(
        self,
        prompts: Sequence[list[int] | str],
        params: SamplingParams | list[SamplingParams],
        priorities=None,
    ) -> list[RequestOutput]:
        """Returns, per prompt, a RequestOutput whose new_token_ids / new_text hold the whole completion."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, (prompt, given) in enumerate(zip(prompts, params_list, strict=True)):
            if isinstance(prompt, str):
                assert self.engine.tokenizer is not None, "text prompts need a model with a tokenizer"
                tokens = self.engine.tokenizer.encode(prompt)
            else:
                tokens = prompt
            request_params = SamplingParams(**vars(given))  # a copy: validate fills in max_tokens
            self.engine.validate(tokens, request_params)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, tokens, request_params, (priorities or [0] * len(prompts))[i])
            ids.append(rid)
        results = {rid: RequestOutput.empty(rid) for rid in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.index == 0:  # offline generate returns the first choice
                    results[out.request_id].add(out)
        return [results[rid] for rid in ids]
