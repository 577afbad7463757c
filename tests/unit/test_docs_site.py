"""The documentation site builds strictly, its recipe reference matches the config models, and the README's links
resolve.

`mkdocs build --strict` turns every warning into a failure: a link to a missing page or anchor, a page missing
from the nav. The recipe reference is generated at build time from the pydantic models
(`docs/hooks/recipe_reference.py`), so these tests read it back from the built HTML.
"""

import html
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from draftsmith.core.config import PipelineConfig
from draftsmith.core.config.train import DistributedConfig, TrainConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"
README = ROOT / "README.md"


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    # mkdocs-material prints an end-of-life banner on every build unless this is set (material/templates).
    env["NO_MKDOCS_2_WARNING"] = "1"
    # The hook imports the config models; from a copy of docs/ the checkout must still be importable.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: mkdocs is in the dev extra (make setup installs it)")
    out = tmp_path_factory.mktemp("docs") / "site"
    proc = _mkdocs_build(ROOT / "mkdocs.yml", out)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def _plain(fragment: str) -> str:
    """HTML as text: tags dropped, entities decoded, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _md_plain(description: str) -> str:
    """A field description as its table cell reads: code spans lose their backticks."""
    return " ".join(description.replace("`", "").split())


def _rows(page: Path) -> list[list[str]]:
    """Every table row of a built page, as the plain text of its cells."""
    source = page.read_text(encoding="utf-8")
    return [
        [_plain(cell) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", source, re.S)
    ]


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _all_fields(model: type[BaseModel], seen: set | None = None) -> set[str]:
    seen = set() if seen is None else seen
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for sub in _models(field.annotation):
            if sub not in seen:
                seen.add(sub)
                names |= _all_fields(sub, seen)
    return names


def test_site_builds_strictly(site: Path) -> None:
    for page in ("index.html", "getting-started/index.html", "tests/index.html", "recipe-reference/index.html"):
        assert (site / page).is_file(), page


def test_recipe_reference_lists_every_recipe_field(site: Path) -> None:
    page = (site / "recipe-reference" / "index.html").read_text(encoding="utf-8")
    found = re.search(r"<table>.*?</table>", page, re.S)
    assert found is not None, "the recipe reference has no table"
    first_table = found.group(0)
    for name in PipelineConfig.model_fields:
        assert f"<code>{name}</code>" in first_table, f"top-level field {name} missing from the root table"
    missing = sorted(n for n in _all_fields(PipelineConfig) if f"<code>{n}</code>" not in page)
    assert not missing, f"fields missing from the recipe reference: {missing}"


def test_recipe_reference_shows_nested_descriptions(site: Path) -> None:
    page = site / "recipe-reference" / "index.html"
    rows = _rows(page)
    # A field two levels down (train.distributed.nproc_per_node): name, type, default and description.
    nested = TrainConfig.model_fields["distributed"].annotation
    assert nested is DistributedConfig
    field = DistributedConfig.model_fields["nproc_per_node"]
    assert ["nproc_per_node", "int, ≥ 1", "1", _md_plain(field.description or "")] in rows
    # Every family of the `drafter` union has its own section, with its own fields.
    headings = [_plain(h) for h in re.findall(r"<h3[^>]*>(.*?)</h3>", page.read_text(encoding="utf-8"), re.S)]
    for family in _models(PipelineConfig.model_fields["drafter"].annotation):
        kind = family.model_fields["kind"].default
        assert any(h.startswith(f"drafter with kind: {kind}") for h in headings), (kind, headings)
        for name, field in family.model_fields.items():
            assert any(r[0] == name and r[-1] == _md_plain(field.description or "") for r in rows), (kind, name)


def test_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as f:
        f.write("\nSee [a page that does not exist](no-such-page.md).\n")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0, "a link to a missing page must fail `mkdocs build --strict`"
    assert "no-such-page.md" in proc.stdout + proc.stderr


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; details belong in docs/"


def test_readme_relative_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", link)]
    assert relative, "README.md links to no docs page"
    broken = [link for link in relative if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"
