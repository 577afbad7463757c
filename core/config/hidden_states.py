"""The hidden-state stage: capture engine, tap convention and capture points, store reduction, transport."""

from typing import Literal

from pydantic import Field, field_validator, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.regenerate import VLLMOfflineConfig
from draftsmith.core.config.stages import Resources


class OnlineConfig(StrictModel):
    """Online mode: hidden states stream through a Mooncake store into the trainer; nothing is stored."""

    master_addr: str | None = Field(
        None,
        description="`host:port` of a running mooncake_master (with `metadata_url`). None: the training stage "
        "starts one on free loopback ports for the run and stops it afterwards.",
    )
    metadata_url: str | None = Field(None, description="Mooncake HTTP metadata URL of `master_addr`.")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transfer protocol.")
    device: str = Field("", description="RDMA device names for protocol rdma (empty for tcp).")
    local_hostname: str = Field("127.0.0.1", description="Address this node's Mooncake client advertises.")
    segment_mb: int = Field(
        512, gt=0, description="Memory the trainer lends the store: the bound producers back off against."
    )
    queue_addr: str = Field(
        "127.0.0.1:0", description="`host:port` the trainer's metadata queue listens on (0: any free port)."
    )
    producers: Literal["local", "external"] = Field(
        "local",
        description="`local`: the training stage starts the producer processes itself. `external`: producers "
        "run elsewhere (the `hidden-states` flow in online mode, on the GPU pool) and connect to queue_addr.",
    )
    num_producers: int = Field(1, ge=1, description="Producer processes (each takes every n-th sample).")
    peer_timeout_s: float = Field(
        300.0, gt=0, description="A producer silent this long (no sample, no heartbeat) fails the run."
    )
    master_timeout_s: float = Field(
        30.0,
        gt=0,
        description="The Mooncake master refusing connections this long fails the run, naming it and the samples "
        "lost with it (at once if a put or get fails meanwhile). Probed every second.",
    )
    window_samples: int = Field(
        64, gt=0, description="Arriving samples grouped into length-sorted batches at a time (bounds memory)."
    )


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
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="`offline`: capture into the store, then train from it. `online`: stream through Mooncake "
        "while training runs alongside (each epoch re-captures; no disk).",
    )
    online: OnlineConfig = Field(default_factory=OnlineConfig, description="Mooncake streaming, for mode online.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @model_validator(mode="after")
    def _online_addresses(self) -> "HiddenStatesConfig":
        o = self.online
        if (o.master_addr is None) != (o.metadata_url is None):
            raise ValueError("hidden_states.online.metadata_url: set together with master_addr (or neither)")
        if o.producers == "external" and (o.master_addr is None or o.queue_addr.endswith(":0")):
            raise ValueError(
                "hidden_states.online.producers: external producers need a fixed master_addr/metadata_url "
                "and a fixed queue_addr port to connect to"
            )
        return self

    @field_validator("taps")
    @classmethod
    def _taps_ascending_unique(cls, taps: list[int]) -> list[int]:
        for i, tap in enumerate(taps):
            if tap < 1:
                raise ValueError(f"taps[{i}] = {tap}: taps count from 1 (the output of the first layer)")
        if taps != sorted(set(taps)):
            raise ValueError(f"taps {taps} must be strictly ascending")
        return taps
