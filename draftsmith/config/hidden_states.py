"""The hidden-state stage: capture engine, tap convention and capture points, store reduction, transport."""

from typing import Literal

from pydantic import Field, field_validator

from draftsmith.config.base import StrictModel
from draftsmith.config.regenerate import VLLMOfflineConfig
from draftsmith.config.stages import Resources


class HiddenStatesConfig(StrictModel):
    """Target forward that captures the residual stream at the taps, plus the final hidden state."""

    taps: list[int] = Field(
        min_length=1,
        description="Tap k is the residual stream after decoder layer k, counting from 1 (HF hidden_states[k]).",
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Capture engine: transformers forward hooks, or vLLM's `extract_hidden_states`."
    )
    vllm: VLLMOfflineConfig = Field(default_factory=VLLMOfflineConfig, description="vLLM engine, when engine=vllm.")
    tap_point: Literal["layer_output", "next_layer_input"] = Field(
        "layer_output",
        description="Where tap k is read. `layer_output`: the output of decoder layer k. `next_layer_input`: "
        "the value decoder layer k+1 feeds its input (pre-)norm. In a plain pre-norm residual decoder "
        "(Llama, Qwen, DeepSeek, SmolLM2) they are the same tensor. Kimi K3 uses attention residuals: a "
        "layer does not read a running residual sum but a learned softmax mixture of earlier layer outputs, "
        "formed after the attention residual and before the next pre-norm; the target computes with that "
        "mixture, so a Kimi K3 drafter must be trained on it and its recipe sets `next_layer_input`. vLLM "
        "records layer inputs, so its capture is `next_layer_input` by construction.",
    )
    last_hidden: Literal["post_norm", "pre_norm"] = Field(
        "post_norm", description="Capture point of the last hidden state (post final norm by default)."
    )
    batch_tokens: int = Field(4096, gt=0, description="Token budget of one forward micro-batch.")
    shard_samples: int = Field(256, gt=0, description="Samples per safetensors shard.")
    store_dtype: Literal["bfloat16", "float32", "fp8_e4m3"] = Field(
        "bfloat16",
        description="Dtype on disk/wire. fp8_e4m3 keeps one fp32 scale per token row and tap (amax/448).",
    )
    positions: Literal["all", "supervised"] = Field(
        "all",
        description="`supervised` keeps the last hidden state only at rows whose next token is a loss token "
        "(the only rows any drafter loss reads); taps stay at every position, as attention context.",
    )
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @field_validator("taps")
    @classmethod
    def _taps_ascending_unique(cls, taps: list[int]) -> list[int]:
        for i, tap in enumerate(taps):
            if tap < 1:
                raise ValueError(f"taps[{i}] = {tap}: taps count from 1 (the output of the first layer)")
        if taps != sorted(set(taps)):
            raise ValueError(f"taps {taps} must be strictly ascending")
        return taps
