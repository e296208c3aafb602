"""Time ``r1sup diagnose`` on a realistic 400k-line vLLM log against a bare one-regex loop.

The log (written to a temporary directory) is what a long-running server leaves behind: a start-up
with its progress lines, then hours of serving (metrics every few seconds, access-log lines, some
warnings, per-request error tracebacks) and an out-of-memory crash at the end. Both sides read the
same file from disk:

* baseline: ``for line in open(path): if rx.search(line)`` with one compiled regex;
* diagnose: the function ``r1sup diagnose`` runs (bounded chunks, decoding, the streaming reader and
  the verdict), checked to find the crash.

Each side runs ``--repeat`` times (alternating) and the best time counts. Exit status 1 when
diagnose takes more than ``--max-ratio`` (3) times the baseline.

    python benchmarks/bench_diagnose.py [--lines 400000] [--repeat 5] [--max-ratio 3]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from r1sup.commands.diagnose import diagnose_path

BASELINE_RE = re.compile(r"Error|Traceback|out of memory")

STARTUP = """\
(APIServer pid=1) INFO 06-02 09:14:02 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.33.0
(APIServer pid=1) INFO 06-02 09:14:02 [api_utils.py:286] non-default args: {'model': '/models/qwen-14b', 'max_model_len': 32768}
(APIServer pid=1) INFO 06-02 09:14:09 [model.py:2152] Using max model len 32768
(EngineCore_DP0 pid=212) INFO 06-02 09:14:15 [core.py:133] Initializing a V1 LLM engine (v0.33.0) with config: model='/models/qwen-14b', dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=1
(EngineCore_DP0 pid=212) INFO 06-02 09:14:24 [gpu_model_runner.py:5150] Model loading took 27.54 GiB memory and 7.004518 seconds
(EngineCore_DP0 pid=212) INFO 06-02 09:14:39 [gpu_worker.py:760] Available KV cache memory: 42.17 GiB
(EngineCore_DP0 pid=212) INFO 06-02 09:14:39 [kv_cache_utils.py:2327] GPU KV cache size: 230,304 tokens, Maximum concurrency for 32,768 tokens per request: 7.03x
(EngineCore_DP0 pid=212) INFO 06-02 09:14:52 [gpu_model_runner.py:6582] Graph capturing finished in 9 secs, took 0.87 GiB
(EngineCore_DP0 pid=212) INFO 06-02 09:14:54 [core.py:402] init engine (profile, create kv cache, warmup model) took 30.21 s
(APIServer pid=1) INFO 06-02 09:14:56 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
INFO:     Started server process [1]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
"""

REQUEST_ERROR = """\
(APIServer pid=1) ERROR {ts} [serving_chat.py:200] Error in preprocessing prompt inputs
(APIServer pid=1) ERROR {ts} [serving_chat.py:200] Traceback (most recent call last):
(APIServer pid=1) ERROR {ts} [serving_chat.py:200]   File "/opt/venv/lib/python3.12/site-packages/vllm/entrypoints/openai/serving_chat.py", line 183, in create_chat_completion
(APIServer pid=1) ERROR {ts} [serving_chat.py:200]     ) = await self._preprocess_chat(
(APIServer pid=1) ERROR {ts} [serving_chat.py:200]   File "/opt/venv/lib/python3.12/site-packages/vllm/entrypoints/openai/serving_engine.py", line 612, in _validate_input
(APIServer pid=1) ERROR {ts} [serving_chat.py:200]     raise ValueError(
(APIServer pid=1) ERROR {ts} [serving_chat.py:200] ValueError: This model's maximum context length is 32768 tokens. However, you requested 40100 tokens (39100 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.
INFO:     10.0.0.9:40112 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request
"""

CRASH = """\
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131] EngineCore encountered a fatal error.
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131] Traceback (most recent call last):
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131]   File "/opt/venv/lib/python3.12/site-packages/vllm/v1/engine/core.py", line 1170, in run_busy_loop
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131]     self._process_engine_step()
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131]   File "/opt/venv/lib/python3.12/site-packages/vllm/v1/worker/gpu_model_runner.py", line 3411, in execute_model
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131]     model_output = self.model(
(EngineCore_DP0 pid=212) ERROR {ts} [core.py:1131] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 21.75 MiB is free. Including non-PyTorch memory, this process has 79.10 GiB memory in use.
(APIServer pid=1) ERROR {ts} [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
INFO:     Shutting down
"""


def write_log(path: Path, n_lines: int, seed: int = 7) -> int:
    """Write a realistic serving log of about ``n_lines`` lines; return the number written."""
    rng = random.Random(seed)
    out: list[str] = STARTUP.splitlines()
    second = 0
    while len(out) < n_lines - 10:
        second += 1
        ts = f"06-02 {9 + second // 3600 % 14:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
        roll = rng.random()
        if roll < 0.40:
            ip = f"10.0.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(30000, 60000)}"
            out.append(f'INFO:     {ip} - "POST /v1/chat/completions HTTP/1.1" 200 OK')
        elif roll < 0.70:
            out.append(
                f"(APIServer pid=1) INFO {ts} [loggers.py:236] Engine 000: Avg prompt throughput: "
                f"{rng.uniform(0, 5000):.1f} tokens/s, Avg generation throughput: {rng.uniform(0, 900):.1f} tokens/s, "
                f"Running: {rng.randrange(64)} reqs, Waiting: {rng.randrange(8)} reqs, GPU KV cache usage: "
                f"{rng.uniform(0, 100):.1f}%, Prefix cache hit rate: {rng.uniform(0, 60):.1f}%"
            )
        elif roll < 0.85:
            out.append(
                f"(APIServer pid=1) INFO {ts} [logger.py:43] Received request chatcmpl-{rng.getrandbits(64):016x}: "
                f"params: SamplingParams(n=1, temperature=0.7, top_p=0.95, max_tokens={rng.randrange(16, 4096)}), "
                f"prompt_token_ids: None, lora_request: None."
            )
        elif roll < 0.95:
            out.append(
                f"(APIServer pid=1) INFO {ts} [async_llm.py:420] Added request chatcmpl-{rng.getrandbits(64):016x}."
            )
        elif roll < 0.997:
            out.append(
                f"(EngineCore_DP0 pid=212) WARNING {ts} [scheduler.py:1620] Request chatcmpl-{rng.getrandbits(48):012x} "
                "was preempted: not enough free KV cache blocks; it will be recomputed."
            )
        else:
            out.extend(REQUEST_ERROR.format(ts=ts).splitlines())
    out.extend(CRASH.format(ts="06-02 23:59:59").splitlines())
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return len(out)


def baseline(path: Path) -> int:
    hits = 0
    search = BASELINE_RE.search
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if search(line):
                hits += 1
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-ratio", type=float, default=3.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="r1sup-bench-") as tmp:
        path = Path(tmp) / "vllm.log"
        written = write_log(path, args.lines)
        size_mib = path.stat().st_size / 2**20
        best_base = best_diag = float("inf")
        failure = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            baseline(path)
            t1 = time.perf_counter()
            failure, _ = diagnose_path(str(path))
            t2 = time.perf_counter()
            best_base = min(best_base, t1 - t0)
            best_diag = min(best_diag, t2 - t1)
    assert failure is not None
    ratio = best_diag / best_base
    print(f"log: {written} lines, {size_mib:.1f} MiB (best of {args.repeat})")
    print(
        f"{'baseline (one regex per line)':<32} {best_base * 1000:8.1f} ms  {best_base / written * 1e6:6.2f} us/line"
    )
    print(f"{'r1sup diagnose':<32} {best_diag * 1000:8.1f} ms  {best_diag / written * 1e6:6.2f} us/line")
    print(f"ratio {ratio:.2f}x (limit {args.max_ratio:.1f}x); verdict: {failure.cls} ({failure.phase})")
    if failure.cls != "oom_runtime":
        print("FAIL: diagnose did not find the crash at the end of the log", file=sys.stderr)
        return 1
    if ratio > args.max_ratio:
        print("FAIL: diagnose is too slow", file=sys.stderr)
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
