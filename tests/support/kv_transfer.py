"""The KV transfer key the tests' engines share (a kv_consumer fetches only what a producer signed with it, or a
producer it lists), a producer's answer pointed somewhere else and signed again, as a producer of the test's own
would sign it, 32 prompts, and the steps of a disaggregated request on in-process engines (prefill hops, decode
hops, `run`)."""

from dataclasses import replace

from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.kv_transfer.params import RemotePrefill, producer_answer
from tokenweir.engine.kv_transfer.trust import signed
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

KV_KEY = "tests-kv-transfer-key-0123456789abcdef"
PREFILL_HOP = {"do_remote_decode": True}
# batch invariant: a prompt computed by the consumer (a fault's fallback) or fetched from the producer must give the
# producer's own tokens, and without it a row's rounding follows its step's batch and chunks (bfloat16 prefill chunks
# on a CPU with native bf16), so a near tie goes the other way when the faults change the batches
ENGINE = {
    "max_num_batched_tokens": 256,
    "max_num_seqs": 32,
    "num_kv_blocks": 640,
    "max_model_len": 1024,
    "batch_invariant": True,
}
MAX_NEW = 16


def kv_engine(role: str, **config) -> LLM:
    """The default model as a `role` engine (kv_producer, kv_consumer) sharing KV_KEY, sized by ENGINE (`config`
    overrides)."""
    kv_transfer = KVTransferConfig(kv_role=role, fetch_timeout_s=5.0, transfer_key=KV_KEY)
    return LLM(default_model_path(), kv_transfer=kv_transfer, **(ENGINE | config))


def greedy(max_tokens: int = MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def build_prompts() -> list[str]:
    """32 prompts: short, long (~600 tokens), two sharing ~590 tokens, code, and 25 short requests."""
    document = " ".join(f"Clause {i}: the tenant pays {i * 13 % 97} coins on day {i % 28 + 1}." for i in range(40))
    prompts = [
        "Hi",
        "The capital of France is",
        "Once upon a time, in a village by the sea, there lived",
        "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively\n    " * 3,
        f"{document}\nSummarize the clauses above in one sentence:",  # ~600 tokens
        f"{document}\nWhich clause has the largest payment?",  # shares ~590 tokens with the one above
        " ".join(f"Item {i}: the value is {i * 37 % 101}." for i in range(45)),
    ]
    for i in range(25):
        topic = ["rivers", "prime numbers", "owls", "bridges", "tea"][i % 5]
        prompts.append(f"Request {i}: write {i % 3 + 2} sentences about {topic}, mentioning the number {i * 7}.")
    return prompts


PROMPTS = build_prompts()


def redirected(answer: dict, port: int, key: str | None = KV_KEY) -> dict:
    """`answer` naming 127.0.0.1:`port` instead, signed with `key` (None: unsigned)."""
    remote = replace(RemotePrefill.parse(answer), host="127.0.0.1", port=port)
    return producer_answer(signed(remote, key, 30.0))


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[list[int]]]:
    """Every choice's tokens, per prompt; and in `run.finals` each request's first choice folded into one output
    (its prompt logprobs, and the request's kv_transfer_params)."""
    tok = llm.engine.tokenizer
    ids = []
    for prompt, p in zip(prompts, params, strict=True):
        p = SamplingParams(**vars(p))
        tokens = tok.encode(prompt)
        llm.engine.validate(tokens, p)
        rid = f"r{llm._next_id}"
        llm._next_id += 1
        llm.engine.add_request(rid, tokens, p)
        ids.append(rid)
    choices: dict[str, dict[int, list[int]]] = {rid: {} for rid in ids}
    finals = {rid: RequestOutput.empty(rid) for rid in ids}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            choices[out.request_id].setdefault(out.index, []).extend(out.new_token_ids)
            if out.index == 0:
                finals[out.request_id].add(out)
            else:
                finals[out.request_id].take_counts(out)
    run.finals = [finals[rid] for rid in ids]  # type: ignore[attr-defined]
    return [[c[i] for i in sorted(c)] for c in (choices[rid] for rid in ids)]


def prefill_hops(producer: LLM, prompts: list[str]) -> list[dict]:
    run(producer, prompts, [greedy(1, kv_transfer_params=PREFILL_HOP)] * len(prompts))
    answers = [out.kv_transfer_params for out in run.finals]  # type: ignore[attr-defined]
    assert all(
        a and a["do_remote_prefill"] and a["remote_port"] == producer.engine.kv_transfer.server.port for a in answers
    )
    return answers


def decode_hop(params: SamplingParams, answer: dict) -> SamplingParams:
    return replace(params, kv_transfer_params=answer)
