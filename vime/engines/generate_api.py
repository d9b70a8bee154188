"""vLLM's `/inference/v1/generate` as vime speaks it (servers launched with
`--enable-scale-out`): the sampling parameters sent, and what comes back per request (token ids,
their log-probs, the weight-version spans expanded to one version per token, the prompt tokens
served from the prefix cache). `vime.engines.generation` sends the requests.
"""

from __future__ import annotations

import base64
import bisect
import io
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


class GenerationError(RuntimeError):
    """A generate request failed; the message names the engine URL and carries the response body."""


@dataclass(frozen=True)
class SamplingConfig:
    """The subset of vLLM SamplingParams vime uses (sent as they are).

    `seed` on vLLM 0.32's CPU build: a seeded request that gets preempted (a keep pause with
    clear_cache=True preempts every running request) kills the engine with "CPU Generator does not
    use offset". Leave it None on CPU when pausing with clear_cache.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def to_request(self) -> dict[str, Any]:
        params = asdict(self)
        params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is None:
            params.pop("seed")
        params["logprobs"] = 0  # log-prob of the sampled token only
        # vLLM 0.32 reports wrong weight-version spans when detokenize is false (every token gets
        # the version current at the first labelled step); with it on they are exact.
        params["detokenize"] = True
        return params


@dataclass
class GenerationResult:
    """One finished (or aborted) request: every generated token with its log-prob and version."""

    request_id: str
    engine_url: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str | None] = field(default_factory=list)
    finish_reason: str | None = None
    start_time: float = 0.0
    end_time: float = 0.0
    # Prompt tokens whose KV came from the prefix cache (None: the engine does not say; vime's
    # launcher starts engines with --enable-prompt-tokens-details, and with streaming it comes
    # only with stream_options.include_usage).
    num_cached_tokens: int | None = None
    # Streamed: when each chunk arrived (time.monotonic) and how many tokens the result held
    # after it; what `switch_gaps` measures a sync's stall from.
    chunk_times: list[float] = field(default_factory=list, repr=False)
    chunk_ends: list[int] = field(default_factory=list, repr=False)
    # vLLM's [{version, start, end}) spans of the tokens so far (weight_versions, expanded, is
    # set from them when the request ends).
    version_spans: list[dict[str, Any]] | None = field(default=None, repr=False)
    # The experts each MoE layer routed each token to, [prompt + output tokens - 1, layers,
    # top-k] (engines started with --enable-return-routed-experts; None otherwise).
    routed_experts: np.ndarray | None = field(default=None, repr=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def switch_gaps(self) -> list[float]:
        """Seconds between the chunk with the last token of one weight version and the chunk
        with the first token of the next, per version switch: how long a sync held this
        request's stream (a decode step and the stream's own delay included). Streamed
        results only (also one cancelled mid-stream); a switch inside one chunk counts 0."""
        versions = self.weight_versions or expand_weight_versions(
            self.version_spans, len(self.token_ids)
        )
        gaps = []
        for index in range(1, len(versions)):
            if versions[index] != versions[index - 1]:
                before = bisect.bisect_left(self.chunk_ends, index)  # the chunk of token index-1
                after = bisect.bisect_left(self.chunk_ends, index + 1)  # that of token index
                if after < len(self.chunk_times):
                    gaps.append(self.chunk_times[after] - self.chunk_times[before])
        return gaps


def cached_tokens(body: dict[str, Any], default: int | None = None) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a response, if it has one."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return int(cached) if isinstance(cached, int) else default


def add_choices(result: GenerationResult, choices: list[dict[str, Any]]) -> None:
    """Append one response's (or stream chunk's) tokens to result; its version spans (which
    cover every token so far) replace the result's."""
    for choice in choices:
        result.token_ids.extend(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        result.logprobs.extend(entry["logprob"] for entry in content)
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
        if choice.get("weight_versions") is not None:
            result.version_spans = choice["weight_versions"]
        if choice.get("routed_experts"):
            result.routed_experts = decode_routed_experts(choice["routed_experts"])


def decode_routed_experts(encoded: str) -> np.ndarray:
    """vLLM's `routed_experts` field (base64 of a `.npy` array, read without unpickling):
    [tokens - 1, MoE layers, top-k] integers."""
    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(
            f"routed_experts: expected a [tokens, layers, top-k] integer array, got "
            f"{array.dtype} of shape {array.shape}"
        )
    return array


def expand_weight_versions(spans: list[dict[str, Any]] | None, num_tokens: int) -> list[str | None]:
    """Turn vLLM's [{version, start, end}) spans into one version per output token."""
    versions: list[str | None] = [None] * num_tokens
    for span in spans or []:
        for index in range(span["start"], min(span["end"], num_tokens)):
            versions[index] = span["version"]
    return versions
