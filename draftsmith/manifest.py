"""The small typed records that stages hand each other: URIs, counts, hashes. Never tensors."""

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from draftsmith import storage


class FileEntry(BaseModel):
    """One artifact of a stage, relative to the stage folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Path relative to the stage folder.")
    bytes: int = Field(ge=0, description="Size in bytes.")
    sha256: str = Field(description="Content hash.")


class StageManifest(BaseModel):
    """What a stage produced. It is written last, so its presence means the stage completed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str = Field(description="Stage name.")
    key: str = Field(description="Hash of the stage's code, config and upstream manifests.")
    uri: str = Field(description="Stage folder (local path or fsspec URL).")
    files: list[FileEntry] = Field(default_factory=list, description="Artifacts with sizes and hashes.")
    counts: dict[str, int] = Field(default_factory=dict, description="Rows, tokens, drops per reason...")
    metrics: dict[str, float] = Field(default_factory=dict, description="Measured figures.")
    info: dict[str, str] = Field(default_factory=dict, description="Provenance (engine, model, hashes).")
    seconds: float = Field(0.0, ge=0.0, description="Wall time of the stage's own work.")
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(), description="UTC time.")

    def path(self, name: str) -> str:
        """URL of one artifact."""
        return storage.join(self.uri, name)

    def names(self, prefix: str = "") -> list[str]:
        return [f.name for f in self.files if f.name.startswith(prefix)]

    def artifacts_present(self) -> bool:
        """Every recorded artifact still exists with its recorded size."""
        try:
            return all(storage.size(self.path(f.name)) == f.bytes for f in self.files)
        except FileNotFoundError:
            return False


def file_entry(stage_uri: str, name: str, data: bytes) -> FileEntry:
    """Write an artifact atomically and describe it."""
    storage.write_bytes(storage.join(stage_uri, name), data)
    return FileEntry(name=name, bytes=len(data), sha256=storage.sha256(data))
