"""Error dialects: what the servers people run really send when something goes wrong, and
what it means for the race.

An error's kind decides what happens next: the request's fault (a prompt over the context
window, a bad parameter, flagged content) is fatal for every attempt; the replica's fault (a
wrong key, an unknown model, no credit) fails that attempt and lets another replica answer;
overload and transient failures are retried elsewhere. Each row is one server and one
error, with the body as that server builds it (the ``source`` says where we read it: a file
in the server's repository, or its documentation), sent through the HTTP source exactly as
a replica would send it (``httpx.MockTransport``), as an HTTP error or in-band in a 200
event stream.

Rows marked ``was`` failed on the old classifier: the kind it gave is noted there.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest

import trio_hedge as th
from trio_hedge import AttemptError
from trio_hedge.errors import ErrorKind

K = ErrorKind
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
JSON = "application/json"
SSE = "text/event-stream"


def compact(obj: Any) -> bytes:
    """FastAPI/Starlette's and serde_json's spelling: no spaces."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def spaced(obj: Any) -> bytes:
    """Python's ``json.dumps`` default spelling (vLLM's and SGLang's stream errors)."""
    return json.dumps(obj, ensure_ascii=False).encode()


def events(*payloads: bytes, done: bool = True, field: str = "data") -> bytes:
    role = compact(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
    )
    body = b"data: " + role + b"\n\n"
    for payload in payloads:
        body += field.encode() + b": " + payload + b"\n\n"
    return body + (b"data: [DONE]\n\n" if done else b"")


@attrs.frozen
class Dialect:
    server: str
    case: str
    status: int
    body: bytes
    source: str
    kind: ErrorKind
    retryable: bool
    content_type: str = JSON
    headers: tuple[tuple[str, str], ...] = ()
    retry_after: float | None = None
    was: str = ""  # what the old classifier said, when it was wrong

    @property
    def id(self) -> str:
        return f"{self.server}: {self.case}"


VLLM = "vllm-project/vllm: vllm/entrypoints/openai/engine/serving.py"
VLLM_AUTH = "vllm-project/vllm: vllm/entrypoints/serve/utils/server_utils.py"
SGLANG = "sgl-project/sglang: python/sglang/srt/entrypoints/openai/serving_base.py"
SGLANG_CHAT = "sgl-project/sglang: python/sglang/srt/entrypoints/openai/serving_chat.py"
SGLANG_TM = "sgl-project/sglang: python/sglang/srt/managers/tokenizer_manager.py"
TGI = "huggingface/text-generation-inference: router/src/server.rs, router/src/infer/mod.rs"
TGI_VAL = "huggingface/text-generation-inference: router/src/validation.rs"
LLAMA = "ggml-org/llama.cpp: tools/server/server-common.cpp (format_error_response)"
LLAMA_OLD = "ggml-org/llama.cpp#16104 and #16109 (the `error:` field, fixed 2025-09-19)"
LLAMA_500 = "ggml-org/llama.cpp#15780 (exceed_context_size_error, code 500 until #16486)"
LCP = "abetlen/llama-cpp-python: llama_cpp/server/errors.py, llama_cpp/server/app.py"
OLLAMA = "ollama/ollama: openai/openai.go (NewError), middleware/openai.go, server/routes.go"
OLLAMA_Q = "ollama/ollama: server/sched.go (ErrMaxQueue), server/routes.go"
LITELLM = "BerriAI/litellm: litellm/proxy/common_request_processing.py (create_response)"
LITELLM_DOC = "https://docs.litellm.ai/docs/proxy/debugging (Common Errors)"
OPENROUTER = "https://openrouter.ai/docs/api/reference/errors-and-debugging"
OPENROUTER_SSE = "https://openrouter.ai/docs/api/reference/streaming (errors during streaming)"
AZURE = "https://learn.microsoft.com/en-us/answers/questions/1189174 (DeploymentNotFound)"
AZURE_DOC = "https://learn.microsoft.com/en-us/azure/ai-services/openai/reference (errors)"
AZURE_CF = "https://learn.microsoft.com/en-us/azure/ai-services/openai/concepts/content-filter"

TGI_TOO_LONG = (
    "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. "
    "Given: 4000 `inputs` tokens and 200 `max_new_tokens`"
)

