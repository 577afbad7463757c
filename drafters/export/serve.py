"""What the Prefect UI shows for a trained drafter: a link to its checkpoint and the commands that export and
serve it, as `draftsmith export` prints them."""

import json
import logging

from draftsmith.core import storage, ui
from draftsmith.core.manifest import StageManifest
from draftsmith.core.target_setup import EMBEDDED_PREFIX, resolve_target
from draftsmith.drafters.export import bundle, engines

log = logging.getLogger(__name__)


def _served_target(source: str) -> str:
    """What `vllm serve` takes for the recipe's target: the model folder of an embedded one, else the source."""
    return str(resolve_target(source)) if source.startswith(EMBEDDED_PREFIX) else source


def _measured_eager(run_dir: str) -> bool:
    """Whether the run's recipe measures serving without graph compilation (`speedup.compile: false`)."""
    recipe = storage.join(run_dir, "recipe.yaml")
    if not storage.exists(recipe):
        return False
    from draftsmith.core.config import load_recipe

    return not load_recipe(recipe, files=False).speedup.compile


def serve_markdown(
    checkpoint: StageManifest, *, target_source: str, depth: int | None, platform: str | None = None
) -> str:
    """The export and vLLM launch commands for the train stage's checkpoint, as `draftsmith export` prints them.

    Args:
        checkpoint: The train stage's manifest (`info.drafter` is the recipe's drafter kind).
        target_source: The recipe's `target.source`.
        depth: The EAGLE-3 drafter's trained depth (`drafter.ttt_depth`); block drafters read their config.
        platform: `cpu` or `gpu` form of the vLLM command; None: the platform this stage ran on.
    """
    run_dir = checkpoint.uri.rstrip("/").rsplit("/", 1)[0]
    kind = checkpoint.info.get("drafter", "")
    method = bundle.method_of(kind)
    config = storage.read_json(checkpoint.path(bundle.CONFIG))
    n = bundle.method_module(method).num_speculative_tokens(config, depth)
    folder = storage.join(run_dir, "export", "vllm")
    if storage.is_local(folder):
        folder = str(storage.local_path(folder).resolve())
    platform = platform or engines.detect_platform()
    command = engines.launch_command(
        method, "vllm", _served_target(target_source), folder, n, platform=platform, eager=_measured_eager(run_dir)
    )
    spec = json.dumps(engines.vllm_speculative_config(method, folder, n))
    lines = [
        f"# Serve the {ui.run_label(run_dir)} {method} drafter with vLLM",
        "",
        "1. Export the checkpoint (bf16 weights, the engine's layer-id convention, export checks):",
        "",
        "```bash",
        f"draftsmith export {run_dir} --engine vllm --platform {platform}",
        "```",
        "",
        "2. Serve the target with it:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Speculative config: `{spec}` ({n} draft tokens per step).",
    ]
    lines += [f"> {note}" for note in engines.engine_notes(method, "vllm")]
    return "\n".join([*lines, ""])


def publish_checkpoint(checkpoint: StageManifest, *, target_source: str, depth: int | None) -> list[str]:
    """A link artifact `<run>-checkpoint` to the trained drafter and the `<run>-serve` markdown; their keys."""
    if not ui.in_prefect_run():
        return []
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    run = ui.run_label(checkpoint.uri, parent=True)
    link_key, serve_key = ui.artifact_key(run, "checkpoint"), ui.artifact_key(run, "serve")
    kind = checkpoint.info.get("drafter", "drafter")
    create_link_artifact(
        link=ui.link_of(checkpoint.uri),
        link_text=f"{run}: trained {kind} checkpoint (model.safetensors, config.json)",
        key=link_key,
        description="The train stage's drafter checkpoint",
    )
    try:
        markdown = serve_markdown(checkpoint, target_source=target_source, depth=depth)
    except (KeyError, ValueError, FileNotFoundError) as err:
        # The checkpoint is trained and stored: a launch line that cannot be rendered must not fail the stage.
        log.warning("train: no vLLM launch command for %s (%s)", checkpoint.uri, err)
        run_dir = checkpoint.uri.rstrip("/").rsplit("/", 1)[0]
        markdown = (
            f"Could not render the vLLM launch command ({err}); `draftsmith export {run_dir} --engine vllm` prints it."
        )
    create_markdown_artifact(markdown=markdown, key=serve_key, description="Export and vLLM launch commands")
    return [link_key, serve_key]
