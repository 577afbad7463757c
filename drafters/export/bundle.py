"""`draftsmith export`: a trained run's drafter as a serving folder for vLLM, SGLang or TokenSpeed.

The folder holds `model.safetensors` (bf16 floats; d2t int64 and t2d bool where the vocabulary is pruned)
and `config.json` with the fields the engine reads, plus a `draftsmith` block recording the taps and their
convention, the capture point, the target's name and hashes, the recipe hash and the train stage key.
Every guard in `draftsmith.drafters.export.guards` runs on the final bytes before anything is written; the folder
appears atomically (written beside it, then renamed).
"""

import hashlib
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.core import storage, tensorio
from draftsmith.drafters import families
from draftsmith.drafters.export import engines, guards, methods, schedule
from draftsmith.drafters.families import ExportMethod

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TAP_CONVENTION = "residual stream after decoder layer k, counting from 1 (HF hidden_states[k])"


def method_of(kind: str) -> str:
    """The `--speculative-config` method that serves drafter family `kind` (its export module's)."""
    try:
        return methods.method_of(kind)
    except ValueError as err:
        raise guards.ExportError(str(err)) from None


@dataclass(frozen=True)
class ExportResult:
    folder: str
    method: str
    engine: str
    num_speculative_tokens: int
    engine_args: list[str]
    command: str
    notes: list[str]
    platform: str = "gpu"
    schedule: list[list[int]] | None = None  # vLLM's draft tokens per batch size, when measured

    def render(self) -> str:
        engine = f"{self.engine} ({self.platform})" if self.engine == "vllm" else self.engine
        lines = [f"exported {self.method} drafter for {engine}: {self.folder}"]
        if self.engine == "vllm":
            cfg = engines.vllm_speculative_config(self.method, self.folder, self.num_speculative_tokens, self.schedule)
            lines.append(f"--speculative-config {shlex.quote(json.dumps(cfg))}")
        else:
            lines.append("speculative arguments: " + " ".join(self.engine_args))
        lines.append(f"launch: {self.command}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def method_module(method: str) -> ExportMethod:
    """The export module of serving method `method` (`draftsmith.drafters.export.methods`)."""
    try:
        return methods.module(method)
    except ValueError:
        raise guards.ExportError(f"drafter kind {method!r}: expected one of {', '.join(methods.names())}") from None


def verify_blobs(
    method: str,
    engine: str,
    blobs: dict[str, bytes],
    *,
    taps: list[int],
    num_target_layers: int,
    target_embed_VH: torch.Tensor | None = None,
) -> None:
    """Every guard, on the exact bytes that would be written. Raises `ExportError`."""
    for name in (WEIGHTS, CONFIG):
        if name not in blobs:
            raise guards.ExportError(f"{name}: missing from the export")
    module = method_module(method)
    config = json.loads(blobs[CONFIG])
    tensors, _ = tensorio.loads(blobs[WEIGHTS])
    try:
        expected = module.expected_shapes(config)
        ids = module.config_layer_ids(config)
    except (KeyError, TypeError, ValueError) as err:
        raise guards.ExportError(f"{CONFIG}: cannot derive the expected keys: {err!r}") from None
    guards.check_tensors(tensors, expected, WEIGHTS)
    for name, value in tensors.items():
        if value.is_floating_point() and value.dtype != torch.bfloat16:
            raise guards.ExportError(f"{WEIGHTS}: key {name!r} is {value.dtype}, exports store bf16")
    guards.check_draft_vocab(tensors, WEIGHTS)
    guards.check_aux_ids(method, engine, taps, ids, num_target_layers, f"{CONFIG}: layer ids")
    if "embed_tokens.weight" in tensors:
        guards.check_embedding(tensors["embed_tokens.weight"], target_embed_VH, f"{WEIGHTS}: embed_tokens.weight")


def export_drafter(
    method: str,
    model: torch.nn.Module,
    taps: list[int],
    metadata: dict,
    *,
    engine: str,
    num_target_layers: int,
    target_embed_VH: torch.Tensor | None,
) -> dict[str, bytes]:
    """The checked `{file: bytes}` of `model`'s serving folder for `engine`."""
    engines.check_engine(engine, method)
    # The engines share the target's embedding, so a drafter trained on a never-copied one would serve garbage.
    embed = families.weight_of(model.get_submodule("embed_tokens"))
    guards.check_embedding(embed.detach(), target_embed_VH, "drafter embed_tokens.weight")
    metadata = {"num_target_layers": num_target_layers, **metadata}
    module = method_module(method)
    try:
        check_servable = getattr(module, "check_servable", None)  # an optional member of ExportMethod
        if check_servable is not None:
            check_servable(model.spec, engine)
        blobs = module.checkpoint_blobs(model, taps, metadata, engine=engine)
    except guards.ExportError:
        raise
    except ValueError as err:
        raise guards.ExportError(f"{method} for {engine}: {err}") from None
    blobs = with_context_length(blobs, metadata.get("max_position_embeddings"))
    verify_blobs(method, engine, blobs, taps=taps, num_target_layers=num_target_layers, target_embed_VH=target_embed_VH)
    return blobs


def with_context_length(blobs: dict[str, bytes], max_positions: int | None) -> dict[str, bytes]:
    """config.json with the target's context as top-level `max_position_embeddings`, where engines read it.

    Without it an EAGLE-3 config falls back to Llama's 2048 and vLLM raises it to the target's max_model_len
    ("Overriding draft model max_position_embeddings ..."); a larger value than the target's makes vLLM cut the
    draft's max model len instead. Unknown (None) leaves the config as the drafter family wrote it.
    """
    if not max_positions:
        return blobs
    config = json.loads(blobs[CONFIG])
    if config.get("max_position_embeddings") == int(max_positions):
        return blobs
    config["max_position_embeddings"] = int(max_positions)
    return blobs | {CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def write_folder(out: str | Path, blobs: dict[str, bytes]) -> Path:
    """Write the files beside `out`, then swap the finished folder in (an old one is replaced whole)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, data in blobs.items():
        (tmp / name).write_bytes(data)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _tensor_index(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise guards.ExportError(f"{folder}: no safetensors weights to read the target's embedding from")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            out |= {k: path for k in f.keys()}
    return out


def target_weights(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head `[V, H]` (fp32), read without loading the model.

    A target with tied embeddings (no `lm_head.weight`) returns the embedding twice.
    """
    folder = Path(folder)
    index = _tensor_index(folder)

    def read(suffix: str) -> torch.Tensor | None:
        keys = sorted((k for k in index if k.endswith(suffix)), key=len)
        if not keys:
            return None
        with safe_open(str(index[keys[0]]), "pt") as f:
            return f.get_tensor(keys[0]).float()

    embed = read("embed_tokens.weight")
    if embed is None:
        raise guards.ExportError(f"{folder}: no '*embed_tokens.weight' tensor in the target's weights")
    head = read("lm_head.weight")
    return embed, embed if head is None else head


def target_sha256(folder: str | Path) -> str:
    """Hash of the target's config.json and, for embedded targets, its per-file hash list (weights included)."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    record = folder / "draftsmith-target.json"
    if record.exists():
        h.update(record.read_bytes())
    return h.hexdigest()


def _load_trained(method: str, module: ExportMethod, folder: str, embed: torch.Tensor, head: torch.Tensor):
    """The fp32 drafter from the train stage folder, with the target's embedding and lm_head to share."""
    loaded = module.load_drafter(folder, embed, head)
    return loaded[0] if isinstance(loaded, tuple) else loaded


def _store_info(run_dir: str) -> dict:
    """The hidden-state store's dataset.json ({} for an online run, which stores none)."""
    path = storage.join(run_dir, "hidden_states", "dataset.json")
    return storage.read_json(path) if storage.exists(path) else {}


def run_metadata(cfg, train_dir: str, train_key: str, taps: list[int], store: dict, target_dir: Path) -> dict:
    """The provenance embedded in config.json's `draftsmith` block."""
    from draftsmith.core.config import dump_recipe

    hs = cfg.hidden_states
    return {
        "tap_convention": TAP_CONVENTION,
        "tap_point": store.get("tap_point", hs.tap_point),
        "last_hidden": store.get("last_hidden", hs.last_hidden),
        "target": cfg.target.name,
        "target_source": cfg.target.source,
        "target_sha256": target_sha256(target_dir),
        "tokenizer_sha256": store.get("tokenizer_sha256", ""),
        "recipe": cfg.name,
        "recipe_sha256": hashlib.sha256(dump_recipe(cfg).encode()).hexdigest(),
        "train_key": train_key,
        "ttt_depth": cfg.drafter.trained_depth,
        "train_stage": train_dir,
        "max_position_embeddings": _target_config(target_dir).get("max_position_embeddings"),
    }


def _target_config(target_dir: Path) -> dict:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return config.get("text_config") or config


def export_run(
    run_dir: str,
    engine: str,
    *,
    recipe: str | None = None,
    out: str | None = None,
    platform: str | None = None,
    port: int | None = None,
) -> ExportResult:
    """Export the drafter of a finished run (`<run>/train/`) for `engine` into `out` (default `<run>/export/<engine>`).

    The recipe (`--recipe`, else `<run>/recipe.yaml`) names the target whose embedding the guards compare with.
    `platform` (`cpu`/`gpu`, default: `gpu` when CUDA is visible) and `port` shape the printed vLLM command.
    """
    platform = platform or engines.detect_platform()
    if platform not in engines.PLATFORMS:
        raise guards.ExportError(f"platform {platform!r}: expected one of {', '.join(engines.PLATFORMS)}")
    from draftsmith.core.config import load_recipe
    from draftsmith.core.target_setup import resolve_target

    recipe = recipe or storage.join(run_dir, "recipe.yaml")
    if not storage.exists(str(recipe)):
        raise guards.ExportError(f"{recipe}: recipe not found; pass --recipe with the recipe the run used")
    cfg = load_recipe(recipe)
    train_dir = storage.join(run_dir, "train")
    manifest = guards.check_checkpoint(train_dir)
    trained = storage.read_json(storage.join(train_dir, CONFIG)).get("draftsmith") or {}
    kind = manifest.info.get("drafter") or trained.get("method") or cfg.drafter.kind
    method = method_of(kind)
    taps = [int(t) for t in trained.get("taps") or []]
    store = _store_info(run_dir)
    if store and list(store.get("taps", [])) != taps:
        raise guards.ExportError(f"hidden_states/dataset.json: taps {store.get('taps')} != train/config.json {taps}")
    target_dir = resolve_target(cfg.target.source)
    embed, head = target_weights(target_dir)
    module = method_module(method)
    model = _load_trained(method, module, train_dir, embed, head)
    metadata = run_metadata(cfg, train_dir, manifest.key, taps, store, target_dir)
    blobs = export_drafter(
        method, model, taps, metadata, engine=engine, num_target_layers=cfg.target.num_layers, target_embed_VH=embed
    )
    blobs = module.extra_files(blobs, run_dir, model)
    folder = write_folder(out or storage.join(run_dir, "export", engine), blobs)
    config = json.loads(blobs[CONFIG])
    n = module.num_speculative_tokens(config, cfg.drafter.trained_depth)
    notes = engines.engine_notes(method, engine, platform=platform)
    measured = schedule.measured(run_dir, manifest.key) if engine == "vllm" and cfg.drafter.trained_depth else None
    if measured is not None:
        n = measured.most
        notes.append(measured.describe())
    elif engine == "vllm" and schedule.never_pays(run_dir, manifest.key):
        notes.append(
            "draftsmith speedup found no concurrency where this drafter beats plain serving "
            f"({storage.join(run_dir, *schedule.RESULT)}); see its recommendation before serving it"
        )
    ranges = measured.ranges if measured is not None else None
    path = str(folder.resolve())
    return ExportResult(
        folder=path,
        method=method,
        engine=engine,
        num_speculative_tokens=n,
        engine_args=engines.engine_args(method, engine, path, n, ranges),
        command=engines.launch_command(
            method,
            engine,
            str(target_dir),
            path,
            n,
            platform=platform,
            port=port,
            per_batch_size=ranges,
            eager=not cfg.speedup.compile,
        ),
        notes=notes,
        platform=platform,
        schedule=ranges,
    )