DIALECTS = [
    # -- vLLM ------------------------------------------------------------------------------
    Dialect("vLLM", "unknown model", 404, compact({"error": {"message": "The model `llama-9` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}), VLLM, K.NOT_FOUND, True),
    Dialect("vLLM", "prompt over the context", 400, compact({"error": {"message": "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.", "type": "BadRequestError", "param": "input_tokens", "code": 400}}), VLLM, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("vLLM", "max_tokens over the context", 400, compact({"error": {"message": "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum context length is 4096 tokens and your request has 200 input tokens (4000 > 4096 - 200).", "type": "BadRequestError", "param": "max_tokens", "code": 400}}), VLLM, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("vLLM", "decoder prompt over max_model_len", 400, compact({"error": {"message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens.", "type": "BadRequestError", "param": None, "code": 400}}), "vllm-project/vllm: vllm/v1/engine/processor.py (_validate_model_input)", K.CONTEXT_LENGTH_EXCEEDED, False, was="invalid_request"),
    Dialect("vLLM", "bad API key", 401, compact({"error": "Unauthorized"}), VLLM_AUTH, K.AUTH, True),
    Dialect("vLLM", "engine dead", 500, compact({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", "type": "InternalServerError", "param": None, "code": 500}}), "vllm-project/vllm: vllm/v1/engine/exceptions.py", K.SERVER_ERROR, True),
    Dialect("vLLM", "error after the 200", 200, events(spaced({"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}})), VLLM, K.SERVER_ERROR, True, SSE),
    Dialect("vLLM", "bad request after the 200 (old shape)", 200, events(spaced({"object": "error", "message": "max_tokens must be at least 1", "type": "BadRequestError", "param": None, "code": 400})), "vllm-project/vllm: vllm/entrypoints/openai/serving_engine.py (older releases); block/goose#8031", K.INVALID_REQUEST, False, SSE),
    # -- SGLang ----------------------------------------------------------------------------
    Dialect("SGLang", "prompt over the context", 400, compact({"object": "error", "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).", "type": "BadRequestError", "param": None, "code": 400}), SGLANG_TM, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("SGLang", "prompt + max_tokens over the context", 400, compact({"object": "error", "message": "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 4296 tokens: 4000 tokens from the input messages and 296 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.", "type": "BadRequestError", "param": None, "code": 400}), SGLANG_TM, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("SGLang", "queue full (--max-queued-requests), streaming", 200, events(spaced({"error": {"object": "error", "message": "The request queue is full.", "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}})), SGLANG_CHAT, K.OVERLOADED, True, SSE),
    Dialect("SGLang", "internal error", 500, compact({"object": "error", "message": "Internal server error: CUDA error: out of memory", "type": "InternalServerError", "param": None, "code": 500}), SGLANG, K.SERVER_ERROR, True),
    Dialect("SGLang", "bad API key", 401, compact({"error": "Unauthorized"}), "sgl-project/sglang: python/sglang/srt/utils.py (add_api_key_middleware)", K.AUTH, True),
    # -- TGI -------------------------------------------------------------------------------
    Dialect("TGI", "prompt over the context (HTTP)", 422, compact({"error": TGI_TOO_LONG, "error_type": "validation"}), TGI_VAL, K.CONTEXT_LENGTH_EXCEEDED, False, was="invalid_request"),
    Dialect("TGI", "prompt over the context (in-band, 'http_status_code' always 422)", 200, events(compact({"error": {"message": TGI_TOO_LONG, "http_status_code": 422}})), TGI, K.CONTEXT_LENGTH_EXCEEDED, False, SSE, was="server_error, retryable"),
    Dialect("TGI", "bad parameter (in-band)", 200, events(compact({"error": {"message": "Input validation error: `temperature` must be strictly positive", "http_status_code": 422}})), TGI, K.INVALID_REQUEST, False, SSE, was="server_error, retryable"),
    Dialect("TGI", "bad chat template input (in-band)", 200, events(compact({"error": {"message": "Template error: syntax error: unexpected end of input (in <string>:1)", "http_status_code": 422}})), TGI, K.INVALID_REQUEST, False, SSE, was="server_error, retryable"),
    Dialect("TGI", "max_concurrent_requests reached (in-band)", 200, events(compact({"error": {"message": "Model is overloaded", "http_status_code": 422}})), TGI, K.OVERLOADED, True, SSE),
    Dialect("TGI", "max_concurrent_requests reached (HTTP 429)", 429, compact({"error": "Model is overloaded", "error_type": "overloaded"}), TGI, K.OVERLOADED, True, was="rate_limit (never counted against the replica)"),
    Dialect("TGI", "generation failed (HTTP 424)", 424, compact({"error": "Request failed during generation: Server error: CUDA out of memory. Tried to allocate 2.00 GiB", "error_type": "generation"}), TGI, K.SERVER_ERROR, True, was="invalid_request, fatal"),
    Dialect("TGI", "generation failed (in-band)", 200, events(compact({"error": {"message": "Request failed during generation: Server error: CUDA out of memory. Tried to allocate 2.00 GiB", "http_status_code": 422}})), TGI, K.SERVER_ERROR, True, SSE),
    Dialect("TGI", "incomplete generation", 500, compact({"error": "Incomplete generation", "error_type": "incomplete_generation"}), TGI, K.SERVER_ERROR, True),
    Dialect("TGI", "bad API key (empty body)", 401, b"", "huggingface/text-generation-inference: router/src/server.rs (api_key layer)", K.AUTH, True, "text/plain"),
    # -- llama.cpp server ------------------------------------------------------------------
    Dialect("llama.cpp", "prompt over the context (HTTP 400)", 400, compact({"error": {"code": 400, "message": "request (9412 tokens) exceeds the available context size (8192 tokens), try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9412, "n_ctx": 8192}}), LLAMA, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("llama.cpp", "prompt over the context (in-band, code 500)", 200, events(compact({"error": {"code": 500, "message": "the request exceeds the available context size. try increasing the context size or enable context shift", "type": "exceed_context_size_error", "n_prompt_tokens": 1407, "n_ctx": 256}})), LLAMA_500, K.CONTEXT_LENGTH_EXCEEDED, False, SSE),
    Dialect("llama.cpp", "prompt over the context (`error:` field, before b6500)", 200, events(compact({"code": 400, "message": "the request exceeds the available context size. try increasing the context size or enable context shift", "type": "invalid_request_error"}), field="error"), LLAMA_OLD, K.CONTEXT_LENGTH_EXCEEDED, False, SSE, was="no error: an empty answer, committed"),
    Dialect("llama.cpp", "model still loading", 503, compact({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}), LLAMA, K.OVERLOADED, True),
    Dialect("llama.cpp", "bad API key", 401, compact({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}), LLAMA, K.AUTH, True),
    Dialect("llama.cpp", "feature not supported by this server", 501, compact({"error": {"code": 501, "message": "tools param requires --jinja flag", "type": "not_supported_error"}}), LLAMA, K.SERVER_ERROR, True),
    Dialect("llama.cpp", "generation failed (in-band)", 200, events(compact({"error": {"code": 500, "message": "Failed to decode the batch", "type": "server_error"}})), LLAMA, K.SERVER_ERROR, True, SSE),
    # -- llama-cpp-python ------------------------------------------------------------------
    Dialect("llama-cpp-python", "prompt over the context", 400, compact({"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested 2548 tokens (2400 in the messages, 148 in the completion). Please reduce the length of the messages or completion.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}), LCP, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("llama-cpp-python", "model not in this server's config", 400, compact({"error": {"message": "The model `llama-9` does not exist", "type": "invalid_request_error", "param": None, "code": "model_not_found"}}), LCP, K.NOT_FOUND, True, was="invalid_request, fatal"),
    Dialect("llama-cpp-python", "bad API key", 401, compact({"detail": "Invalid API key"}), LCP, K.AUTH, True),
    Dialect("llama-cpp-python", "no model loaded", 503, compact({"detail": "Service is not available"}), LCP, K.OVERLOADED, True),
    Dialect("llama-cpp-python", "failure after the 200 (no error body: the stream ends)", 200, b"", LCP + " (get_event_publisher)", K.EMPTY_STREAM, True, SSE),
    # -- Ollama (OpenAI-compatible /v1) ----------------------------------------------------
    Dialect("Ollama", "model not pulled", 404, compact({"error": {"message": "model 'llama9' not found", "type": "not_found_error", "param": None, "code": None}}), OLLAMA, K.NOT_FOUND, True),
    Dialect("Ollama", "queue full (OLLAMA_MAX_QUEUE)", 503, compact({"error": {"message": "server busy, please try again.  maximum pending requests exceeded", "type": "api_error", "param": None, "code": None}}), OLLAMA_Q, K.OVERLOADED, True),
    Dialect("Ollama", "bad request", 400, compact({"error": {"message": "[] is too short - 'messages'", "type": "invalid_request_error", "param": None, "code": None}}), OLLAMA, K.INVALID_REQUEST, False),
    Dialect("Ollama", "runner crashed", 500, compact({"error": {"message": "llama runner process has terminated: exit status 2", "type": "api_error", "param": None, "code": None}}), OLLAMA, K.SERVER_ERROR, True),
    # -- LiteLLM proxy ---------------------------------------------------------------------
    Dialect("LiteLLM", "bad virtual key (quotes its last 4 characters)", 401, compact({"error": {"message": "Authentication Error, Invalid proxy server token passed. Received API Key = sk-...1337, Key Hash (Token) =61def79. Unable to find token in cache or `LiteLLM_VerificationTokenTable`", "type": "token_not_found_in_db", "param": "key", "code": "401"}}), LITELLM, K.AUTH, True),
    Dialect("LiteLLM", "every deployment cooling down", 429, compact({"error": {"message": "No deployments available for selected model, Try again in 60 seconds. Passed model=claude-3-5-sonnet. pre-call-checks=False, allowed_model_region=n/a.", "type": None, "param": None, "code": "429"}}), LITELLM_DOC, K.OVERLOADED, True, was="rate_limit (never counted against the replica)"),
    Dialect("LiteLLM", "no healthy deployment", 400, compact({"error": {"message": "litellm.BadRequestError: You passed in model=deepseek-v4-flash. There are no healthy deployments for this model. Received Model Group=deepseek-v4-flash\nAvailable Model Group Fallbacks=None", "type": None, "param": None, "code": "400"}}), "BerriAI/litellm: litellm/router.py (no healthy deployments)", K.OVERLOADED, True, was="invalid_request, fatal"),
    Dialect("LiteLLM", "upstream context window", 400, compact({"error": {"message": "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError: OpenAIException - This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.", "type": None, "param": None, "code": "400"}}), LITELLM, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("LiteLLM", "upstream failure after the 200", 200, events(spaced({"error": {"message": "litellm.APIConnectionError: APIConnectionError: OpenAIException - Connection error.", "type": None, "param": None, "code": "500"}})), LITELLM, K.SERVER_ERROR, True, SSE),
    # -- OpenRouter ------------------------------------------------------------------------
    Dialect("OpenRouter", "out of credits", 402, compact({"error": {"code": 402, "message": "Insufficient credits. Add more using https://openrouter.ai/credits"}}), OPENROUTER, K.QUOTA_EXCEEDED, True),
    Dialect("OpenRouter", "input flagged by moderation", 403, compact({"error": {"code": 403, "message": "openai/gpt-4o requires moderation on OpenAI. Your input was flagged for \"harassment\". No credits were charged.", "metadata": {"reasons": ["harassment"], "flagged_input": "...", "provider_name": "OpenAI", "model_slug": "openai/gpt-4o"}}}), OPENROUTER, K.INVALID_REQUEST, False, was="auth (blamed the replica, tried the next)"),
    Dialect("OpenRouter", "request timed out", 408, compact({"error": {"code": 408, "message": "Request timed out"}}), OPENROUTER, K.TIMEOUT, True),
    Dialect("OpenRouter", "rate limited", 429, compact({"error": {"code": 429, "message": "Rate limit exceeded: free-models-per-min."}}), OPENROUTER, K.RATE_LIMIT, True, headers=(("retry-after", "7"),), retry_after=7.0),
    Dialect("OpenRouter", "model down", 502, compact({"error": {"code": 502, "message": "Provider returned error", "metadata": {"provider_name": "DeepInfra"}}}), OPENROUTER, K.SERVER_ERROR, True),
    Dialect("OpenRouter", "no provider meets the routing requirements", 503, compact({"error": {"code": 503, "message": "There is no available model provider that meets your routing requirements"}}), OPENROUTER, K.OVERLOADED, True),
    Dialect("OpenRouter", "provider failed mid-stream", 200, events(compact({"id": "gen-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "openai/gpt-4o", "provider": "OpenAI", "error": {"code": "server_error", "message": "Provider disconnected"}, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]})), OPENROUTER_SSE, K.SERVER_ERROR, True, SSE),
    # -- Azure OpenAI ----------------------------------------------------------------------
    Dialect("Azure OpenAI", "deployment not found", 404, compact({"error": {"code": "DeploymentNotFound", "message": "The API deployment for this resource does not exist. If you created the deployment within the last 5 minutes, please wait a moment and try again."}}), AZURE, K.NOT_FOUND, True),
    Dialect("Azure OpenAI", "bad key", 401, compact({"error": {"code": "401", "message": "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource."}}), AZURE_DOC, K.AUTH, True),
    Dialect("Azure OpenAI", "token rate limit", 429, compact({"error": {"code": "429", "message": "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-02-01 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 6 seconds."}}), AZURE_DOC, K.RATE_LIMIT, True, headers=(("retry-after-ms", "6000"), ("retry-after", "6")), retry_after=6.0),
    Dialect("Azure OpenAI", "prompt filtered", 400, compact({"error": {"message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy. Please modify your prompt and retry.", "type": None, "param": "prompt", "code": "content_filter", "status": 400, "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": {"hate": {"filtered": True, "severity": "high"}}}}}), AZURE_CF, K.INVALID_REQUEST, False),
    Dialect("Azure OpenAI", "prompt over the context", 400, compact({"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}), AZURE_DOC, K.CONTEXT_LENGTH_EXCEEDED, False),
    Dialect("Azure OpenAI", "model overloaded (in-band)", 200, events(spaced({"error": {"message": "That model is currently overloaded with other requests. You can retry your request, or contact us through an Azure support request at: https://go.microsoft.com/fwlink/?linkid=2213926 if the error persists. (Please include the request ID 2dcb57a0-803c-4ac1-986d-e3aee5fedd6e in your message.)", "type": "server_error", "param": None, "code": None}})), "scalaone/azure-openai-proxy#22", K.OVERLOADED, True, SSE, was="server_error"),
    Dialect("Azure OpenAI", "server error", 500, compact({"error": {"message": "The server had an error while processing your request. Sorry about that! You can retry your request, or contact us through an Azure support request at: https://go.microsoft.com/fwlink/?linkid=2213926 if the error persists.", "type": "server_error", "param": None, "code": None}}), "Azure-Samples/azure-search-openai-demo#1390", K.SERVER_ERROR, True),
]  # fmt: skip


async def attempt_error(case: Dialect) -> AttemptError:
    """Open one attempt against a replica that answers ``case``, read it to its end, and
    return the error it failed with."""

    def answer(request: httpx.Request) -> httpx.Response:
        headers = [("content-type", case.content_type), *case.headers]
        return httpx.Response(case.status, headers=headers, content=case.body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        source = th.Replica("http://replica.test/v1").bind(REQUEST, client)
        try:
            attempt = await source.open(th.sources.AttemptInfo("rid", 1, "primary"))
            try:
                while await attempt.receive() is not None:
                    pass
            finally:
                await attempt.aclose()
        except AttemptError as exc:
            return exc
    raise AssertionError(f"{case.id}: no error")


@pytest.mark.parametrize("case", DIALECTS, ids=[d.id for d in DIALECTS])
async def test_each_dialect_is_classified_by_what_it_means(case: Dialect) -> None:
    error = await attempt_error(case)
    assert (error.kind, error.retryable) == (case.kind, case.retryable), (
        f"{case.id} ({case.source}): {error!r}"
    )
    assert error.replica_fault == (case.kind in (K.AUTH, K.NOT_FOUND, K.QUOTA_EXCEEDED))
    assert error.retry_after == case.retry_after
    assert error.message  # always something to show


def test_the_table_covers_every_server_and_each_fate() -> None:
    servers = {d.server for d in DIALECTS}
    assert servers == {
        "vLLM",
        "SGLang",
        "TGI",
        "llama.cpp",
        "llama-cpp-python",
        "Ollama",
        "LiteLLM",
        "OpenRouter",
        "Azure OpenAI",
    }
    for server in servers:
        fates = {fate(d) for d in DIALECTS if d.server == server}
        assert fates == {"request", "replica", "transient"}, f"{server}: {fates}"


def fate(case: Dialect) -> str:
    if not case.retryable:
        return "request"
    return "replica" if case.kind in (K.AUTH, K.NOT_FOUND, K.QUOTA_EXCEEDED) else "transient"
