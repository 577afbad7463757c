"""Configuration of the regeneration stage and its target engines."""

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.stages import Resources

_SHA256 = re.compile(r"[0-9a-f]{64}")


class OpenAIEndpointConfig(StrictModel):
    """An OpenAI-compatible `/v1/chat/completions` server: vLLM, SGLang, TokenSpeed or a hosted API."""

    base_url: str = Field(
        min_length=1, description="Server URL up to and including `/v1`; `/chat/completions` is appended."
    )
    model: str = Field(min_length=1, description="Model name the server knows the target by.")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key (sent as a Bearer token, never recorded)."
    )
    concurrency: int = Field(8, gt=0, description="Requests in flight at once.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout in seconds.")
    max_retries: int = Field(5, ge=0, description="Retries of 429, 5xx, connection errors and timeouts.")
    backoff_s: float = Field(1.0, ge=0, description="First retry delay; doubles per retry, with jitter.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        if urlsplit(value).username is not None:
            raise ValueError("must not carry credentials (they would be logged); name the key in api_key_env")
        return value.rstrip("/")


class VLLMOfflineConfig(StrictModel):
    """vLLM's offline `LLM` engine, in-process or in the interpreter of a separate venv."""

    python: str | None = Field(
        None,
        description="Interpreter of a venv holding vllm; None runs in-process when vllm imports, "
        "else `.venv-vllm/bin/python`.",
    )
    max_model_len: int = Field(2048, gt=0, description="Longest prompt plus answer, in tokens.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra `vllm.LLM` arguments, e.g. tensor_parallel_size."
    )


class RegenerateConfig(StrictModel):
    """Response regeneration: the target answers every user turn, in order."""

    engine: Literal["hf", "openai", "vllm"] = Field("hf", description="Target engine backend.")
    batch_size: int = Field(16, gt=0, description="Conversations generated together (hf engine).")
    max_new_tokens: int = Field(128, gt=0, description="Token limit per assistant turn.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int = Field(1, gt=0, description="Samples per prompt; with n > 1 conversation ids are `<id>#<sample>`.")
    thinking: bool = Field(
        False, description="Thinking mode: the chat-template switch `enable_thinking` for hf and vllm engines."
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Merged into every request body (openai) or passed as chat-template kwargs (hf, vllm).",
    )
    drop_truncated: bool = Field(False, description="Drop conversations with a turn that hit max_new_tokens.")
    max_rejected_share: float = Field(
        0.5, ge=0.0, le=1.0, description="Fail the stage when more than this share of conversations is dropped."
    )
    chat_template_sha256: str | None = Field(
        None, description="The serving chat template's sha256, when the engine cannot report it (remote servers)."
    )
    shard_size: int = Field(64, gt=0, description="Prompts per output shard (the resume unit).")
    openai: OpenAIEndpointConfig | None = Field(None, description="The server, when engine is `openai`.")
    vllm: VLLMOfflineConfig = Field(default_factory=VLLMOfflineConfig, description="vLLM offline engine.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @field_validator("chat_template_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256.fullmatch(value):
            raise ValueError("must be 64 lowercase hex digits (a full sha256)")
        return value

    @model_validator(mode="after")
    def _engine_settings(self) -> "RegenerateConfig":
        if self.engine == "openai" and self.openai is None:
            raise ValueError("regenerate.openai: required when regenerate.engine is 'openai'")
        if self.engine != "openai" and self.openai is not None:
            raise ValueError(f"regenerate.openai: only used when regenerate.engine is 'openai' (it is {self.engine!r})")
        if self.engine != "openai" and "enable_thinking" in self.extra_body:
            raise ValueError("regenerate.extra_body.enable_thinking: set regenerate.thinking instead")
        if self.engine != "openai" and "chat_template_kwargs" in self.extra_body:
            raise ValueError(
                "regenerate.extra_body.chat_template_kwargs: the hf and vllm engines take chat-template kwargs "
                "directly in regenerate.extra_body"
            )
        return self
