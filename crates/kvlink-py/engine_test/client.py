"""HTTP to the engines and the router (standard library only, every call bounded).

Prompts are token id lists, so every prompt has an exact length and no
tokenizer round trip; answers carry token ids (``return_token_ids``) and
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``;
vLLM leaves it out when it is 0).
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

#: One request's bound: the longest prompt's prefill plus 16 tokens takes
#: well under a second here; a pull that fails waits at most D's
#: ``transfer_timeout`` before D recomputes.
REQUEST_TIMEOUT = 60.0

#: What the router sends P, as vLLM's toy proxy does.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def bootstrap_legs(bootstrap_url: str, engine_id: str, transfer_id: str) -> tuple[dict, dict]:
    """What a router in the bootstrap flow sends P and D (vLLM's Mooncake
    proxy's and vllm-router's ``mooncake`` mode's fields)."""
    p_leg = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_leg = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_url,
        "remote_engine_id": engine_id,
    }
    return p_leg, d_leg


def bootstrap_engines(bootstrap_url: str) -> dict[str, str]:
    """The engine id of each data-parallel rank, as P's bootstrap server lists them."""
    status, text = get(f"{bootstrap_url}/query")
    if status != 200:
        raise AssertionError(f"{bootstrap_url}/query: HTTP {status}: {text[:300]}")
    return {rank: entry["engine_id"] for rank, entry in json.loads(text).items()}


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (connection refused, reset, timeout)
    body: Any = None
    seconds: float = 0.0
    error: str = ""
    ttft: float | None = None  # streaming: seconds to the first token
    token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and isinstance(self.body, dict) and "choices" in self.body

    @property
    def cached_tokens(self) -> int:
        usage = (self.body or {}).get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def kv_transfer_params(self) -> dict | None:
        return (self.body or {}).get("kv_transfer_params") if isinstance(self.body, dict) else None

    def describe(self) -> str:
        if self.status is None:
            return f"no answer after {self.seconds:.1f} s ({self.error})"
        if not self.ok:
            return f"HTTP {self.status} after {self.seconds:.1f} s: {str(self.body)[:300]}"
        return f"HTTP 200 after {self.seconds:.1f} s, cached_tokens={self.cached_tokens}"


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path or "/"


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    conn, path = _connection(url, timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def health(base_url: str) -> bool:
    try:
        return get(base_url + "/health", timeout=2.0)[0] == 200
    except OSError:
        return False


def metric(base_url: str, name: str) -> float:
    """One sample of a Prometheus gauge from ``/metrics`` (its first series)."""
    status, text = get(base_url + "/metrics")
    assert status == 200, f"{base_url}/metrics: HTTP {status}"
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{base_url}/metrics has no {name}")


#: One sample line of the Prometheus text format: name, {labels}, value.
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(base_url: str, prefix: str = "") -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``/metrics`` whose name starts with ``prefix``: (name, labels, value)."""
    status, text = get(base_url + "/metrics")
    assert status == 200, f"{base_url}/metrics: HTTP {status}"
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix) or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_sum(base_url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples matching ``labels`` (0 when it has none yet)."""
    return sum(
        value
        for sample, have, value in samples(base_url, name)
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


def completion_body(prompt: list[int], max_tokens: int = 16, params: dict | None = None, **extra: Any) -> dict:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        # The random model may draw its end-of-sequence token: every answer
        # has max_tokens tokens, so any two can be compared.
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    body.update(extra)
    return body


def post(base_url: str, body: dict, request_id: str | None = None, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """``POST /v1/completions`` (not streamed)."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    started = time.monotonic()
    conn, _ = _connection(base_url, timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        raw = response.read().decode(errors="replace")
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        answer = Answer(response.status, parsed, time.monotonic() - started)
        if answer.ok:
            answer.token_ids = list(parsed["choices"][0].get("token_ids") or [])
        return answer
    except (OSError, http.client.HTTPException) as e:
        return Answer(None, None, time.monotonic() - started, error=repr(e))
    finally:
        conn.close()


def stream(base_url: str, body: dict, request_id: str | None = None, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """``POST /v1/completions`` streamed: ``ttft`` is the time to the first
    chunk carrying a token, ``body`` the last chunk's usage (as ``{"usage": ...}``)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    started = time.monotonic()
    conn, _ = _connection(base_url, timeout)
    answer = Answer(None)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        answer.status = response.status
        if response.status != 200:
            answer.body = response.read().decode(errors="replace")
            return answer
        usage = None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and answer.ttft is None:
                    answer.ttft = time.monotonic() - started
                answer.token_ids.extend(ids)
            usage = chunk.get("usage") or usage
        answer.body = {"choices": [{}], "usage": usage}
        return answer
    except (OSError, http.client.HTTPException, ValueError) as e:
        answer.error = repr(e)
        answer.status = None
        return answer
    finally:
        answer.seconds = time.monotonic() - started
        conn.close()
